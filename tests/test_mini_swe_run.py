"""A tiny_demo-sized run with mini-swe-agent (envs/mini_swe) in the mix next to arithmetic finishes its steps:
the tiny model solves no SWE task, but its mini-swe-agent episodes end as model outcomes (out of turns) and
their groups are trained, none fails. Sync mode, so each step's batch waits for the groups started for it,
the slow mini-swe-agent ones included (async mode would fill every step with arithmetic first)."""

import json

import pytest

from tests.envs.isolation import NAMESPACES
from tests.test_e2e_run import launch, records_after_run, trained_envs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_with_mini_swe_agent_in_the_mix_finishes_its_steps(tmp_path):
    run_dir = tmp_path / "mini_swe_run"
    sandbox = "namespace" if NAMESPACES else "local_unsafe"
    proc = launch(run_dir, "mini_swe_run", "mode=sync", "total_steps=2", "warmup.steps=0", "trainer.groups_per_step=4",
                  "orchestrator.group_size=4",
                  f"+envs.services.mini_swe={{target: envs.mini_swe.MiniSweAgentEnv, capacity: 8, max_turns: 2, "
                  f"sandbox: {sandbox}}}")
    assert proc.wait(360) == 0, (tmp_path / "mini_swe_run.log").read_text()[-4000:]
    assert [int(r["step"]) for r in records_after_run(run_dir, tmp_path)] == [1, 2]
    outcomes = json.loads((run_dir / "summary.json").read_text())["outcomes"]
    assert set(outcomes["mini_swe"]) == {"model"} and outcomes["mini_swe"]["model"] >= 4, outcomes  # none failed
    assert outcomes["arithmetic"].get("model", 0) > 0, outcomes
    assert trained_envs(run_dir, tmp_path).count("mini_swe") >= 1  # a mini-swe-agent group reached the trainer
