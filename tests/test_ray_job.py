"""The README's Ray block, copied from the README and run as written (bash, the venv's tools on PATH;
the submit again after "No available agent", as the README says),
on a machine without ~/.ray/auth_token and on one that has it (the first run left one, as a local
`ray.init` does): the head starts, `ray job submit` runs the tiny demo and it finishes."""

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.services import ROOT, stop_tagged

BIN = Path(sys.executable).parent
JOB_OVERRIDES = "name=readme_ray total_steps=2 warmup.steps=5"
"""Appended to the block's `asyncrl_run.train` command: the same job, short."""


def readme_ray_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("Under a Ray cluster"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert "ray job submit" in block and "ray start --head" in block
    return block.replace("experiment=tiny_demo\n", f"experiment=tiny_demo {JOB_OVERRIDES}\n")


def run_block(home: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    tag = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "HOME": str(home),
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), "ASYNCRL_TEST_TAG": tag}
    block = readme_ray_block()
    setup, submit = block[:block.index("ray job submit")], block[block.index("ray job submit"):]
    try:
        job = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        for _ in range(20):  # what the README says to do about a head whose job agent is not up yet
            if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr:
                break
            time.sleep(3)
            job = subprocess.run(["bash", "-euo", "pipefail", "-c", setup.split("ray start")[0] + submit],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        return job
    finally:
        stop_tagged(tag)


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_the_readme_ray_block_runs_as_written_with_and_without_a_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for case in ("no token yet", "token present"):
        assert (home / ".ray" / "auth_token").exists() == (case == "token present")
        job = run_block(home, tmp_path)
        output = job.stdout + job.stderr
        assert job.returncode == 0, f"{case}: {output[-5000:]}"
        assert "run readme_ray: 2/2 steps" in output and "succeeded" in output.lower(), output[-3000:]
        run_dir = home / "asyncrl" / "runs" / "readme_ray"  # a Ray job's relative run_dir: $ASYNCRL_HOME
        assert (run_dir / "summary.json").exists() and any((run_dir / "tensorboard").iterdir())
        time.sleep(1)
