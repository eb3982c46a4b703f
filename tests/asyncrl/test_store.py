"""The Redis data model (docs/protocols/store.md) as asyncrl/store.py implements it, against a real redis-server."""

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import redis.exceptions

from asyncrl.store import RECORDED_TTL_S, Store
from asyncrl.types import GroupRecord, Sample, TrainedTokens
from asyncrl_run.redis_server import EmbeddedRedis
from tests.redis_faults import ReplyCuttingProxy


def make_sample(i: int, group_id: str = "g0", n: int = 12) -> Sample:
    rng = np.random.default_rng(i)
    mask = (np.arange(n) >= n // 2).astype(np.uint8)
    return Sample(
        sample_id=f"s{i}", session_id=f"sess{i}", group_id=group_id, task_id="t-1", env="arith",
        status="completed", reward=float(i % 2), tokens=rng.integers(0, 1000, n),
        loss_mask=mask, rollout_logprobs=np.where(mask, -rng.random(n), 0.0),
        weight_versions=np.where(mask, 3, -1), num_turns=1, engines=["e0"],
    )


async def add_group(store: Store, gid: str, size: int = 2) -> list[Sample]:
    samples = [make_sample(k, gid) for k in range(size)]
    refs = [await store.add_sample(s) for s in samples]
    await store.add_group(GroupRecord(gid, "t-1", "arith", refs, size))
    return samples


def test_sample_roundtrip_is_exact_and_compact():
    s = make_sample(1, n=4096)
    blob = s.encode()
    back = Sample.decode(blob)
    for name in ("tokens", "loss_mask", "rollout_logprobs", "weight_versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(s, name))
    assert back.reward == s.reward and back.engines == ["e0"]
    assert len(blob) < 4096 * 14  # packed arrays: 13 bytes/token + small header
    assert back.first_weight_version == 3


def test_sample_with_routed_experts_roundtrips_and_costs_2_bytes_an_entry():
    plain = make_sample(2, n=100)
    routing = np.random.default_rng(0).integers(-1, 256, (100, 6)).astype(np.int16)
    routed = Sample(**{**plain.__dict__, "routed_experts": routing})
    back = Sample.decode(routed.encode())
    np.testing.assert_array_equal(back.routed_experts, routing)
    assert len(routed.encode()) - len(plain.encode()) <= 100 * 6 * 2 + 64  # the bytes and two keys
    assert Sample.decode(plain.encode()).routed_experts is None
    with pytest.raises(ValueError, match="routed_experts has shape"):
        Sample(**{**plain.__dict__, "routed_experts": routing[:99]})


def test_sample_rejects_misaligned_arrays():
    with pytest.raises(ValueError, match="loss_mask has 3 entries, tokens 4"):
        Sample("s", "x", "g", "t", "e", "completed", 0.0, [1, 2, 3, 4], [0, 1, 1], [0] * 4, [0] * 4)


async def test_write_read_ack_trim(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name, retention_groups=1)
    written = {gid: await add_group(store, gid) for gid in ("g0", "g1", "g2")}
    got = await store.read_groups("c0", count=10)
    assert [g.record.group_id for g in got] == ["g0", "g1", "g2"]
    for g in got:
        assert [s.sample_id for s in g.samples] == [s.sample_id for s in written[g.record.group_id]]
        np.testing.assert_array_equal(g.samples[0].tokens, written[g.record.group_id][0].tokens)
    assert await store.unconsumed_groups() == 3 and await store.unread_groups() == 0
    await store.ack_groups(got)
    assert await store.unconsumed_groups() == 0
    # retention 1: the two oldest consumed groups and their samples are deleted
    assert await store.redis.xlen(store.key("groups")) == 1
    assert await store.redis.xlen(store.key("samples")) == 2
    assert await store.read_groups("c0", count=10, block_ms=10) == []
    await store.close()


async def test_trained_records_roundtrip_page_with_the_samples_and_go_with_them(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name, retention_groups=1)
    for gid in ("g0", "g1"):
        await add_group(store, gid)
    listed = await store.list_samples(count=3)
    assert [s.sample_id for _, s in listed] == ["s1", "s0", "s1"]  # newest first
    older = await store.list_samples(before=listed[-1][0], count=10)
    assert [s.sample_id for _, s in older] == ["s0"]
    got = await store.read_groups("c0", count=10)
    records = [TrainedTokens(ref, 1, 0, np.arange(12, dtype=np.float32) * -0.1, (np.arange(12) >= 6).astype(np.uint8))
               for g in got for ref in g.record.sample_refs]
    await store.add_trained(records)
    back = await store.trained([records[0].sample_ref, "9-9"])
    assert list(back) == [records[0].sample_ref]  # an untrained ref has no record
    np.testing.assert_array_equal(back[records[0].sample_ref].trainer_logprobs, records[0].trainer_logprobs)
    assert back[records[0].sample_ref].kept.tolist() == records[0].kept.tolist()
    await store.ack_groups(got)  # retention 1: g0's samples are deleted, and their trained records with them
    assert set(await store.trained(r.sample_ref for r in records)) == {r.sample_ref for r in records[2:]}
    await store.close()


async def test_reader_crash_before_ack_redelivers(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name)
    await add_group(store, "g0")
    await add_group(store, "g1")
    first = await store.read_groups("trainer-0", count=1)
    assert [g.record.group_id for g in first] == ["g0"]
    # the reader dies before XACK: the same consumer restarted gets g0 again, before new work
    again = await store.read_groups("trainer-0", count=2)
    assert [g.record.group_id for g in again] == ["g0", "g1"]
    # a different consumer claims deliveries of a crashed one once they are idle
    other = await store.read_groups("trainer-1", count=2, claim_idle_ms=0)
    assert sorted(g.record.group_id for g in other) == ["g0", "g1"]
    await store.ack_groups(other)
    assert await store.read_groups("trainer-0", count=2, block_ms=10) == []
    await store.close()


async def test_redis_restart_with_aof_loses_no_acked_write(tmp_path, run_name):
    # appendfsync always: the setting that promises it (everysec answered an HSET it then lost, once in a
    # full-suite run: redis postpones the AOF append while a background fsync runs)
    server = EmbeddedRedis(tmp_path / "r", appendfsync="always").start()
    store = Store.connect(server.url, run_name)
    await add_group(store, "g0")
    await add_group(store, "g1")
    await store.ack_groups(await store.read_groups("c", count=1))
    await store.record_snapshot(5, "/ckpt/5")
    await store.close()
    port = server.port
    server.kill()  # crash, no SHUTDOWN: only what reached the AOF survives
    server = EmbeddedRedis(tmp_path / "r", port=port, appendfsync="always").start()
    store = Store.connect(server.url, run_name)
    try:
        assert (await store.weights()).snapshot_version == 5
        rest = await store.read_groups("c", count=5, block_ms=10)
        assert [g.record.group_id for g in rest] == ["g1"]  # g0 stays acked, g1 is still owed
        assert await store.redis.llen(store.key("consumed")) == 1
    finally:
        await store.close()
        server.stop()


async def test_metrics_stream(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name)
    await store.add_metrics("trainer", {"reward": 0.5, "step": 1})
    await store.add_metrics("trainer", {"reward": 0.7, "step": 2})
    records = await store.read_metrics()
    assert [r[2]["reward"] for r in records] == [0.5, 0.7]
    assert await store.read_metrics(after=records[0][0]) == records[1:]
    await store.close()


async def test_claims_take_only_other_consumers_entries_and_exclude_skips_held_ones(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name)
    for gid in ("g0", "g1", "g2"):
        await add_group(store, gid)
    held = await store.read_groups("a", count=1)
    # a still holds g0 (idle, claimable): its next read gets new work, not its own entry back
    nxt = await store.read_groups("a", count=2, claim_idle_ms=0, exclude={held[0].stream_id})
    assert [g.record.group_id for g in nxt] == ["g1"]  # g0 counted (held, not fetched again) + g1
    # another consumer claims a's idle deliveries, then reads new entries
    other = await store.read_groups("b", count=5, claim_idle_ms=0, block_ms=10)
    assert [g.record.group_id for g in other] == ["g0", "g1", "g2"]
    await store.close()


async def test_a_task_cancelled_amid_store_calls_always_stops(redis_server, run_name):
    """redis-py's socket timeout runs every send through asyncio.wait_for, which on Python 3.11 can return
    normally when the cancellation lands as the send completes: 189 of 300 cancelled tasks kept running
    with redis-py's connection. The trainer's stop path (and test_data's cancel test) hung on that; Store's
    BoundedConnection bounds the send with asyncio.timeout instead."""
    store = Store.connect(redis_server.url, run_name)
    rng = np.random.default_rng(0)

    async def reading_forever():
        while True:
            await store.engines()

    try:
        for i in range(400):
            task = asyncio.create_task(reading_forever())
            await asyncio.sleep(float(rng.random()) * 0.003)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            assert done, f"cancellation {i} was lost: the task kept running"
    finally:
        task.cancel()
        await store.close()


async def test_a_hung_redis_fails_calls_after_the_command_timeout_and_they_work_once_it_answers(tmp_path, run_name):
    """SIGSTOP: the server keeps its sockets open and answers nothing, unlike a dead one (refused / reset).
    A 32 MB write on an open connection fills the socket buffers and waits in the send (bounded by
    BoundedConnection); a read on a new connection waits on the reply (redis-py's read timeout)."""
    server = EmbeddedRedis(tmp_path / "r", aof=False).start()
    store = Store.connect(server.url, run_name, command_timeout_s=0.5)
    try:
        await store.record_snapshot(1, "/ckpt/1")
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            for call, waits_in in ((store.redis.set(store.key("big"), b"x" * (32 << 20)), "sending"),
                                   (store.weights(), "reading")):
                started = time.monotonic()
                with pytest.raises(redis.exceptions.TimeoutError, match=waits_in):
                    await call
                assert 0.4 < time.monotonic() - started < 3.0
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert (await store.weights()).snapshot_version == 1
        await store.record_snapshot(2, "/ckpt/2")
        assert (await store.weights()).snapshot_version == 2
    finally:
        await store.close()
        server.stop()


async def test_with_retry_s_calls_ride_out_a_redis_that_stalls_or_restarts(tmp_path, run_name):
    server = EmbeddedRedis(tmp_path / "r", appendfsync="always").start()
    store = Store.connect(server.url, run_name, command_timeout_s=0.5, retry_s=10)
    loop = asyncio.get_running_loop()
    try:
        await store.record_snapshot(1, "/ckpt/1")
        os.kill(server.process.pid, signal.SIGSTOP)
        loop.call_later(2.0, os.kill, server.process.pid, signal.SIGCONT)
        started = time.monotonic()
        assert (await store.weights()).snapshot_version == 1  # timed out, retried, answered once resumed
        assert time.monotonic() - started > 1.5

        port = server.port
        server.kill()
        restarted = loop.run_in_executor(None, lambda: (time.sleep(1.5), EmbeddedRedis(
            tmp_path / "r", port=port, appendfsync="always").start())[1])
        await store.record_snapshot(2, "/ckpt/2")  # refused until the new server listens, then written
        server = await restarted
        assert (await store.weights()).snapshot_version == 2
    finally:
        await store.close()
        server.stop()


async def test_a_retried_add_samples_that_redis_had_applied_appends_nothing_more(redis_server, run_name):
    """The gateway's finish is retried by the orchestrator when it failed; if Redis had applied the write
    (its reply lost), the retry returns that write's ids instead of a second, unreferenced copy."""
    async with ReplyCuttingProxy.serving(redis_server.port, b"EVALSHA") as proxy:
        store = Store.connect(proxy.url, run_name)
        try:
            await store.add_samples([make_sample(0, "g0")], once="sess-0")  # loads the script
            samples = [make_sample(1, "g1"), make_sample(2, "g1")]
            proxy.armed = True
            with pytest.raises(redis.exceptions.ConnectionError):
                await store.add_samples(samples, once="sess-1")
            assert proxy.cuts == 1 and await store.redis.xlen(store.key("samples")) == 3  # applied all the same
            refs = await store.add_samples(samples, once="sess-1")
            assert await store.redis.xlen(store.key("samples")) == 3
            assert [s.sample_id for s in await store.get_samples(refs)] == ["s1", "s2"]
            assert await store.add_samples(samples, once="sess-1") == refs
            assert 0 < await store.redis.ttl(store.key("recorded:sess-1")) <= RECORDED_TTL_S
            assert await store.add_samples([], once="sess-2") == []
        finally:
            await store.close()
