"""Where `python -m envs.serve --env ...` finds a user's env class: a module importable from the current
directory, $PYTHONPATH or --env-path, or a file path (an absolute one: tests/test_custom_env.py); and
what it says when it cannot."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.services import ROOT

ENV_SOURCE = '''
from envs.sdk import Environment, EpisodeResult
from {helper} import TASKS


class {cls}(Environment):
    domain = "mine"

    async def list_tasks(self):
        return TASKS

    async def run_episode(self, task_id, llm, sandbox, ctx):
        return EpisodeResult(1.0)
'''


def project(root: Path) -> Path:
    """A user's project outside the repository: a package with an env, a loose file with another (each
    importing a module next to it), and a class that is not an Environment."""
    (root / "my_pkg").mkdir(parents=True)
    (root / "my_pkg" / "__init__.py").write_text("")
    (root / "my_pkg" / "tasks.py").write_text('TASKS = ["p-1", "p-2"]\n')
    (root / "my_pkg" / "envs.py").write_text(ENV_SOURCE.format(helper="my_pkg.tasks", cls="PackagedEnv")
                                             + "\nclass NotAnEnv:\n    pass\n")
    (root / "scripts").mkdir()
    (root / "scripts" / "file_tasks.py").write_text('TASKS = ["f-1"]\n')
    (root / "scripts" / "loose_env.py").write_text(ENV_SOURCE.format(helper="file_tasks", cls="LooseEnv"))
    return root


class Serve:
    def __init__(self, cwd: Path, *args: str):
        self.url_file = cwd / f"serve-{time.monotonic_ns()}.url"
        self.proc = subprocess.Popen([sys.executable, "-m", "envs.serve", *args, "--port", "0",
                                      "--url-file", str(self.url_file)], cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def tasks(self, timeout_s: float = 90) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.url_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.communicate()[0]
            time.sleep(0.05)
        try:
            return httpx.get(f"{self.url_file.read_text()}/info", timeout=30).json()
        finally:
            self.proc.terminate()
            assert self.proc.wait(30) == 0

    def failure(self) -> tuple[int, str]:
        output, _ = self.proc.communicate(timeout=90)
        return self.proc.returncode, output


def test_env_classes_load_from_the_directory_the_path_or_a_file(tmp_path):
    root = project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    served = {
        "from its directory": Serve(root, "--env", "my_pkg.envs.PackagedEnv"),
        "with --env-path": Serve(elsewhere, "--env", "my_pkg.envs:PackagedEnv", "--env-path", str(root)),
        "as a relative file": Serve(root, "--env", "scripts/loose_env.py:LooseEnv"),
    }
    refused = {
        "not on the path": Serve(elsewhere, "--env", "my_pkg.envs.PackagedEnv"),
        "not an env": Serve(root, "--env", "my_pkg.envs.NotAnEnv"),
        "no such file": Serve(root, "--env", "scripts/nope.py:LooseEnv"),
    }
    info = {what: serve.tasks() for what, serve in served.items()}
    assert {what: (i["name"], i["domain"], i["num_tasks"]) for what, i in info.items()} == {
        "from its directory": ("PackagedEnv", "mine", 2), "with --env-path": ("PackagedEnv", "mine", 2),
        "as a relative file": ("LooseEnv", "mine", 1)}
    failures = {what: serve.failure() for what, serve in refused.items()}
    assert {what: code for what, (code, _) in failures.items()} == dict.fromkeys(refused, 1)
    code, output = failures["not on the path"]
    assert "--env 'my_pkg.envs.PackagedEnv': no module named 'my_pkg' on the import path" in output
    assert f"current directory ({elsewhere})" in output and "--env-path DIR" in output
    assert "--env path/to/file.py:PackagedEnv" in output and "Traceback" not in output
    assert "NotAnEnv is not a subclass of envs.sdk.Environment" in failures["not an env"][1]
    assert f"no file {root}/scripts/nope.py" in failures["no such file"][1]
