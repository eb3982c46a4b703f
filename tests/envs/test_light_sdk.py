"""The light env SDK (distributions/env-sdk; docs/envs.md "Running an env in its own venv: the light SDK"),
installed alone in .venv-sdk (or $SDK_VENV) by `make sdk-venv`: torch and Ray do not import there, the venv
holds exactly the project modules that envs.serve and envs.sdk import (this checkout's own), and docs/envs.md's
example env, served from that venv, self-registers with a real orchestrator (of the full install) and plays
its groups.

The venv is (re)built by make when it is missing or older than the SDK's sources (~20 s from a warm pip
cache, ~30 s from the registry), in CI as anywhere: never skipped. $SDK_VENV and $SDK_CONSTRAINTS, which
make reads too, check another set of dependency versions (distributions/env-sdk/lowest.txt)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from asyncrl.config import EnvServiceConfig
from asyncrl.supervisor import ServiceActor
from asyncrl_run.launcher import env_interpreter, env_service_args

from tests.envs.isolation import NAMESPACES, SANDBOX_ARGS
from tests.envs.scripted_llm import say
from tests.envs.service_process import ServiceProcess, run_episode
from tests.orchestrator.conftest import Orchestrator, group_records
from tests.orchestrator.test_custom_env import reverse_the_word
from tests.test_custom_env import EXAMPLE
from tests.test_structure import PACKAGES, import_graph, module_files

ROOT = Path(__file__).resolve().parents[2]
SDK_VENV = ROOT / os.environ.get("SDK_VENV", ".venv-sdk")
DISTRIBUTION = "asyncrl-env-sdk"
HEAVY = ("torch", "ray", "numpy")

pytestmark = pytest.mark.timeout(600)  # the first test may build the venv

SHELL_ENV = '''
from envs.sdk import Environment, EpisodeResult


class ShellEnv(Environment):
    """Runs the model's reply as a command in the episode's sandbox; an output of 42 is right."""
    name, domain = "shell", "toy"
    requires_sandbox = True

    async def list_tasks(self):
        return ["t-1"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        reply = await llm.chat.completions.create(messages=[{"role": "user", "content": "Print 42."}],
                                                  **ctx.completion_args())
        ran = await sandbox.run(reply.choices[0].message.content)
        return EpisodeResult(reward=float(ran.output.strip() == "42"), info={"output": ran.output})
'''
"""An env whose episodes run a command in the sandbox (the namespace one where this machine has it)."""


@pytest.fixture(scope="module")
def sdk_python() -> Path:
    """SDK_VENV's interpreter, after `make sdk-venv` (a no-op when the venv is up to date)."""
    built = subprocess.run(["make", "sdk-venv"], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert built.returncode == 0, f"make sdk-venv failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    return SDK_VENV / "bin" / "python"


def run_in(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c code` in `cwd`, without this checkout on its path: it sees only what its venv installed."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=120)


def sdk_modules() -> dict[str, Path]:
    """Project module -> its file, for envs.serve, every envs.sdk module, all they import (transitively,
    read from the source as tests/test_structure.py does) and the packages above them."""
    graph = import_graph(ROOT)
    needed, todo = set(), ["envs.serve", *(module for module in graph if module.startswith("envs.sdk"))]
    while todo:
        module = todo.pop()
        if module not in needed:
            needed.add(module)
            todo.extend(graph[module])
    packages = {".".join(module.split(".")[:end]) for module in needed for end in range(1, module.count(".") + 1)}
    files = module_files(ROOT, PACKAGES)
    return {module: files[module] for module in needed | packages}


def test_torch_ray_and_numpy_do_not_import_in_the_sdk_venv(sdk_python, tmp_path):
    for module in HEAVY:
        ran = run_in(sdk_python, f"import {module}", tmp_path)
        assert ran.returncode != 0 and f"No module named '{module}'" in ran.stderr, (module, ran.stderr)
    served = run_in(sdk_python, "import envs.serve, envs.sdk.server; print(envs.serve.__file__)", tmp_path)
    assert served.returncode == 0, served.stderr
    assert Path(served.stdout.strip()).is_relative_to(SDK_VENV)


def test_the_venv_holds_exactly_the_modules_the_sdk_imports_from_this_checkout(sdk_python, tmp_path):
    listed = run_in(sdk_python, f"import importlib.metadata as m, json; d = m.distribution({DISTRIBUTION!r}); "
                                "print(json.dumps([[str(f), str(f.locate())] for f in d.files]))"
                                "; print(json.dumps(d.requires))", tmp_path)
    assert listed.returncode == 0, listed.stderr
    files_line, requires_line = listed.stdout.splitlines()
    shipped = {Path(name).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): Path(where)
               for name, where in json.loads(files_line) if name.endswith(".py")}
    expected = sdk_modules()
    assert sorted(shipped) == sorted(expected), "distributions/env-sdk/pyproject.toml's force-include list " \
                                                "is not the modules envs.serve and envs.sdk import"
    stale = [module for module, path in expected.items() if shipped[module].read_bytes() != path.read_bytes()]
    assert not stale, f"{SDK_VENV} holds other versions of {stale} than this checkout (make sdk-venv)"
    requires = {Requirement(requirement).name for requirement in json.loads(requires_line)}
    assert not requires & set(HEAVY) and {"openai", "fastapi", "uvicorn"} <= requires, requires


async def test_an_env_served_from_the_sdk_venv_plays_a_real_orchestrators_groups(
        sdk_python, tmp_path, redis_server, run_name, scripted_llm):
    (tmp_path / "reverse_word.py").write_text(EXAMPLE)  # docs/envs.md's example env, outside any checkout
    url, script = scripted_llm.script(*[reverse_the_word] * 20)
    orchestrator = Orchestrator(tmp_path, redis_server.url, run_name, "--llm-url", url, "--group-size", "2",
                                "--max-groups", "3")
    service = ServiceProcess(f"{tmp_path}/reverse_word.py:ReverseWordEnv", tmp_path, "--orchestrator",
                             orchestrator.url, "--option", "bonus=0.5", python=sdk_python)
    try:
        service.start()
        status = orchestrator.wait_done(3)
        metrics = orchestrator.http.get("/metrics").text
    finally:
        exit_code = service.stop()
        assert orchestrator.stop() == 0, orchestrator.proc.log()
    assert exit_code == 0, service.log()
    assert status["by_env"]["reverse-word"]["completed"] == 6 and status["failed"] == 0, status
    assert 'asyncrl_orchestrator_reward_sum{env="reverse-word"} 3.0' in metrics  # 6 right answers x bonus 0.5
    records = await group_records(redis_server.url, run_name)
    assert sorted(r.group_id for r in records) == [f"g{i:07d}-reverse-word" for i in (1, 2, 3)]
    assert len(script.requests) == 6


async def test_the_sandbox_runs_an_episodes_command_from_the_sdk_venv(sdk_python, tmp_path, scripted_llm):
    (tmp_path / "shell_env.py").write_text(SHELL_ENV)
    service = ServiceProcess(f"{tmp_path}/shell_env.py:ShellEnv", tmp_path, *SANDBOX_ARGS, python=sdk_python)
    try:
        service.start()
        url, _ = scripted_llm.script(say("echo $((6 * 7))"))
        async with httpx.AsyncClient() as client:
            result = await run_episode(client, service.url, "t-1", url)
        metrics = service.get("/metrics").text
    finally:
        exit_code = service.stop()
    assert exit_code == 0, service.log()
    assert (result["status"], result["reward"], result["info"]) == ("completed", 1.0, {"output": "42\n"}), result
    sandbox = "namespace" if NAMESPACES else "local_unsafe"
    assert f'asyncrl_env_sandbox_info{{env="shell",type="{sandbox}"}} 1.0' in metrics


PREFIX_ENV = '''
import sys

from envs.sdk import Environment, EpisodeResult


class PrefixEnv(Environment):
    """Its one task id is the prefix of the interpreter that serves it."""
    name, domain = "prefix", "toy"

    async def list_tasks(self):
        return [sys.prefix]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        return EpisodeResult(reward=0.0)
'''


def test_the_launchers_supervisor_runs_an_env_with_the_interpreter_its_section_names(sdk_python, tmp_path):
    """envs.services.<env>.python: the launcher's ServiceActor (here without Ray) starts the env's service with
    that venv's interpreter, from the section file the launcher writes."""
    (tmp_path / "prefix_env.py").write_text(PREFIX_ENV)
    env = EnvServiceConfig(name="prefix", target=f"{tmp_path}/prefix_env.py:PrefixEnv", python=str(sdk_python))
    actor = ServiceActor("env-prefix-0", "envs.serve", env_service_args(tmp_path, env, None),
                         str(tmp_path / "services"), python=env_interpreter(env))
    try:
        tasks = httpx.get(f"{actor.url()}/tasks", timeout=30).json()
    finally:
        assert actor.shutdown() == 0, actor.log_path.read_text()[-3000:]
    assert tasks["task_ids"] == [str(SDK_VENV)]  # sys.prefix of the venv, not of the run's interpreter
