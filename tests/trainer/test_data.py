import asyncio

import msgpack
import numpy as np
import pytest
import torch

from asyncrl.config import TrainerConfig
from asyncrl.store import Store
from asyncrl.types import GroupRecord
from asyncrl_run.redis_server import EmbeddedRedis
from tests.redis_faults import AofTail
from tests.trainer.helpers import make_sample
from trainer.advantages import ScoredSample, score_group
from trainer.backends.base import StepResult
from trainer.data import GroupLoader
from trainer.loop import step_metrics
from trainer.losses import direct_double_sided_is_loss
from trainer.packing import fill_ratio, first_fit_decreasing, pack, to_micro_batch

pytestmark = pytest.mark.timeout(60)  # a loader bug shows up as a hang: fail fast


# Packing ---------------------------------------------------------------------------------------
def scored(sample_id, prompt_len=4, gen_len=4, advantage=0.5, seed=0):
    return ScoredSample(make_sample(sample_id, prompt_len=prompt_len, gen_len=gen_len, seed=seed), advantage)


def test_next_token_alignment_of_one_sample():
    item = scored("a", prompt_len=3, gen_len=5, advantage=-0.25)
    s = item.sample
    mb = to_micro_batch([item])
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, 7]
    assert mb.input_ids.tolist() == s.tokens[:-1].tolist()
    assert mb.targets.tolist() == s.tokens[1:].tolist()
    # position i predicts t[i+1]: its mask / rollout log-prob are those of t[i+1]
    assert mb.loss_mask.tolist() == [False, False, True, True, True, True, True]
    assert mb.rollout_logprobs.tolist() == s.rollout_logprobs[1:].astype(np.float32).tolist()
    assert mb.advantages.tolist() == [0, 0, -0.25, -0.25, -0.25, -0.25, -0.25]
    assert (mb.num_loss_tokens, mb.num_loss_sequences, mb.max_seqlen) == (5, 1, 7)


def test_first_fit_decreasing_hand_case():
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]
    assert first_fit_decreasing([12, 3, 9], 10) == [[0], [2], [1]]  # 12 alone over budget, 3 fits no 9-bin
    assert first_fit_decreasing([], 10) == []


def test_pack_keeps_every_sample_once_within_budget_and_is_deterministic():
    rng = np.random.default_rng(0)
    items = [scored(f"s{i}", prompt_len=int(rng.integers(2, 40)), gen_len=int(rng.integers(0, 60)), seed=i,
                    advantage=float(i)) for i in range(40)]
    mbs = pack(items, micro_batch_tokens=128)
    assert sorted(sid for mb in mbs for sid in mb.sample_ids) == sorted(s.sample.sample_id for s in items)
    assert all(mb.num_tokens <= 128 for mb in mbs)
    by_id = {s.sample.sample_id: s for s in items}
    for mb in mbs:  # each cu_seqlens span is exactly its sample, aligned as in the single-sample test
        for k, sid in enumerate(mb.sample_ids):
            lo, hi = mb.cu_seqlens[k].item(), mb.cu_seqlens[k + 1].item()
            sample = by_id[sid].sample
            assert mb.input_ids[lo:hi].tolist() == sample.tokens[:-1].tolist()
            assert mb.targets[lo:hi].tolist() == sample.tokens[1:].tolist()
            assert mb.advantages[lo:hi].tolist() == by_id[sid].token_advantages()[1:].tolist()
    again = pack(items, micro_batch_tokens=128)
    for a, b in zip(mbs, again, strict=True):
        assert a.sample_ids == b.sample_ids and torch.equal(a.input_ids, b.input_ids)


def test_fill_ratio_on_agentic_length_distribution():
    """Long-tailed lengths (lognormal, median ~600 tokens): FFD leaves < 3% of the budget unused."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(600), 0.8, size=256), 32, 4000).astype(int)
    items = [ScoredSample(make_sample(f"s{i}", prompt_len=16, gen_len=int(n) - 16, seed=i), 1.0)
             for i, n in enumerate(lengths)]
    mbs = pack(items, micro_batch_tokens=4096)
    assert fill_ratio(mbs, 4096) > 0.97
    assert len(mbs) <= int(np.ceil((lengths - 1).sum() / 4096)) + 1  # within one of the lower bound


def test_sequence_loss_over_packed_micro_batches_equals_mean_of_sample_means():
    items = [scored(f"s{i}", prompt_len=3, gen_len=2 + 3 * i, seed=i, advantage=1.0 + i) for i in range(5)]
    mbs = pack(items, micro_batch_tokens=24)
    assert len(mbs) > 1
    g = torch.Generator().manual_seed(0)
    normalizer = sum(mb.num_loss_sequences for mb in mbs)
    total, per_sample = 0.0, {}
    for mb in mbs:  # on-policy logprobs: per-token term = -A * logp
        logp = -torch.rand(mb.num_tokens, generator=g, dtype=torch.float64)
        loss, _ = direct_double_sided_is_loss(logp, logp.clone(), mb.advantages.double(), mb.loss_mask, 0.2, 0.28,
                                              aggregation="sequence", cu_seqlens=mb.cu_seqlens, normalizer=normalizer)
        total += loss.item()
        for k, sid in enumerate(mb.sample_ids):
            span = slice(mb.cu_seqlens[k].item(), mb.cu_seqlens[k + 1].item())
            m = mb.loss_mask[span]
            per_sample[sid] = (-mb.advantages[span].double() * logp[span])[m].mean().item()
    assert total == pytest.approx(np.mean(list(per_sample.values())), abs=1e-12)


# Loader against a real redis-server -------------------------------------------------------------
CONFIG = TrainerConfig(groups_per_step=2, micro_batch_tokens=64, staleness_tau=2)


async def put_group(store: Store, gid: str, size: int = 4, statuses=None, version: int = 10, reasons=None,
                    env: str = "arith") -> None:
    """`reasons[i]`: (outcome class, reason) the orchestrator recorded in member i's finish info (None: none)."""
    statuses = statuses or ["completed"] * size
    samples = [make_sample(f"{gid}-{i}", group_id=gid, status=st, reward=float(i % 2), version=version, seed=i)
               for i, st in enumerate(statuses)]
    for sample, recorded in zip(samples, reasons or []):
        if recorded is not None:
            sample.metadata["info"] = {"outcome": recorded[0], "reason": recorded[1]}
    refs = [await store.add_sample(s) for s in samples]
    await store.add_group(GroupRecord(gid, "t", env, refs, size))


def group_ids(batch):
    return [g.record.group_id for g in batch.groups]


async def consumed_ids(store: Store) -> list[str]:
    return [msgpack.unpackb(b)[0] for b in await store.redis.lrange(store.key("consumed"), 0, -1)]


async def assert_nothing_left(loader: GroupLoader) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(loader.next_step(10), timeout=0.3)


@pytest.fixture
async def store(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name)
    yield store
    await store.close()


async def test_crashed_reader_gets_the_same_groups_and_no_group_is_used_twice(redis_server, run_name, store):
    for gid in ("g0", "g1", "g2", "g3"):
        await put_group(store, gid)
    crashed_store = Store.connect(redis_server.url, run_name)
    first = await GroupLoader(crashed_store, "trainer-0", CONFIG, block_ms=50).next_step(10)
    await crashed_store.close()  # the reader dies before the step is durable: no commit

    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
    again = await loader.next_step(10)
    assert group_ids(again) == group_ids(first) == ["g0", "g1"]
    assert again.stream_ids == first.stream_ids
    for a, b in zip(again.micro_batches, first.micro_batches, strict=True):
        assert a.sample_ids == b.sample_ids and torch.equal(a.input_ids, b.input_ids)
    await loader.commit(again)
    rest = await loader.next_step(10)
    assert group_ids(rest) == ["g2", "g3"]
    await loader.commit(rest)
    assert sorted(await consumed_ids(store)) == sorted(again.stream_ids + rest.stream_ids)  # each acked once
    assert await store.unconsumed_groups() == 0
    await assert_nothing_left(GroupLoader(store, "trainer-0", CONFIG, block_ms=50))


async def test_another_consumer_claims_the_groups_of_a_crashed_one(store):
    await put_group(store, "g0")
    await put_group(store, "g1")
    first = await GroupLoader(store, "trainer-0", CONFIG, block_ms=50).next_step(10)
    other = GroupLoader(store, "trainer-1", CONFIG, block_ms=50, claim_idle_ms=0)
    claimed = await other.next_step(10)
    assert claimed.stream_ids == first.stream_ids
    await other.commit(claimed)
    assert await store.unconsumed_groups() == 0


async def test_prefetched_steps_are_disjoint_and_commits_ack_once(store):
    for k in range(6):
        await put_group(store, f"g{k}")
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
    step1 = await loader.next_step(10)
    step2 = await loader.next_step(10)  # prefetched while step1 "trains"
    assert group_ids(step1) == ["g0", "g1"] and group_ids(step2) == ["g2", "g3"]
    assert loader.in_flight == 4
    await loader.commit(step2)  # out of order is fine
    await loader.commit(step1)
    await loader.commit(step1)  # a retried commit acknowledges nothing twice
    assert sorted(await consumed_ids(store)) == sorted(step1.stream_ids + step2.stream_ids)
    assert loader.in_flight == 0
    step3 = await loader.next_step(10)
    assert group_ids(step3) == ["g4", "g5"]
    samples = [sid for b in (step1, step2, step3) for mb in b.micro_batches for sid in mb.sample_ids]
    assert len(samples) == len(set(samples)) == 24  # no sample trained twice


async def test_prefetch_progresses_when_in_flight_groups_are_claimable(store):
    """In-flight groups idle past claim_idle_ms (a long step) must not be re-claimed by their own reader
    in place of new work (that would livelock at claim_idle_ms=0)."""
    for k in range(4):
        await put_group(store, f"g{k}")
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50, claim_idle_ms=0)
    step1 = await loader.next_step(10)
    step2 = await asyncio.wait_for(loader.next_step(10), timeout=5)
    assert group_ids(step1) == ["g0", "g1"] and group_ids(step2) == ["g2", "g3"]


async def test_dropped_groups_are_consumed_with_the_step_but_not_trained(store):
    await put_group(store, "stale", version=3)
    await put_group(store, "ok-a")
    await put_group(store, "failing", statuses=["failed", "failed", "completed", "completed"])
    await put_group(store, "padded", statuses=["completed", "completed", "completed", "failed"])
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
    batch = await loader.next_step(10)
    assert group_ids(batch) == ["stale", "ok-a", "failing", "padded"]
    trained_groups = {sid.rsplit("-", 1)[0] for mb in batch.micro_batches for sid in mb.sample_ids}
    assert trained_groups == {"ok-a", "padded"}
    assert sum(len(mb.sample_ids) for mb in batch.micro_batches) == 8  # 4 + 3 valid + 1 padding copy
    stats = batch.stats
    assert (stats.groups_kept, stats.groups_dropped, stats.groups_padded) == (2, 2, 1)
    assert (stats.stale, stats.failed, stats.padding_copies) == (4, 3, 1)
    assert batch.num_loss_tokens == 8 * 4 and batch.normalizer("token") == 32 and batch.normalizer("sequence") == 8
    await loader.commit(batch)
    assert await store.unconsumed_groups() == 0


async def test_failed_members_are_counted_by_class_env_and_reason_in_the_step_metrics(store):
    cut = ("infrastructure", "deadline_exceeded")
    await put_group(store, "swe-padded", env="swe", statuses=["completed", "failed", "completed", "completed"],
                    reasons=[("model", "completed"), cut, ("model", "completed"), ("model", "completed")])
    await put_group(store, "swe-dropped", env="swe", statuses=["failed", "failed", "truncated", "failed"],
                    reasons=[cut, ("environment", "env_error"), ("model", "max_turns"), None])
    await put_group(store, "arith-ok", env="arith", statuses=["completed", "truncated", "completed", "completed"])
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
    batch = await loader.next_step(10)
    trained = {sid for mb in batch.micro_batches for sid in mb.sample_ids}
    assert trained == {"swe-padded-0", "swe-padded-2", "swe-padded-3", "arith-ok-0", "arith-ok-1", "arith-ok-2",
                       "arith-ok-3"}  # a truncated member is the model's doing and trained; no failed one is
    metrics = step_metrics(batch, StepResult(0.0, 0.0, 1), None, 1, 10, 0.0, 1.0, 1.0)
    assert {k: v for k, v in metrics.items() if k.startswith("filter_failed")} == {
        "filter_failed": 4, "filter_failed_infrastructure": 2, "filter_failed_environment": 1,
        "filter_failed/swe/deadline_exceeded": 2, "filter_failed/swe/env_error": 1, "filter_failed/swe/unknown": 1}
    assert (metrics["filter_groups_kept"], metrics["filter_groups_padded"], metrics["filter_groups_dropped"]) == (2, 1, 1)
    await loader.commit(batch)


async def test_groups_trained_before_a_crash_are_acked_not_retrained(redis_server, run_name, store):
    for k in range(4):
        await put_group(store, f"g{k}")
    crashed_store = Store.connect(redis_server.url, run_name)
    trained = await GroupLoader(crashed_store, "trainer-0", CONFIG, block_ms=50).next_step(10)
    durable_ids = trained.stream_ids  # saved with the checkpoint; the process died before XACK
    await crashed_store.close()
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50, trained_stream_ids=durable_ids)
    batch = await loader.next_step(10)
    assert group_ids(batch) == ["g2", "g3"]
    assert sorted(await consumed_ids(store)) == sorted(durable_ids)
    await loader.commit(batch)
    assert await store.unconsumed_groups() == 0


async def test_cancelled_next_step_hands_its_groups_to_the_next_call(store):
    await put_group(store, "g0")
    loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
    waiting = asyncio.create_task(loader.next_step(10))  # one group of two: it keeps waiting
    await asyncio.sleep(0.3)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert loader.in_flight == 0
    await put_group(store, "g1")
    batch = await loader.next_step(10)
    assert group_ids(batch) == ["g0", "g1"]


async def test_a_redis_restart_that_lost_writes_loses_acks_and_samples_not_the_trainer(tmp_path, run_name):
    """An AOF without its last writes (appendfsync everysec, a host crash): acknowledgements it lost bring
    trained groups back, which are acknowledged again and counted, not trained twice; a group whose sample
    it lost (the orchestrator appends the record from memory after the restart) is read without that member
    instead of failing every read."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    aof = AofTail(server, tmp_path)
    store = Store.connect(server.url, run_name, retry_s=30)
    try:
        for k in range(4):
            await put_group(store, f"g{k}")
        loader = GroupLoader(store, "trainer-0", CONFIG, block_ms=50)
        first = await loader.next_step(10)
        aof.mark()
        await loader.commit(first)
        lost_sample = await store.add_sample(make_sample("g4-0", group_id="g4", reward=1.0, version=10))
        aof.lose()
        samples = [make_sample(f"g4-{i}", group_id="g4", reward=float(i % 2), version=10, seed=i) for i in (1, 2, 3)]
        await store.add_group(GroupRecord("g4", "t", "arith", [lost_sample] + [await store.add_sample(s)
                                                                             for s in samples], 4))
        second = await loader.next_step(10)
        assert group_ids(first) == ["g0", "g1"] and group_ids(second) == ["g2", "g3"]
        assert second.stats.redelivered == 2
        await loader.commit(second)
        g4 = (await store.read_groups("trainer-0", count=1, block_ms=50))[0]
        assert g4.record.group_id == "g4" and len(g4.samples) == 3
        assert score_group(g4, 10, CONFIG.staleness_tau, CONFIG.advantage).stats.missing == 1
    finally:
        await store.close()
        server.stop()
