"""The only engine SIGKILLed mid-run (turns in flight): the gateway holds its turns open until the engine's
actor has relaunched it (gateway.engine_wait_s) and they continue there, so the run finishes every step with
no episode failed, no group given up, and nothing recorded or trained twice."""

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import msgpack
import pytest

from asyncrl.store import Store
from tests.test_e2e_run import _in_copy, kill, launch, records_after_run, wait_step

STEPS = 6


def wait_turns_in_flight(run_dir: Path, timeout_s: float = 120) -> None:
    """Until the gateway has open sessions: a kill now lands on turns being generated."""
    url = (run_dir / "services" / "gateway.url").read_text().strip()
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=10).json()["sessions_active"] == 0:
        assert time.monotonic() < deadline, "no episode in flight"
        time.sleep(0.05)


async def _ledger(url: str, run: str) -> dict:
    store = Store.connect(url, run)
    try:
        groups = [msgpack.unpackb(fields[b"data"], raw=False) for _, fields in await store.redis.xrange(store.key("groups"))]
        samples = [fields[b"sample_id"].decode() for _, fields in await store.redis.xrange(store.key("samples"))]
        consumed = [msgpack.unpackb(e, raw=False)[0] for e in await store.redis.lrange(store.key("consumed"), 0, -1)]
        meta = {k.decode(): int(v) for k, v in (await store.redis.hgetall(store.key("orch:meta"))).items()
                if k.decode().startswith("failed:")}
        return {"groups": groups, "samples": samples, "consumed": consumed, "given_up": meta}
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killing_the_only_engine_mid_run_gives_up_nothing(tmp_path):
    run_dir = tmp_path / "engine_loss"
    proc = launch(run_dir, "engine_loss", f"total_steps={STEPS}", "warmup.steps=5", "trainer.groups_per_step=8",
                  "rollout.health_check_interval_s=1")
    try:
        wait_step(proc, run_dir, 2)
        wait_turns_in_flight(run_dir)
        kill(run_dir / "engines" / "engine-0.pid")
        assert proc.wait(480) == 0, (tmp_path / "engine_loss.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    assert (run_dir / "engines" / "engine-0.log").read_text().count("listening on") >= 2  # relaunched
    gateway_log = (run_dir / "services" / "gateway.log").read_text()
    assert "no engine left to run its turn" in gateway_log  # turns did wait for the engine
    assert "gateway.engine_wait_s" not in gateway_log  # and none of them gave up waiting
    steps = [int(r["step"]) for r in records_after_run(run_dir, tmp_path)]
    assert steps == list(range(1, STEPS + 1))
    ledger = asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy-ledger", _ledger))
    assert ledger["given_up"] and not any(ledger["given_up"].values()), ledger["given_up"]  # failed:<env> == 0
    group_ids = [g["group_id"] for g in ledger["groups"]]
    refs = [ref for g in ledger["groups"] for ref in g["sample_refs"]]
    assert len(group_ids) == len(set(group_ids)) >= STEPS * 8  # no group recorded twice
    assert len(refs) == len(set(refs)) and len(ledger["samples"]) == len(set(ledger["samples"]))
    assert len(ledger["consumed"]) == len(set(ledger["consumed"]))  # no group trained twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(set(classes) == {"model"} for classes in summary["outcomes"].values()), summary["outcomes"]
