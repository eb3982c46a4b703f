"""The tiny demo on a Ray cluster of two hosts that share neither loopback nor a disk (tests/hosts.py):
`ray start --head` on one, `ray start --address` on the other, `ray job submit`, as docs/run.md "A run
across hosts" says. The head runs the job's driver (the launcher, the embedded Redis), the orchestrator
and the trainer; the worker the engine, the gateway and the env service (cluster.placement). Checks
that it trains every step with every group acknowledged and none failed for the infrastructure, that
each service published its own host's address, that each host's disk holds only its own components'
files (the worker got the initial weights through Ray's object store), and that a disk push is refused
on such a cluster, naming the alternatives. Then the run is resumed for more steps: its new engine, on
the worker, starts from the newest weight snapshot, which only the head's disk held, fetched from the
trainer actor. (A `distributed` push across these hosts passed here once and failed once in CI, the
engine's gloo address published as 127.0.0.1: not covered until that is understood; docs/run.md.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import msgpack
import pytest

from asyncrl.store import Store
from asyncrl_run.redis_server import EmbeddedRedis
from tests.hosts import Hosts
from tests.services import ROOT

BIN = Path(sys.executable).parent
RUN = "multihost"
STEPS, MORE_STEPS, GROUPS_PER_STEP = 3, 5, 4
JOB = ["python", "-m", "asyncrl_run.train", "experiment=tiny_demo", f"name={RUN}", "warmup.steps=5",
       f"trainer.groups_per_step={GROUPS_PER_STEP}", "trainer.checkpoint_every=1",
       "trainer.weight_push.snapshot_every_pushes=1", "cluster.host=0.0.0.0",
       "cluster.placement.engines={rollout_node: 1}", "cluster.placement.gateway={rollout_node: 1}",
       "cluster.placement.envs={rollout_node: 1}", "cluster.placement.orchestrator={head_node: 1}",
       "cluster.placement.trainer={head_node: 1}"]

def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
            "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}


def _start_cluster(hosts: Hosts, logs: Path) -> None:
    head, worker = hosts["head"], hosts["worker"]
    temp = str(hosts.mount_point / "ray")
    hosts.popen(head, ["ray", "start", "--head", "--block", "--node-ip-address", head.address, "--port", "6379",
                       "--dashboard-host", "0.0.0.0", "--num-cpus", "2", "--temp-dir", temp,
                       "--resources", json.dumps({"head_node": 8})], _env(), logs / "ray-head.log", ROOT)
    token = head.disk / "home" / ".ray" / "auth_token"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the head is up once its GCS answers
        status = hosts.run(head, ["ray", "status", "--address", f"{head.address}:6379"], _env(), ROOT, 60)
        if status.returncode == 0:
            break
        time.sleep(2)
    else:
        pytest.fail(f"the Ray head did not come up:\n{(logs / 'ray-head.log').read_text()[-3000:]}")
    if token.exists():  # Ray's token auth: an operator copies the head's token to every node
        (worker.disk / "home" / ".ray").mkdir(parents=True, exist_ok=True)
        shutil.copy(token, worker.disk / "home" / ".ray" / "auth_token")
    hosts.popen(worker, ["ray", "start", "--block", "--address", f"{head.address}:6379", "--node-ip-address",
                         worker.address, "--num-cpus", "2", "--temp-dir", temp,
                         "--resources", json.dumps({"rollout_node": 8})], _env(), logs / "ray-worker.log", ROOT)
    while time.monotonic() < deadline:
        status = hosts.run(head, ["ray", "status", "--address", f"{head.address}:6379"], _env(), ROOT, 60)
        if "rollout_node" in status.stdout:
            return
        time.sleep(2)
    pytest.fail(f"the worker did not join:\n{(logs / 'ray-worker.log').read_text()[-3000:]}")


def _submit(hosts: Hosts, overrides: list[str]) -> tuple[int, str]:
    head = hosts["head"]
    argv = ["ray", "job", "submit", "--address", f"http://{head.address}:8265", "--working-dir", ".", "--",
            *JOB, f"run_dir={hosts.mount_point}/runs/{RUN}", *overrides]
    for _ in range(20):  # a head whose job agent is not up yet says so: submit again (README)
        job = hosts.run(head, argv, _env(), ROOT, 900)
        if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr:
            break
        time.sleep(3)
    return job.returncode, job.stdout + job.stderr


async def _redis_facts(url: str) -> dict:
    store = Store.connect(url, RUN)
    try:
        consumed = [msgpack.unpackb(e, raw=False)[0] for e in await store.redis.lrange(store.key("consumed"), 0, -1)]
        services = {k.decode(): v.decode() for k, v in (await store.redis.hgetall(store.key("services"))).items()}
        return {"consumed": consumed, "services": services}
    finally:
        await store.close()


def _in_copy_of_redis(run_dir: Path, copy: Path) -> dict:
    shutil.copytree(run_dir / "redis", copy)
    server = EmbeddedRedis(copy).start()
    try:
        return asyncio.run(_redis_facts(server.url))
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_tiny_demo_trains_on_two_hosts_that_share_no_disk(tmp_path, capsys):
    if reason := Hosts.unavailable():
        pytest.skip(reason)
    logs = tmp_path / "logs"
    logs.mkdir()
    with Hosts(tmp_path / "hosts", ["head", "worker"]) as hosts:
        head, worker = hosts["head"], hosts["worker"]
        with capsys.disabled():
            print(f"\nhosts: head {head.address} (netns {head.netns}), worker {worker.address} (netns "
                  f"{worker.netns}), bridge {hosts.bridge}; each sees its own disk at {hosts.mount_point}",
                  flush=True)
        _start_cluster(hosts, logs)

        code, out = _submit(hosts, [f"total_steps={STEPS}", "trainer.weight_push.method=disk"])
        assert code != 0, out[-3000:]
        assert "weight_push.method=disk" in out and "tensor" in out and "distributed" in out, out[-3000:]

        code, out = _submit(hosts, [f"total_steps={STEPS}", "trainer.weight_push.method=tensor"])
        assert code == 0, out[-6000:]
        run_on_head, run_on_worker = head.disk / "runs" / RUN, worker.disk / "runs" / RUN
        summary = json.loads((run_on_head / "summary.json").read_text())
        facts = _in_copy_of_redis(run_on_head, tmp_path / "redis-copy")
        snapshot = f"weights/v{STEPS:08d}"
        assert (run_on_head / snapshot / "config.json").exists() and not (run_on_worker / "weights").exists()

        code, out = _submit(hosts, [f"total_steps={MORE_STEPS}", "trainer.weight_push.method=tensor"])
        assert code == 0, out[-6000:]
        resumed = json.loads((run_on_head / "summary.json").read_text())
        more = _in_copy_of_redis(run_on_head, tmp_path / "redis-copy-resumed")
    assert summary["steps"] == STEPS, summary
    assert len(facts["consumed"]) == STEPS * GROUPS_PER_STEP, facts["consumed"]
    outcomes = summary["outcomes"]["arithmetic"]
    assert set(outcomes) == {"model"} and outcomes["model"] >= STEPS * GROUPS_PER_STEP * 8, outcomes  # none failed
    services = facts["services"]
    assert services["gateway"].startswith(f"http://{worker.address}:"), services
    assert services["orchestrator"].startswith(f"http://{head.address}:"), services
    # Each host's disk holds its own components' files only: nothing was shared.
    assert (run_on_worker / "engines" / "engine-0.log").exists() and not (run_on_head / "engines").exists()
    assert (run_on_worker / "services" / "gateway.log").exists()
    assert not (run_on_head / "services" / "gateway.log").exists()
    assert (run_on_worker / "warmup" / "config.json").exists()  # shipped through Ray's object store
    assert (run_on_head / "checkpoints").is_dir() and not (run_on_worker / "checkpoints").exists()
    # The resumed run: every step, every group once; its engine fetched the v3 snapshot from the trainer.
    assert resumed["steps"] == MORE_STEPS, resumed
    assert len(more["consumed"]) == MORE_STEPS * GROUPS_PER_STEP == len(set(more["consumed"])), more["consumed"]
    assert (run_on_worker / snapshot / "config.json").exists()
    # Every push reached the engine, in both runs.
    trainer_log = (run_on_head / "trainer.log").read_text()
    assert f"trainer metrics at http://{head.address}:" in trainer_log
    assert "did not reach" not in trainer_log, trainer_log[-3000:]
    assert trainer_log.count("by tensor to 1 engines") == MORE_STEPS, trainer_log[-3000:]
    with capsys.disabled():
        print(f"multi-host run: {summary['steps']} steps, {len(facts['consumed'])} groups acknowledged, outcomes "
              f"{outcomes}; gateway {services['gateway']}, orchestrator {services['orchestrator']}", flush=True)
