"""`asyncrl watch` in a pseudo-terminal against a real run's Redis, with the records its real writers
append: a real orchestrator process (TimedEnv services: some episodes sleep long, so they stay in
flight) and a real trainer stepping on real groups. The screen (tests/asyncrl_run/terminal.py) shows the
env table, the orchestrator's in-flight count and its pause reason; when the last step is trained the
dashboard turns into the finished run's summary; after the run (its Redis stopped) the summary comes
from what the run dir keeps: its Redis data, or the launcher's summary.json. Wrong run dirs get one line
and exit code 2."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.config import TrainerConfig, WeightPushConfig, load_model_section
from asyncrl.model.model import Glm5ForCausalLM
from asyncrl.store import Store
from asyncrl_run.redis_server import EmbeddedRedis
from asyncrl_run.run_summary import summarize
from tests.asyncrl_run.terminal import Terminal
from tests.orchestrator.conftest import Orchestrator, start_envs
from tests.services import ROOT
from tests.trainer.helpers import policy_groups, write_groups
from trainer.actor import Trainer

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)  # the tiny model on a shared 2-core box (tests/trainer/conftest.py)

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
WATCH = [sys.executable, "-m", "asyncrl_run.cli", "watch"]


def watch_once(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*WATCH, *args], capture_output=True, text=True, cwd=ROOT, env={**ENV, "COLUMNS": "150"},
                          timeout=120)


async def orchestrator_records(store: Store) -> list[dict[str, float]]:
    return [values for _, source, values in await store.read_metrics(count=100_000) if source == "orchestrator"]


async def wait_record(store: Store, predicate, timeout_s: float = 30.0) -> dict[str, float]:
    """Until the orchestrator has appended a record matching `predicate` (it writes one every 5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = await orchestrator_records(store)
        if records and predicate(records[-1]):
            return records[-1]
        await asyncio.sleep(0.5)
    raise AssertionError(f"no orchestrator record matched; last {records[-1:] if records else None}")


async def test_the_dashboard_of_a_running_then_finished_run(tmp_path, run_name):
    run_dir = tmp_path / "runs" / run_name
    redis = EmbeddedRedis(run_dir / "redis").start()  # the run's own, as the launcher's embedded one
    (run_dir / "redis.url").write_text(redis.url)
    store = Store.connect(redis.url, run_name)
    envs = start_envs(tmp_path, 1, "--capacity", "8", "--option", "sleep_s=0.2", "--option", "stalled_members=1",
                      "--option", "group_size=2", "--option", "stall_s=300", "--log-level", "WARNING")
    orch = Orchestrator(tmp_path, redis.url, run_name, "--max-in-flight", "6", "--group-size", "2")
    trainer, terminal = None, None
    try:
        await store.redis.hset(store.key("services"), mapping={  # what the launcher records as the run starts
            "orchestrator": orch.url, "total_steps": "3", "mode": "async", "started_at": str(time.time())})
        orch.register(envs[0].url, capacity=8)
        # One member of every group sleeps 300 s: those stay in flight; the others complete.
        orch.wait(lambda s: s["completed"] >= 3, what="3 completed episodes")
        assert orch.http.post("/v1/pause").json()["pause_reasons"] == ["operator"]
        status = orch.wait(lambda s: s["queued"] == 0 and s["settling"] == 0 and s["in_flight"] > 0, what="settled")
        time.sleep(1.0)
        status = orch.status()
        in_flight, completed = status["in_flight"], status["completed"]
        assert in_flight >= 3 and status["pause_reasons"] == ["operator"]

        model = Glm5ForCausalLM.from_config(load_model_section("tiny").arch, seed=0)
        await write_groups(store, policy_groups(model, 6))
        cfg = TrainerConfig(lr=1e-3, groups_per_step=2, checkpoint_every=1, staleness_tau=100,
                            micro_batch_tokens=64, weight_push=WeightPushConfig(every_k_steps=1))
        trainer = Trainer(cfg, load_model_section("tiny"), redis.url, run_name, str(run_dir))
        steps = [await trainer.step() for _ in range(2)]
        rewards = [step["reward_mean"] for step in steps]
        health = (f"{steps[-1]['off_policy/mismatch_kl']:.2g} / {steps[-1]['off_policy/max_abs_log_ratio']:.2f} / "
                  f"{steps[-1]['off_policy/ess_fraction']:.3f}")
        await wait_record(store, lambda r: r.get("pause/operator") == 1 and r["in_flight"] == in_flight)

        # The flicker's cause: every orchestrator record is the whole status, env table included (the first
        # is written at start, before the env registered).
        records = (await orchestrator_records(store))[1:]
        assert records and all("env/timed/in_flight" in r and "in_flight" in r and "paused" in r for r in records)

        terminal = Terminal([*WATCH, "--run-dir", str(run_dir), "--interval", "0.5"], ROOT, ENV)
        cells = ["timed", "1", str(in_flight), "0", str(completed), "0", f"{completed} / 0 / 0"]  # healthy, ..., outcomes
        row = re.compile(r"\s*│\s*".join(map(re.escape, cells)))
        expected = [  # all on one screen (a read may end mid-frame: wait for a whole one)
            lambda s: row.search(s),                                                      # the env table
            lambda s: f"{in_flight} in flight, 0 settling, 0 queued" in s,                # the in-flight count
            lambda s: "rollout paused: new groups held back by operator" in s,            # the pause reason
            lambda s: re.search(r"step 2/3\s+elapsed \d+s\s+ETA \d+s", s),               # progress, elapsed, ETA
            lambda s: f"trainer /metrics {trainer.metrics_url}" in s,                     # the trainer's endpoint
            lambda s: health in s,                                                        # the off-policy health
        ]
        terminal.wait_for(lambda s: all(check(s) for check in expected), 60, "the dashboard")
        assert "Traceback" not in terminal.output

        # The last step: the dashboard becomes the finished run's summary and exits by itself.
        rewards.append((await trainer.step())["reward_mean"])
        assert terminal.wait_exit(60) == 0, terminal.screen.text()
        summary = terminal.screen.text()
        assert re.search(rf"{run_name} finished: 3/3 steps in \d+s", summary), summary
        # 3 steps are under two 10-step windows: windows of 1 step, as the launcher's summary has them
        assert "first / last 1 steps" in summary and f"{rewards[0]:.3f} -> {rewards[-1]:.3f}" in summary
        assert re.search(rf"timed\s*│\s*{completed}\b", summary), summary  # model outcomes of env timed
        assert "final weights" in summary and "v3" in summary
        # What the launcher does as the run ends: the final HF weights, its last status, then summary.json
        await trainer.export_final()
        trainer_records = [v for _, source, v in await store.read_metrics(count=100_000) if source == "trainer"]
        final_status = orch.status()
    finally:
        if terminal is not None:
            terminal.close()
        if trainer is not None:
            await trainer.close()
        orch.stop()
        for env in envs:
            env.stop()
        await store.close()
        redis.stop()

    # After the run its Redis is gone: the summary from the Redis data the run dir keeps.
    after = watch_once("--run-dir", str(run_dir))
    assert after.returncode == 0, after.stderr
    assert re.search(rf"{run_name} finished: 3/3 steps", after.stdout) and "replayed" in after.stdout, after.stdout
    assert re.search(rf"timed\s*│\s*{completed}\b", after.stdout), after.stdout

    # With the launcher's summary.json (written after its Redis stopped), that is what it shows (no replay).
    summarize(run_name, run_dir, 3, 754.0, trainer_records, final_status, "tiny_demo").write(run_dir)
    filed = watch_once("--run-dir", str(run_dir))
    assert filed.returncode == 0, filed.stderr
    assert re.search(rf"{run_name} finished: 3/3 steps in 12m34s", filed.stdout), filed.stdout
    window = json.loads((run_dir / "summary.json").read_text())["reward_window"]  # 1: under 2 windows of steps
    first, last = rewards[0], rewards[-1]
    assert f"first / last {window} steps" in filed.stdout and f"{first:.3f} -> {last:.3f}" in filed.stdout
    assert "replayed" not in filed.stdout and "summary.json" in filed.stdout
    assert re.search(rf"timed\s*│\s*{final_status['by_env']['timed']['completed']}\s*│", filed.stdout), filed.stdout
    assert "evaluate with" in filed.stdout and "asyncrl eval experiment=tiny_demo" in filed.stdout
    assert str(run_dir / "final") in filed.stdout  # the final HF weights the trainer exported

    # A later launch of the same run dir (a resume rewrites redis.url first): that summary is not current.
    time.sleep(0.05)
    (run_dir / "redis.url").write_text("redis://127.0.0.1:1/0")
    stale = watch_once("--run-dir", str(run_dir))
    assert stale.returncode == 0 and "replayed" in stale.stdout, stale.stdout + stale.stderr


def test_a_wrong_run_dir_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "runs" / "real").mkdir(parents=True)
    (tmp_path / "runs" / "real" / "redis.url").write_text("redis://127.0.0.1:1/0")
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "bad").mkdir()
    (tmp_path / "runs" / "bad" / "redis.url").write_text("not a url")
    for run_dir, message in [
        (tmp_path / "runs" / "typo", f"no run directory at {tmp_path / 'runs' / 'typo'} (run directories in "
                                     f"{tmp_path / 'runs'}: bad, real)"),
        (tmp_path / "runs" / "empty", "is not a run directory: it has no redis.url"),
        (tmp_path / "runs" / "real" / "redis.url", "is not a directory"),
        (tmp_path / "runs" / "bad", "redis.url does not hold a Redis URL ('not a url')"),
    ]:
        out = watch_once("--run-dir", str(run_dir))
        assert out.returncode == 2, (run_dir, out.stdout, out.stderr)
        assert out.stderr.startswith("asyncrl watch: ") and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not out.stdout, out.stderr


def test_a_run_dir_whose_redis_is_gone_and_keeps_nothing_says_so(tmp_path):
    run_dir = tmp_path / "gone"
    run_dir.mkdir()
    (run_dir / "redis.url").write_text("redis://127.0.0.1:1/0")
    out = watch_once("--run-dir", str(run_dir))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot reach the run's Redis at redis://127.0.0.1:1/0 (has the run ended?)" in out.stderr


def test_a_redis_without_that_run_names_the_runs_it_has(redis_server, run_name):
    async def register() -> None:
        store = Store.connect(redis_server.url, run_name)
        await store.redis.hset(store.key("services"), mapping={"total_steps": "5", "mode": "async"})
        await store.close()
    asyncio.run(register())
    out = watch_once("--redis-url", redis_server.url, "--run", "nope")
    assert out.returncode == 2 and "no run named 'nope' in the Redis at" in out.stderr and run_name in out.stderr
    frame = watch_once("--redis-url", redis_server.url, "--run", run_name, "--once")
    assert frame.returncode == 0 and f"{run_name} (async mode)  step 0/5" in frame.stdout, frame.stdout + frame.stderr


def test_a_run_dir_with_only_a_summary_shows_it(tmp_path):
    run_dir = tmp_path / "archived"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({
        "name": "archived", "steps": 120, "total_steps": 150, "wall_s": 3725, "reward_first": 0.3,
        "reward_last": 0.55, "outcomes": {"arithmetic": {"model": 900, "environment": 3}},
        "final_weights": "runs/archived/weights/v00000120", "eval_command": None}))
    out = watch_once("--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "archived stopped: 120/150 steps in 1h02m05s" in out.stdout and "0.300 -> 0.550 (+0.250)" in out.stdout
    assert re.search(r"arithmetic\s*│\s*900\s*│\s*3\s*│", out.stdout) and "evaluate with" not in out.stdout


def test_records_of_runs_before_one_record_shape_still_fold_into_one_env_table():
    """Runs before issue 16 wrote two shapes under `orchestrator` (the launcher's, with the env table, and
    the orchestrator's, without): the dashboard keeps the env table across both."""
    from asyncrl_run.watch import RunView

    view = RunView()
    view.fold([("1000-0", "orchestrator", {"in_flight": 9.0, "env/arithmetic/in_flight": 9.0,
                                           "env/arithmetic/healthy_services": 1.0}),
               ("1500-0", "orchestrator", {"in_flight": 7.0, "groups_completed": 3.0})])
    assert view.orchestrator["in_flight"] == 7 and view.orchestrator["env/arithmetic/healthy_services"] == 1


def test_a_run_dir_named_otherwise_than_its_run_finds_the_one_run_in_its_redis(tmp_path):
    """run_dir=/data/exp3 with name=tiny_demo: the dir's name is not the run's (watch once read an empty
    run of that name: every figure 0, in flight too)."""
    redis = EmbeddedRedis(tmp_path / "redis").start()
    try:
        async def register() -> None:
            store = Store.connect(redis.url, "actual-name")
            await store.redis.hset(store.key("services"), mapping={"total_steps": "7", "mode": "sync"})
            await store.close()
        asyncio.run(register())
        run_dir = tmp_path / "exp3"
        run_dir.mkdir()
        (run_dir / "redis.url").write_text(redis.url)
        out = watch_once("--run-dir", str(run_dir), "--once")
        assert out.returncode == 0 and "actual-name (sync mode)  step 0/7" in out.stdout, out.stdout + out.stderr
    finally:
        redis.stop()


def test_a_run_whose_redis_has_nothing_yet_is_waited_for(tmp_path):
    """Started before the run's first write (its embedded Redis up, the services still starting)."""
    redis = EmbeddedRedis(tmp_path / "redis").start()
    try:
        run_dir = tmp_path / "starting"
        run_dir.mkdir()
        (run_dir / "redis.url").write_text(redis.url)
        out = watch_once("--run-dir", str(run_dir), "--once")
        assert out.returncode == 0 and "waiting for the run to start" in out.stdout, out.stdout + out.stderr
    finally:
        redis.stop()


async def test_the_dashboard_of_a_run_whose_redis_goes_away_ends_in_its_summary(tmp_path, run_name):
    """A run that stops (or crashes) takes its embedded Redis with it: the live dashboard then shows the
    summary from what the run dir keeps (its Redis data, replayed), not a traceback."""
    run_dir = tmp_path / run_name
    redis = EmbeddedRedis(run_dir / "redis").start()
    (run_dir / "redis.url").write_text(redis.url)
    store = Store.connect(redis.url, run_name)
    await store.redis.hset(store.key("services"), mapping={"total_steps": "5", "mode": "sync",
                                                           "started_at": str(time.time())})
    await write_groups(store, policy_groups(Glm5ForCausalLM.from_config(load_model_section("tiny").arch, seed=0), 2))
    trainer = Trainer(TrainerConfig(groups_per_step=2, staleness_tau=100, micro_batch_tokens=64),
                      load_model_section("tiny"), redis.url, run_name, str(run_dir))
    terminal = None
    try:
        reward = (await trainer.step())["reward_mean"]
        terminal = Terminal([*WATCH, "--run-dir", str(run_dir), "--interval", "0.5"], ROOT, ENV)
        terminal.wait_for(lambda s: re.search(r"step 1/5\s+elapsed", s), 60, "the dashboard at step 1")
        await trainer.close()
        await store.close()
        redis.stop()
        assert terminal.wait_exit(90) == 0, terminal.screen.text()
        screen = terminal.screen.text()
        assert re.search(rf"{run_name} stopped: 1/5 steps in \d+s", screen), screen
        assert f"{reward:.3f} -> {reward:.3f}" in screen and "(replayed)" in screen.replace("\n", " ")
        assert "Traceback" not in terminal.output
    finally:
        if terminal is not None:
            terminal.close()
        redis.stop()


def test_idle_time_counts_from_this_launchs_training_start():
    """A warm-up longer than the stall line waits, and a resumed run's steps of an earlier launch, are not idle
    time: the launcher's stall line (and stall_limit_s) and the view count from `training_started_at`."""
    from asyncrl_run.stall import STALL_AFTER_S, idle_s
    from asyncrl_run.watch import RunView

    assert idle_s(1650.0, 1600.0, []) == (50.0, STALL_AFTER_S)  # a 10-minute warm-up since the launch at 1000
    assert idle_s(5050.0, 5000.0, [1010.0, 1012.0]) == (50.0, STALL_AFTER_S)  # resumed: steps 1, 2 were at 1010, 1012
    assert idle_s(5100.0, 5000.0, [1010.0, 5060.0, 5080.0]) == (20.0, 5 * 60.0)  # 5 median steps of this launch
    view = RunView(total_steps=10, services={"started_at": "1000", "training_started_at": "1600"})
    view.fold([("1620000-0", "orchestrator", {"in_flight": 8.0, "queued": 0.0, "env/a/in_flight": 8.0})])
    view.now = 1650.0
    assert view.stall() is None
    view.now = 1600.0 + STALL_AFTER_S + 1
    assert view.stall()["idle_s"] == STALL_AFTER_S + 1


def test_watch_and_the_dashboard_name_what_stalls_a_run():
    """No step for longer than the launcher's stall line waits: the view names the component (asyncrl_run/stall.py),
    from the orchestrator's last record, or the orchestrator itself once that record is stale."""
    from rich.console import Console

    from asyncrl_run.watch import RunView, render

    view = RunView(total_steps=10, services={"started_at": "1000"})
    view.fold([("1010000-0", "trainer", {"step": 1.0}), ("1012000-0", "trainer", {"step": 2.0}),
               ("1200000-0", "orchestrator", {"in_flight": 45.0, "queued": 0.0, "pause/unconsumed_groups": 1.0,
                                              "env/hang/in_flight": 45.0, "env/hang/healthy_services": 1.0})])
    view.now = 1050.0
    assert view.stall() is None  # 38 s without a step: not yet
    view.now = 1230.0
    assert view.stall() == {"idle_s": 218.0, "component": "env hang",
                            "why": "45 episodes in flight at hang, the orchestrator holds new groups (unconsumed_groups), "
                                   "none completing a group: its services or the engines do not finish them"}
    console = Console(width=250, file=io.StringIO(), record=True)
    console.print(render(view, "r"))
    assert "STALLED: no step for 3m38s: env hang" in console.export_text()
    view.now = 1300.0  # the orchestrator's record is 100 s old: it stopped writing
    assert view.stall()["component"] == "orchestrator" and "does not answer for 1m40s" in view.stall()["why"]
