"""`asyncrl eval` end to end (the real command, as a subprocess): the demo's engines, gateway and env
service started by the launcher's pieces, the held-out split played at the experiment's sampling, and a
JSON result. Weights that had a supervised warm-up score above a random init on held-out arithmetic,
and nothing the evaluation records lands outside its own namespace."""

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from asyncrl.config import WarmupConfig, load_model_section
from asyncrl_run.redis_server import EmbeddedRedis
from tests.conftest import save_tiny_checkpoint
from tests.services import ROOT

TASKS, SAMPLES, KS = 12, 8, [1, 4, 8]
"""12 of the 14 held-out arithmetic tasks (n_tasks is the number asked, not the split's)."""


def evaluate(model, out, run_dir) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "eval", "experiment=tiny_demo", f"run_dir={run_dir}",
                           "--model", str(model), "--env", "arithmetic", "--tasks", str(TASKS), "--samples",
                           str(SAMPLES), "--k", ",".join(map(str, KS)), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"result: {out}" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


async def _keys(url: str) -> list[str]:
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        return sorted(k.decode() for k in await client.keys("*"))
    finally:
        await client.aclose()


def recorded_keys(eval_dir, tmp_path) -> list[str]:
    copy = tmp_path / "eval-redis-copy"
    shutil.copytree(f"{eval_dir}/redis", copy)
    with EmbeddedRedis(copy) as server:
        return asyncio.run(_keys(server.url))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_scores_warmed_up_weights_above_random_init(tmp_path, tiny_arch):
    from trainer.sft import warmup

    base = save_tiny_checkpoint(tmp_path / "base", tiny_arch, seed=0)
    trained = warmup(load_model_section("tiny"), WarmupConfig(steps=40, batch_size=32, lr=3e-3), str(tmp_path / "sft"))
    run_dir = tmp_path / "run"
    base_result, _ = evaluate(base, tmp_path / "base.json", run_dir)
    trained_result, stdout = evaluate(trained, tmp_path / "trained.json", run_dir)
    # A random init never answers with the right integer; 40 steps on the 86 train problems get some of the
    # 14 held-out ones right (0.1-0.2 measured: the tiny model mostly memorises, the format is what it learns)
    figures = (base_result["mean_reward"], trained_result["mean_reward"])
    assert trained_result["mean_reward"] > base_result["mean_reward"] and trained_result["mean_reward"] >= 0.05, figures
    assert f"mean reward {trained_result['mean_reward']:.3f}" in stdout
    for result in (base_result, trained_result):
        assert (result["split"], result["n_tasks"], result["samples_per_task"], result["k"]) == ("eval", TASKS,
                                                                                                SAMPLES, KS)
        assert result["n_tasks_available"] == 14 and result["failed_episodes"] == 0
        assert result["episodes"] == TASKS * SAMPLES and result["sampling"]["temperature"] == 1.0
        assert result["agent"]["turns_mean"] == 1.0 and result["agent"]["tool_calls_mean"] == 0.0  # one reply, no tools
        tasks = result["tasks"]
        assert [t["task_id"] for t in tasks] == [f"arith-eval-{i:05d}" for i in range(TASKS)]  # held-out ids only
        assert all(t["n"] == SAMPLES and len(t["rewards"]) == SAMPLES for t in tasks)
        passes = [result["pass_at_k"][str(k)] for k in KS]
        assert passes == sorted(passes) and 0.0 <= passes[0] and passes[-1] <= 1.0
        # binary rewards, n samples of every task: pass@1 is the mean reward, pass@n the share of tasks solved once
        assert passes[0] == pytest.approx(result["mean_reward"])
        assert passes[-1] == pytest.approx(sum(t["passed"] > 0 for t in tasks) / TASKS)
    # its own namespace and Redis: the gateway recorded every episode there, its orchestrator every group
    keys = recorded_keys(trained_result["eval_dir"], tmp_path)
    prefix = f"asyncrl:{trained_result['eval_name']}:"
    assert trained_result["eval_name"].startswith("tiny_demo-eval-") and all(k.startswith(prefix) for k in keys), keys
    assert f"{prefix}samples" in keys and f"{prefix}groups" in keys
