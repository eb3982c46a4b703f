"""Must-show: kill the trainer mid-step and resume; no group lost, none used twice.

One lineage of real trainer processes on a real redis-server, against an uninterrupted in-process run
on the same groups:
  run 1  SIGKILL inside step 4's forward pass      (checkpoint at step 2; step 3 trained, not durable)
  run 2  resumes at step 2; SIGKILL after the checkpoint of step 4 is durable, before its XACK
  run 3  resumes at step 4 (acknowledges steps 3-4's groups without training them, publishes step 4's
         record, which run 2 died before publishing), trains step 5,
         then waits for groups that never come: SIGTERM -> checkpoint, acknowledge, exit 0
The surviving lineage (run 1 up to its checkpoint, run 2 up to its checkpoint, run 3) must train every
group exactly once, in the same steps as the uninterrupted run, and end with bit-identical weights.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.model.io import read_tensors
from asyncrl.model.model import Glm5ForCausalLM
from asyncrl.store import TRAINER_GROUP, Store
from tests.services import ROOT
from tests.trainer.conftest import SUBPROCESS_ENV
from tests.trainer.crash_worker import install
from tests.trainer.helpers import policy_groups, write_groups
from trainer.run import build_trainer, load_config

pytestmark = pytest.mark.timeout(240)

GROUPS, STEPS = 10, 5


def overrides(redis_url: str, name: str, run_dir, total_steps: int = STEPS) -> list[str]:
    return [f"redis.url={redis_url}", f"name={name}", f"run_dir={run_dir}", f"total_steps={total_steps}",
            "trainer.groups_per_step=2", "trainer.checkpoint_every=2", "trainer.staleness_tau=100",
            "trainer.lr=1e-3", "trainer.micro_batch_tokens=64"]


def start(log, crash: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.trainer.crash_worker", str(log), crash, *args], cwd=ROOT,
                            env={**os.environ, **SUBPROCESS_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def trained(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def checkpoint_state(run_dir) -> dict:
    latest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return json.loads((latest / "trainer_state.json").read_text())


async def pending(store: Store) -> int:
    return (await store.redis.xpending(store.key("groups"), TRAINER_GROUP))["pending"]


async def test_killed_trainer_resumes_without_losing_or_repeating_a_group(redis_server, run_name, tiny_section,
                                                                          tmp_path):
    groups = policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), GROUPS)
    store = Store.connect(redis_server.url, run_name)
    reference_store = Store.connect(redis_server.url, run_name + "-ref")
    ids = await write_groups(store, groups)
    reference_ids = await write_groups(reference_store, groups)
    run_dir, log = tmp_path / "run", tmp_path / "trained.jsonl"
    args = overrides(redis_server.url, run_name, run_dir)

    # run 1: dies inside step 4
    first = start(log, "train:4", args)
    assert first.wait(timeout=120) == -signal.SIGKILL, first.stderr.read().decode()[-3000:]
    assert [e["step"] for e in trained(log)] == [1, 2, 3] and checkpoint_state(run_dir)["step"] == 2
    run1 = trained(log)[:2]

    # run 2: dies between the durable checkpoint of step 4 and its acknowledgement
    second = start(log, "commit:4", args)
    assert second.wait(timeout=120) == -signal.SIGKILL, second.stderr.read().decode()[-3000:]
    run2 = trained(log)[3:]
    assert [e["step"] for e in run2] == [3, 4]
    state = checkpoint_state(run_dir)
    assert state["step"] == 4 and set(state["trained_stream_ids"]) == {g for e in run2 for g in e["groups"]}
    assert await pending(store) == 4  # steps 3-4's groups: durable in the checkpoint, not acknowledged

    # run 3: resumes, trains step 5, waits for more groups; SIGTERM stops it cleanly
    third = start(log, "none", overrides(redis_server.url, run_name, run_dir, total_steps=STEPS + 1))
    deadline = time.monotonic() + 120
    while len(trained(log)) < 6:
        assert third.poll() is None and time.monotonic() < deadline, third.stderr.read().decode()[-3000:]
        time.sleep(0.1)
    third.send_signal(signal.SIGTERM)
    assert third.wait(timeout=60) == 0, third.stderr.read().decode()[-3000:]
    run3 = trained(log)[5:]
    assert [e["step"] for e in run3] == [5] and checkpoint_state(run_dir)["step"] == 5

    lineage = run1 + run2 + run3
    used = [g for e in lineage for g in e["groups"]]
    assert sorted(used) == sorted(ids)                      # none lost, none used twice
    assert set(trained(log)[2]["groups"]) <= set(used)     # run 1's lost step 3 was trained again
    assert await pending(store) == 0 and await store.unconsumed_groups() == 0
    # run 2 died before publishing step 4's record: run 3 published it from the checkpoint
    records = [v for _, source, v in await store.read_metrics() if source == "trainer"]
    assert {int(r["step"]) for r in records} == set(range(1, STEPS + 1))
    assert [int(r["step"]) for r in records if r.get("republished")] == [4]

    # the same steps and the same weights as a trainer that never died
    ref_dir, ref_log = tmp_path / "reference", tmp_path / "reference.jsonl"
    reference = build_trainer(load_config(overrides(redis_server.url, run_name + "-ref", ref_dir)))
    install(reference, "none", str(ref_log))
    await reference.run(STEPS)
    await reference.close()
    def steps(entries, stream_ids):  # stream ids differ between the two runs: compare group numbers
        return [(e["step"], [stream_ids.index(g) for g in e["groups"]]) for e in entries]
    assert steps(trained(ref_log), reference_ids) == steps(lineage, ids)
    ours, theirs = (read_tensors(sorted((d / "checkpoints").glob("step-*"))[-1] / "model") for d in (run_dir, ref_dir))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # resuming after run 1 pushed past its checkpoint re-pushed the restored weights as a newer version
    assert checkpoint_state(run_dir)["weight_version"] > checkpoint_state(ref_dir)["weight_version"]
    await store.close()
    await reference_store.close()
