"""A tiny_demo-sized run with a verifiers environment in the mix: the launcher starts envs.verifiers_adapter
with .venv-verifiers' interpreter (the env section's `python`), the toy Hub-style env's episodes go through
the run's gateway next to arithmetic's, end as model outcomes and are trained. Sync mode, so each step waits
for the groups started for it, the verifiers ones included."""

import json

import pytest

from tests.envs.test_verifiers_adapter import verifiers_python  # noqa: F401 (fixture: builds the venv)
from tests.test_e2e_run import launch, records_after_run, trained_envs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_with_a_verifiers_env_in_the_mix_finishes_its_steps(tmp_path, verifiers_python):  # noqa: F811
    run_dir = tmp_path / "verifiers_run"
    proc = launch(run_dir, "verifiers_run", "mode=sync", "total_steps=2", "warmup.steps=0", "trainer.groups_per_step=4",
                  "orchestrator.group_size=4",
                  f"+envs.services.hub={{target: 'envs/verifiers_adapter.py:VerifiersEnv', python: '{verifiers_python}', "
                  "capacity: 8, options: {env_id: asyncrl-vf-toy, env_args: {agent: {runtime: {type: subprocess}}}}}")
    assert proc.wait(420) == 0, (tmp_path / "verifiers_run.log").read_text()[-4000:]
    assert [int(r["step"]) for r in records_after_run(run_dir, tmp_path)] == [1, 2]
    outcomes = json.loads((run_dir / "summary.json").read_text())["outcomes"]
    assert set(outcomes["hub"]) == {"model"} and outcomes["hub"]["model"] >= 4, outcomes  # none failed
    assert trained_envs(run_dir, tmp_path).count("hub") >= 1  # a verifiers group reached the trainer
