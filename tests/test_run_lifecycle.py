"""A user's run lifecycle with the real launcher: Ctrl-C (SIGINT to the terminal's process group) and
SIGTERM (to the launcher alone) stop the whole run within 15 s with exit 130 / 143 and leave no process
of it behind (checked by pid); re-running the same command announces the resume, trains every step
that is left and acknowledges every group exactly once; the end writes a summary with the final weights."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.config import RunConfig
from asyncrl.store import TRAINER_GROUP, Store
from asyncrl_run.launcher import _prepare_run_dir, progress_line
from asyncrl_run.redis_server import EmbeddedRedis
from asyncrl_run.stall import stall_cause
from tests.services import ROOT

STOP_LIMIT_S = 15.0
OVERRIDES = ["experiment=tiny_demo", "name=lifecycle", "warmup.steps=5", "total_steps=12",
             "trainer.checkpoint_every=3"]


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "asyncrl_run.train", *OVERRIDES, f"run_dir={run_dir}"]


def start(run_dir: Path, log: Path) -> subprocess.Popen:
    """As from a terminal: the launcher leads its own process group (the terminal's foreground group)."""
    return subprocess.Popen(command(run_dir), cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def checkpoint_step(run_dir: Path) -> int:
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def wait_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout_s: float = 420) -> None:
    deadline = time.monotonic() + timeout_s
    while checkpoint_step(run_dir) < step:
        assert proc.poll() is None, f"the run exited early ({proc.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step}: {log.read_text()[-3000:]}"
        time.sleep(0.5)


def stop(proc: subprocess.Popen, sig: signal.Signals, to_group: bool) -> tuple[int, float, list[psutil.Process]]:
    """Send `sig`; -> (exit code, seconds to exit, the run's processes still alive after it exited)."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any("redis-server" in p.name() for p in tree) and any(p.name().startswith("raylet") for p in tree)
    sent = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    code = proc.wait(60)
    took = time.monotonic() - sent
    time.sleep(1.0)  # processes killed by the kernel's parent-death signal are reaped meanwhile
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # do not leak them into the rest of the suite; the assertion reports them
        p.kill()
    return code, took, alive


async def _acknowledgements(url: str, run: str) -> tuple[list[str], int]:
    store = Store.connect(url, run)
    try:
        consumed = await store.redis.lrange(store.key("consumed"), 0, -1)
        import msgpack

        ids = [msgpack.unpackb(blob, raw=False)[0] for blob in consumed]
        pending = (await store.redis.xpending(store.key("groups"), TRAINER_GROUP))["pending"]
        return ids, pending
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ctrl_c_and_sigterm_stop_the_run_and_a_rerun_resumes_it_to_the_end(tmp_path):
    run_dir, log = tmp_path / "lifecycle", tmp_path / "lifecycle.log"

    proc = start(run_dir, log)
    wait_checkpoint(proc, run_dir, 3, log)
    code, took, alive = stop(proc, signal.SIGINT, to_group=True)  # Ctrl-C in the terminal
    assert code == 130 and took < STOP_LIMIT_S and not alive, (code, took, alive, log.read_text()[-3000:])

    proc = start(run_dir, log)
    wait_checkpoint(proc, run_dir, 6, log)
    resumed = log.read_text()
    assert "holds a previous run" in resumed and "resuming run lifecycle from its step-" in resumed
    code, took, alive = stop(proc, signal.SIGTERM, to_group=False)  # `kill PID`, `ray job stop`
    assert code == 143 and took < STOP_LIMIT_S and not alive, (code, took, alive, log.read_text()[-3000:])
    assert "SIGTERM received" not in log.read_text()  # Ray's crash banner

    proc = start(run_dir, log)
    assert proc.wait(900) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert text.count("resuming run lifecycle from its step-") == 2
    assert "run lifecycle: 12/12 steps" in text

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_weights"] == str(run_dir / "final")
    assert (run_dir / "final" / "config.json").exists() and "model.path=" in summary["eval_command"]
    assert sum(summary["outcomes"]["arithmetic"].values()) > 0
    assert (run_dir / "trainer.log").read_text().count("checkpoint ") >= 4

    copy = tmp_path / "redis-copy"
    shutil.copytree(run_dir / "redis", copy)
    with EmbeddedRedis(copy) as server:
        acked, pending = asyncio.run(_acknowledgements(server.url, "lifecycle"))
    assert len(acked) == len(set(acked)) >= 12 * 16  # every group trained acknowledged once
    assert pending == 0  # nothing delivered and left hanging


def test_resume_false_moves_the_previous_run_aside(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000003").mkdir(parents=True)
    (run_dir / "trainer.log").write_text("old")
    _prepare_run_dir(RunConfig(name="run", resume=False), run_dir)
    assert list(run_dir.iterdir()) == []
    (archive,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert (archive / "checkpoints" / "step-00000003").is_dir() and (archive / "trainer.log").read_text() == "old"


STATUS = {"in_flight": 0, "queued": 0, "groups_open": 0, "groups_completed": 48, "episodes_per_s": 0.0,
          "pause_reasons": ["unconsumed_groups"], "by_env": {"arithmetic": {"healthy_services": 1}}}


def test_the_progress_line_shows_eta_rollout_state_and_a_stall_reason():
    steps = [{"step": s, "reward_mean": 0.5, "loss": 0.1, "weight_version": s, "staleness_mean": 0.5}
             for s in range(11, 14)]
    line = progress_line(100, 10, steps, STATUS, training_s=30.0)
    assert line.startswith("step 13/100 (13%), 30s, ETA 14m30s")
    assert "0 episodes in flight" in line and "paused: unconsumed_groups" in line
    assert stall_cause(STATUS) == ("trainer", "the orchestrator holds new groups (unconsumed_groups) with 0 episodes "
                                              "in flight: the trainer consumes no groups")
    idle = {**STATUS, "pause_reasons": []}
    assert stall_cause(idle) == ("env services", "no episode in flight (healthy env services: {'arithmetic': 1})")
    assert stall_cause(None) == ("orchestrator", "its /v1/status does not answer")
    assert stall_cause(STATUS, status_age_s=95) == ("orchestrator", "its /v1/status does not answer for 1m35s")
    hung = {**STATUS, "in_flight": 45, "by_env": {"arithmetic": {"healthy_services": 1, "in_flight": 0},
                                                  "hang": {"healthy_services": 1, "in_flight": 45}}}
    assert stall_cause(hung) == ("env hang", "45 episodes in flight at hang, the orchestrator holds new groups "
                                             "(unconsumed_groups), none completing a group: its services or the "
                                             "engines do not finish them")
