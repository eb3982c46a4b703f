"""Guards DESIGN.md's dependency rule: components import asyncrl and never each other, and asyncrl
never imports a component statically (the launcher and CLI wire them by dotted path)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("rollout", "gateway", "orchestrator", "envs", "trainer")


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ("asyncrl",) + COMPONENTS)
def test_dependency_rule(package):
    forbidden = set(COMPONENTS) - {package}
    offenders = {}
    for path in (ROOT / package).rglob("*.py"):
        bad = imported_top_levels(path) & forbidden
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"{package} imports other components: {offenders}"


def test_cli_entry_is_instant_and_lists_commands():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "nope"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr
    assert "engine serve" in out.stdout


def test_train_prints_resolved_config_and_rejects_bad_keys():
    import subprocess
    import sys

    job = subprocess.run([sys.executable, "-m", "asyncrl.train", "experiment=tiny_demo", "--cfg", "job"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "name: tiny_demo" in job.stdout and "trainer:" in job.stdout and "${" not in job.stdout
    bad = subprocess.run([sys.executable, "-m", "asyncrl.train", "rollout.max_runing_requests=3", "--cfg", "job"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "max_runing_requests" in bad.stderr
