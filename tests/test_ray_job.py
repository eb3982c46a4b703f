"""`ray job submit ... -- python -m asyncrl.train experiment=...` against a real local Ray head."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.services import ROOT, free_port

BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
# As in a shell with the venv activated: the job's `python` is the venv's. Ray 2.60 turns token auth on
# for a head when ~/.ray/auth_token exists (any local ray.init writes one), but its job CLI sends the
# token only when told to: say so explicitly, on both sides (README, "Runs under Ray").
ENV = {**os.environ, "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]), "RAY_AUTH_MODE": "token"}


@pytest.fixture
def ray_head(tmp_path):
    gcs, dashboard = free_port(), free_port()
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={gcs}", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dashboard}", "--num-cpus=2", "--include-dashboard=true",
                             "--disable-usage-stats"], stdout=open(tmp_path / "head.log", "wb"),
                            stderr=subprocess.STDOUT, cwd=tmp_path, env=ENV)
    url = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/version", timeout=2).status_code < 500:  # 401 with token auth: up
                break
        except httpx.HTTPError:
            time.sleep(0.5)
        assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
    else:
        pytest.fail("the Ray dashboard did not come up")
    yield url
    head.terminate()  # --block: SIGTERM stops the processes this head started
    head.wait(60)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_runs_the_tiny_demo(ray_head, tmp_path):
    run_dir = tmp_path / "run"
    for _ in range(30):  # the head answers before its job agent does ("No available agent")
        job = subprocess.run(
            [RAY, "job", "submit", "--address", ray_head, "--working-dir", ".", "--",
             "python", "-m", "asyncrl.train", "experiment=tiny_demo", "name=job_smoke", "total_steps=3",
             "warmup.steps=5", f"run_dir={run_dir}"],
            cwd=ROOT, capture_output=True, text=True, timeout=540, env=ENV)
        output = job.stdout + job.stderr
        if "No available agent" not in output:
            break
        time.sleep(2)
    assert job.returncode == 0, output[-5000:]
    assert "run job_smoke finished 3 steps" in output
    assert "succeeded" in output.lower()
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "tensorboard").iterdir())
