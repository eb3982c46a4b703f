"""The whole system end to end: `python -m asyncrl_run.train experiment=tiny_demo` learns; survives an env
service, an engine, the trainer, the gateway, the orchestrator, the embedded redis-server and the launcher
being killed, losing nothing; stops naming the component when one cannot come back or progress stalls;
and runs with every push method in both modes."""

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgpack
import psutil
import pytest
import redis

from asyncrl.store import Store
from asyncrl_run.redis_server import EmbeddedRedis
from tests.services import ROOT, wait_until
from tests.wandb_files import read_offline_runs


def launch(run_dir: Path, name: str, *overrides: str, experiment: str = "tiny_demo") -> subprocess.Popen:
    log = open(run_dir.parent / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "asyncrl_run.train", f"experiment={experiment}", f"name={name}",
                             f"run_dir={run_dir}", *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


async def _trainer_records(url: str, run: str) -> list[dict]:
    store = Store.connect(url, run)
    try:
        return [v for _, source, v in await store.read_metrics(count=1_000_000) if source == "trainer"]
    finally:
        await store.close()


def records_after_run(run_dir: Path, tmp_path: Path) -> list[dict]:
    """The run's own record, read back from a copy of its AOF."""
    return asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy", _trainer_records))


def live_step(run_dir: Path) -> int:
    try:
        records = asyncio.run(_trainer_records((run_dir / "redis.url").read_text(), run_dir.name))
    except (OSError, ConnectionError, Exception):
        return 0
    return int(records[-1]["step"]) if records else 0


def wait_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while live_step(run_dir) < step:
        assert proc.poll() is None, f"the run exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(1)


LOOPBACK = ("127.", "::ffff:127.", "::1")


def listeners(pid: int) -> list[tuple[str, str]]:
    """(process name, bound address) of every listening TCP socket of `pid` and its descendants."""
    found = []
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            found += [(process.name(), c.laddr.ip) for c in process.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # exited meanwhile
            pass
    return found


def kill(pid_file: Path) -> int:
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_demo_learns_under_async_grpo(tmp_path):
    run_dir = tmp_path / "e2e_learn"
    proc = launch(run_dir, "e2e_learn", "total_steps=40")
    assert proc.wait(800) == 0, (tmp_path / "e2e_learn.log").read_text()[-4000:]
    rewards = [r["reward_mean"] for r in records_after_run(run_dir, tmp_path)]
    assert len(rewards) == 40
    before, after = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert after > before + 0.05, (before, after)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    board = subprocess.run([str(Path(sys.executable).parent / "tensorboard"), "--inspect", "--logdir",
                            str(run_dir / "tensorboard")], capture_output=True, text=True, timeout=120)
    assert "rollout/reward_mean" in board.stdout + board.stderr  # the README's tensorboard command reads them


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_survives_env_engine_and_trainer_kills(tmp_path):
    """With routing replay on (its flags reach the relaunched engine too)."""
    run_dir = tmp_path / "e2e_kill"
    proc = launch(run_dir, "e2e_kill", "total_steps=24", "warmup.steps=20", "trainer.groups_per_step=8",
                  "trainer.checkpoint_every=4", "orchestrator.heartbeat_timeout_s=4", "orchestrator.heartbeat_interval_s=1",
                  "rollout.health_check_interval_s=1", "rollout.routing_replay=true")
    try:
        wait_step(proc, run_dir, 4)
        kill(run_dir / "services" / "env-arithmetic-0.pid")
        wait_step(proc, run_dir, 9)
        kill(run_dir / "engines" / "engine-0.pid")
        wait_step(proc, run_dir, 14)
        trainer_pid = kill(run_dir / "trainer.pid")
        assert proc.wait(700) == 0, (tmp_path / "e2e_kill.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    records = records_after_run(run_dir, tmp_path)
    steps = [int(r["step"]) for r in records]
    assert steps[-1] == 24 and set(steps) == set(range(1, 25))  # steps after the last checkpoint were redone
    assert min(r["routing_replayed"] for r in records) > 0.9  # every step trained on the engines' routing
    assert int((run_dir / "trainer.pid").read_text()) != trainer_pid  # a new trainer process finished the run
    engine_log = (run_dir / "engines" / "engine-0.log").read_text()
    assert engine_log.count("listening on") >= 2  # the engine was relaunched
    env_log = (run_dir / "services" / "env-arithmetic-0.log").read_text()
    assert env_log.count("listening on") >= 2  # the env service was relaunched
    groups = asyncio.run(_acked_groups(run_dir, tmp_path))
    assert len(groups) == len(set(groups)) and len(groups) >= 24 * 8  # every trained group acknowledged once
    print("stale members per step:", [(int(r["step"]), int(r["filter_stale"]), int(r["filter_groups_dropped"]))
                                      for r in records])
    # the restarted trainer pushed its checkpoint's weights under a new version; the groups delivered before
    # the kill come back in their order and are measured along that line (TrainerState.lineage_version), so
    # each redone step drops exactly what the killed trainer's step dropped (groups an engine generated at old
    # weights after its own relaunch are stale in both lines; renumbering by the raw versions would drop
    # every redelivered group at the first redone step)
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    first = {int(r["step"]): r for r in records[:restart]}
    redone = [r for r in records[restart:] if int(r["step"]) in first]
    assert redone
    for r in redone:
        assert (r["filter_stale"], r["filter_groups_dropped"]) == \
            (first[int(r["step"])]["filter_stale"], first[int(r["step"])]["filter_groups_dropped"]), r["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_survives_gateway_orchestrator_and_redis_kills(tmp_path):
    """The gateway and the orchestrator bind a free port at the start; their supervisors restart them on that
    same port, where the orchestrator (gateway URL) and the env services (orchestrator URL) look. The
    restarted orchestrator rebuilds its groups from Redis and re-dispatches the episodes of the dead one's
    attempts. The launcher restarts the embedded redis-server on its address from its AOF (appendfsync
    always: every acknowledged write survives), and every component's client reconnects."""
    run_dir = tmp_path / "e2e_control"
    proc = launch(run_dir, "e2e_control", "total_steps=16", "warmup.steps=20", "trainer.groups_per_step=8",
                  "trainer.checkpoint_every=4", "orchestrator.heartbeat_timeout_s=4",
                  "orchestrator.heartbeat_interval_s=1")
    services = run_dir / "services"
    try:
        wait_step(proc, run_dir, 4)
        exposed = [(name, address) for name, address in listeners(proc.pid) if not address.startswith(LOOPBACK)]
        assert not exposed, exposed  # Ray's servers and ours (README "What listens where")
        urls = {name: (services / f"{name}.url").read_text() for name in ("gateway", "orchestrator")}
        killed = {"gateway": kill(services / "gateway.pid")}
        wait_step(proc, run_dir, 8, timeout_s=120)
        killed["orchestrator"] = kill(services / "orchestrator.pid")
        wait_step(proc, run_dir, 12, timeout_s=120)
        os.kill(redis.Redis.from_url((run_dir / "redis.url").read_text()).info("server")["process_id"],
                signal.SIGKILL)
        assert proc.wait(300) == 0, (tmp_path / "e2e_control.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    for name, url in urls.items():
        log = (services / f"{name}.log").read_text()
        assert log.count(f"listening on {url}") >= 2, name  # restarted where its clients look
        assert int((services / f"{name}.pid").read_text()) != killed[name]
    assert "embedded redis-server died (exit code -9): restarting it from its AOF" in (run_dir / "launcher.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["lost_to_redis"] == {}  # always: nothing to count
    records = records_after_run(run_dir, tmp_path)
    assert sorted(int(r["step"]) for r in records) == list(range(1, 17))
    groups = asyncio.run(_acked_groups(run_dir, tmp_path))
    assert len(groups) == len(set(groups)) and len(groups) >= 16 * 8  # every trained group acknowledged once


def sessions_created(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("asyncrl_gateway_sessions_created_total"))


GATEWAY_RUN_STEPS = 40


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_gateways_share_the_sessions_and_one_may_die(tmp_path):
    """gateway.replicas=2: the orchestrator places sessions on the gateway with the fewest open; the killed one
    comes back on its port and takes sessions again, its sessions' episodes are dispatched again, and the other
    takes new sessions meanwhile. 40 steps: the run must outlast the restart (a step can take under a second)."""
    run_dir = tmp_path / "e2e_gateways"
    proc = launch(run_dir, "e2e_gateways", f"total_steps={GATEWAY_RUN_STEPS}", "warmup.steps=20",
                  "trainer.groups_per_step=8", "trainer.checkpoint_every=4", "gateway.replicas=2")
    services = run_dir / "services"
    try:
        wait_step(proc, run_dir, 3)
        urls = [(services / f"{name}.url").read_text().strip() for name in ("gateway", "gateway-1")]
        created = [sessions_created(url) for url in urls]
        assert min(created) > 0.3 * sum(created), created  # both take sessions
        killed = kill(services / "gateway-1.pid")
        log = services / "gateway-1.log"
        wait_until(lambda: log.read_text().count(f"listening on {urls[1]}") >= 2 or proc.poll() is not None, 120)
        assert proc.poll() is None, "the run ended before the killed gateway came back"
        wait_step(proc, run_dir, live_step(run_dir) + 3)
        assert sessions_created(urls[1]) > 0  # the restarted gateway (its counter from 0) takes sessions again
        assert proc.wait(300) == 0, (tmp_path / "e2e_gateways.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    assert int((services / "gateway-1.pid").read_text()) != killed
    steps = sorted(int(r["step"]) for r in records_after_run(run_dir, tmp_path))
    assert steps == list(range(1, GATEWAY_RUN_STEPS + 1))
    groups = asyncio.run(_acked_groups(run_dir, tmp_path))
    assert len(groups) == len(set(groups)) and len(groups) >= GATEWAY_RUN_STEPS * 8  # each trained group acked once


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_service_that_cannot_come_back_stops_the_run_naming_it(tmp_path):
    """The gateway is killed and its port taken: its supervisor's restarts fail (RESTART_ATTEMPTS, one per
    5 s tick) and the launcher stops the run with exit 1, naming the gateway and why, not a stall."""
    run_dir = tmp_path / "e2e_gone"
    proc = launch(run_dir, "e2e_gone", "total_steps=200", "warmup.steps=20", "trainer.groups_per_step=8")
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the dead server's TIME_WAIT sockets
    try:
        wait_step(proc, run_dir, 2)
        port = urlsplit((run_dir / "services" / "gateway.url").read_text().strip()).port
        kill(run_dir / "services" / "gateway.pid")
        deadline = time.monotonic() + 5
        while True:  # the port frees when the process is gone; take it before the supervisor's next tick
            try:
                squatter.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        squatter.listen()
        killed_at = time.monotonic()
        assert proc.wait(120) == 1
        stopped_s = time.monotonic() - killed_at
    finally:
        squatter.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    output = (tmp_path / "e2e_gone.log").read_text()
    assert "asyncrl: gateway failed: could not be restarted (3 attempts): gateway exited with" in output, output[-3000:]
    assert "address already in use" in output.lower()
    assert stopped_s < 60, stopped_s  # 3 ticks of 5 s, the launcher's 5 s check and the shutdown
    print(f"stopped {stopped_s:.1f} s after the kill")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_relaunch_stops_what_a_killed_launcher_left_running(tmp_path):
    """SIGKILL the launcher itself: Ray's agents outlive it (the rest dies with it); the same command again
    stops them, says which, and resumes the run to the end."""
    run_dir = tmp_path / "e2e_launcher"
    args = ("total_steps=6", "warmup.steps=20", "trainer.groups_per_step=8", "trainer.checkpoint_every=2")
    first = launch(run_dir, "e2e_launcher", *args)
    try:
        wait_step(first, run_dir, 3)
        recorded = json.loads((run_dir / "processes.json").read_text())["children"]
        first.kill()
        first.wait(30)
        time.sleep(2)
        left = [e for e in recorded if psutil.pid_exists(e["pid"])
                and psutil.Process(e["pid"]).status() != psutil.STATUS_ZOMBIE]
        assert {e["name"] for e in left} >= {"ray::DashboardAgent"}, left  # what this test is about
        (tmp_path / "e2e_launcher.log").rename(tmp_path / "e2e_launcher.first.log")
        second = launch(run_dir, "e2e_launcher", *args)
        assert second.wait(400) == 0, (tmp_path / "e2e_launcher.log").read_text()[-4000:]
    finally:
        for proc in [p for p in (first, locals().get("second")) if p is not None and p.poll() is None]:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    output = (tmp_path / "e2e_launcher.log").read_text()
    said = re.search(rf"the previous launch in {run_dir} left \d+ processes running: (.*); stopping them", output)
    assert said and "ray::DashboardAgent (pid" in said.group(1), output[-3000:]
    assert not [e for e in left if psutil.pid_exists(e["pid"])
                and abs(psutil.Process(e["pid"]).create_time() - e["started"]) < 0.01]
    assert sorted({int(r["step"]) for r in records_after_run(run_dir, tmp_path)}) == list(range(1, 7))


HANGING_ENV = """
import asyncio

from envs.sdk import Environment, EpisodeResult


class HangingEnv(Environment):
    name = "hanging"

    async def list_tasks(self, split="train"):
        return ["t0", "t1"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        await asyncio.sleep(3600)
        return EpisodeResult(reward=0.0)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stall_longer_than_the_limit_stops_the_run_naming_the_env(tmp_path):
    """Every episode of the run's only env hangs: no step ever comes, and past stall_limit_s the launcher
    stops the run (exit 1) naming that env, instead of waiting for the episodes' 600 s deadline and more."""
    (tmp_path / "hanging_env.py").write_text(HANGING_ENV)
    run_dir = tmp_path / "e2e_stall"
    proc = launch(run_dir, "e2e_stall", "total_steps=4", "warmup.steps=0", "stall_limit_s=20",
                  f"envs.services.arithmetic.target={tmp_path}/hanging_env.py:HangingEnv")
    try:
        assert proc.wait(300) == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    output = (tmp_path / "e2e_stall.log").read_text()
    assert "asyncrl: env arithmetic failed: no training step for" in output, output[-3000:]
    assert "episodes in flight at arithmetic" in output and "(stall_limit_s 20)" in output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_survives_a_redis_stall_longer_than_the_command_timeout(tmp_path):
    """SIGSTOP on the embedded redis-server for 35 s: every Redis command in flight fails after its 30 s
    timeout (asyncrl/store.py) and is retried; the run finishes every step, each group acknowledged once."""
    import redis

    run_dir = tmp_path / "e2e_stall"
    proc = launch(run_dir, "e2e_stall", "total_steps=12", "warmup.steps=20", "trainer.groups_per_step=8",
                  "trainer.checkpoint_every=4")
    try:
        wait_step(proc, run_dir, 4)
        client = redis.Redis.from_url((run_dir / "redis.url").read_text())
        pid = client.info("server")["process_id"]
        client.close()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(35)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert proc.wait(600) == 0, (tmp_path / "e2e_stall.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    records = records_after_run(run_dir, tmp_path)
    assert [int(r["step"]) for r in records] == list(range(1, 13))
    assert all(r["filter_groups_kept"] == 8 for r in records)
    # episodes that failed in the stall can leave a group with too few valid members: dropped (consumed by
    # the step that read it, not trained). Every group is acknowledged once, by the step that read it.
    dropped = int(sum(r["filter_groups_dropped"] for r in records))
    groups = asyncio.run(_acked_groups(run_dir, tmp_path))
    assert len(groups) == len(set(groups)) == 12 * 8 + dropped, [(r["step"], r["filter_failed"]) for r in records]
    sample_ids = asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy-3", _sample_ids))
    assert len(sample_ids) == len(set(sample_ids))  # a finish retried after a timeout recorded nothing twice
    logs = "".join(p.read_text() for p in (run_dir / "services").glob("*.log"))
    assert "TimeoutError" in logs  # the stall outlasted the command timeout: calls failed and were retried


WANDB_RUN = ("async", "tensor")
"""The one of these runs that also logs to W&B, offline, read back with W&B's own reader."""
WANDB_OVERRIDES = ("wandb.enabled=true", "wandb.mode=offline", "wandb.project=e2e", "wandb.group=push",
                   "wandb.tags=[e2e,tensor]", "orchestrator.auth_token=orch-secret", "gateway.auth_token=gw-secret")
"""The W&B run also has the orchestrator's and the gateway's tokens set: a run with them starts, trains and is
scraped (a guarded gateway /health once kept such a run from starting)."""
"""The orchestrator's token: the scrape lists the env services through its /v1/envs with it, and no secret
may reach the logged config."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,method", [("sync", "tensor"), ("sync", "distributed"), ("async", "tensor"),
                                         ("async", "distributed")])
def test_runs_finish_with_every_push_method_in_both_modes(mode, method, tmp_path, monkeypatch):
    """tensor and distributed pushes write no snapshot here (snapshot_every_pushes 10): the orchestrator's
    staleness rule follows the served version they move. 4 steps of 4 groups: async (tau 2) starts 3 steps'
    groups at v0, so step 4 needs v1 served; sync needs every step's push."""
    name = f"e2e_{mode}_{method}"
    run_dir = tmp_path / name
    wandb = (mode, method) == WANDB_RUN
    monkeypatch.setenv("WANDB_MODE", "offline")  # never online, whatever the config says
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    proc = launch(run_dir, name, f"mode={mode}", f"trainer.weight_push.method={method}", "total_steps=4",
                  "warmup.steps=5", "trainer.groups_per_step=4", *(WANDB_OVERRIDES if wandb else ()))
    try:
        assert proc.wait(240) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    records = records_after_run(run_dir, tmp_path)
    assert [(int(r["step"]), int(r["weight_version"])) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert all(r["push_failed_engines"] == 0 for r in records)  # every engine read back the pushed weights
    if mode == "sync":  # each batch generated by engines serving exactly the version the orchestrator gated on
        assert all(r["staleness_max"] == 0 for r in records)
    weights = asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy-weights", _weights))
    assert (weights.served_version, weights.method, weights.snapshot) == (4, method, None)
    if wandb:
        check_wandb_run(run_dir, name)
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard stays
    else:
        assert not (run_dir / "wandb").exists()  # off by default


def check_wandb_run(run_dir: Path, name: str) -> None:
    """One offline W&B run with one history row per trainer step, every panel group filled, the resolved
    config without secrets (read with wandb's own reader of the .wandb file)."""
    (run,) = read_offline_runs(run_dir / "wandb")
    assert run.steps == [1, 2, 3, 4] and run.exit_code == 0
    assert sum("train/loss" in row for row in run.history) == 4
    assert (run.run["project"], run.run["run_group"], run.run["tags"], run.run["display_name"]) == (
        "e2e", "push", ["e2e", "tensor"], name)
    keys = run.keys
    for key in ("train/loss", "train/wait_s", "rollout/reward_mean", "off_policy/mismatch_kl",
                "env/arithmetic/off_policy/ess_fraction", "env/arithmetic/rollout/reward_mean",  # trainer records
                "rollout/episodes_completed", "throughput/episodes_per_s", "env/arithmetic/completed",
                "system/orchestrator/paused",  # orchestrator records
                "system/gateway/samples_written_total", "system/trainer/steps_total",  # each service's /metrics
                "system/engine/engine-0/prompt_tokens_total", "env/arithmetic/orchestrator/reward_mean",
                "env/arithmetic/service/reward_mean"):
        assert key in keys, (key, sorted(keys))
    config = run.config()
    assert config["total_steps"] == 4 and config["wandb"]["project"] == "e2e"
    assert config["envs"]["services"]["arithmetic"]["target"] == "envs.tasks.ArithmeticEnv"  # nested sections too
    assert "orch-secret" not in json.dumps(config) and "auth_token" not in config["orchestrator"]
    assert "gw-secret" not in json.dumps(config)


async def _weights(url: str, run: str):
    store = Store.connect(url, run)
    try:
        return await store.weights()
    finally:
        await store.close()


async def _acked(url: str, run: str) -> list[str]:
    import msgpack

    store = Store.connect(url, run)
    try:
        entries = await store.redis.lrange(store.key("consumed"), 0, -1)
        return [msgpack.unpackb(e, raw=False)[0] for e in entries]
    finally:
        await store.close()


async def _sample_ids(url: str, run: str) -> list[str]:
    store = Store.connect(url, run)
    try:
        return [fields[b"sample_id"].decode() for _, fields in await store.redis.xrange(store.key("samples"))]
    finally:
        await store.close()


async def _in_copy(run_dir: Path, copy: Path, read):
    """`read(url, run)` against a redis-server started on a copy of the run's AOF."""
    shutil.copytree(run_dir / "redis", copy)
    server = EmbeddedRedis(copy).start()
    try:
        return await read(server.url, run_dir.name)
    finally:
        server.stop()


async def _trained_envs(url: str, run: str) -> list[str]:
    """The env of every group the trainer acknowledged (consumed list -> the groups stream's records)."""
    store = Store.connect(url, run)
    try:
        consumed = [msgpack.unpackb(e, raw=False)[0] for e in await store.redis.lrange(store.key("consumed"), 0, -1)]
        groups = {entry.decode(): fields[b"group_id"].decode()
                  for entry, fields in await store.redis.xrange(store.key("groups"))}
        return [groups[entry].rsplit("-", 1)[1] for entry in consumed]
    finally:
        await store.close()


def trained_envs(run_dir: Path, tmp_path: Path) -> list[str]:
    return asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy-envs", _trained_envs))


async def _acked_groups(run_dir: Path, tmp_path: Path) -> list[str]:
    return await _in_copy(run_dir, tmp_path / "redis-copy-2", _acked)
