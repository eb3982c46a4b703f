"""Each built-in agentic env's experiment config (docs/envs.md "Experiments") starts with one command and
finishes its steps with the tiny model: its episodes end as model outcomes (none failed) and its groups are
trained. The verifiers one runs where .venv-verifiers is built (the fixture builds it, as make test does)."""

import json

import pytest

from tests.envs.isolation import NAMESPACES
from tests.envs.test_verifiers_adapter import verifiers_python  # noqa: F401 (fixture: builds the venv)
from tests.test_e2e_run import launch, records_after_run, trained_envs

SANDBOXED = {"terminal", "swe", "mini_swe"}


def check_finished(run_dir, tmp_path, name: str, env: str, steps: int) -> None:
    assert [int(r["step"]) for r in records_after_run(run_dir, tmp_path)] == list(range(1, steps + 1))
    outcomes = json.loads((run_dir / "summary.json").read_text())["outcomes"]
    assert set(outcomes) == {env} and set(outcomes[env]) == {"model"}, outcomes  # none failed
    assert trained_envs(run_dir, tmp_path).count(env) >= 2  # every step trained that env's groups


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("experiment", ["terminal", "swe", "search", "mini_swe"])
def test_the_experiment_of_an_agentic_env_finishes_its_steps(experiment, tmp_path):
    run_dir = tmp_path / experiment
    sandbox = [] if experiment not in SANDBOXED or NAMESPACES else [f"envs.services.{experiment}.sandbox=local_unsafe"]
    proc = launch(run_dir, experiment, "total_steps=2", *sandbox, experiment=experiment)
    assert proc.wait(360) == 0, (tmp_path / f"{experiment}.log").read_text()[-4000:]
    check_finished(run_dir, tmp_path, experiment, experiment, steps=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_verifiers_experiment_finishes_its_steps(tmp_path, verifiers_python):  # noqa: F811
    run_dir = tmp_path / "verifiers"
    proc = launch(run_dir, "verifiers", "total_steps=2", f"envs.services.hub.python={verifiers_python}",
                  experiment="verifiers")
    assert proc.wait(420) == 0, (tmp_path / "verifiers.log").read_text()[-4000:]
    check_finished(run_dir, tmp_path, "verifiers", "hub", steps=2)
