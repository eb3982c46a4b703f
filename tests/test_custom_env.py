"""A new environment written only against the SDK, outside envs/: docs/envs.md's own example, taken
from the doc's code block, served by `python -m envs.serve` (by module, and as a file), registered
with an orchestrator and played end to end. Also: every Python block of docs/envs.md runs, and the
import the doc shows is the SDK's export list."""

import ast
import asyncio
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import envs.sdk

DOC = Path(__file__).resolve().parents[1] / "docs" / "envs.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
EXAMPLE = next(block for block in BLOCKS if "class ReverseWordEnv" in block)

exec(compile(EXAMPLE, f"{DOC}:ReverseWordEnv", "exec"), globals())  # defines ReverseWordEnv, WORDS here


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_python_block_of_the_doc_runs_on_its_own(index, tmp_path):
    """In a fresh interpreter, so a block cannot lean on names another one imported."""
    script = tmp_path / "block.py"
    script.write_text(BLOCKS[index])
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(DOC.parents[1]), "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0, f"block {index}:\n{BLOCKS[index]}\n{ran.stderr[-3000:]}"


def test_the_doc_imports_exactly_what_the_sdk_exports():
    (imports,) = [node for block in BLOCKS for node in ast.walk(ast.parse(block))
                  if isinstance(node, ast.ImportFrom) and node.module == "envs.sdk" and len(node.names) > 10]
    documented = sorted(alias.name for alias in imports.names)
    assert documented == sorted(envs.sdk.__all__)
    for name in ("EpisodeStatus", "EpisodeReason", "Environment", "EpisodeContext", "EpisodeResult", "Sandbox",
                 "SandboxError", "Tool", "ToolResult", "param", "schema"):
        assert name in documented and getattr(envs.sdk, name) is not None


@pytest.fixture
def harness(tmp_path):
    from tests.envs.recording_orchestrator import RecordingOrchestrator
    from tests.envs.scripted_llm import ScriptedLLM
    from tests.envs.service_process import ServiceProcess

    (tmp_path / "reverse_word.py").write_text(EXAMPLE)
    llm, orchestrator = ScriptedLLM().start(), RecordingOrchestrator().start()
    services = [ServiceProcess(target, tmp_path, "--orchestrator", orchestrator.url, "--option", "bonus=0.5").spawn()
                for target in ("tests.test_custom_env.ReverseWordEnv", f"{tmp_path}/reverse_word.py:ReverseWordEnv")]
    yield llm, orchestrator, [service.wait_ready() for service in services]
    assert [service.stop() for service in services] == [0, 0]
    orchestrator.stop()
    llm.stop()


async def test_custom_env_registers_and_plays_episodes(harness):
    from tests.envs.scripted_llm import call
    from tests.envs.service_process import run_episode

    llm, orchestrator, services = harness
    registrations = await asyncio.to_thread(orchestrator.wait_for, lambda: len(orchestrator.registrations()) == 2
                                            and orchestrator.registrations())
    assert sorted(r.body["url"] for r in registrations) == sorted(s.url for s in services)
    assert {(r.body["name"], r.body["domain"]) for r in registrations} == {("reverse-word", "toy")}
    for service in services:  # the module and the file serve the same class
        assert service.get("/tasks").json() == {"task_ids": ["w-1", "w-2", "w-3"], "total": 3, "split": "train"}
        async with httpx.AsyncClient() as client:
            right_url, right = llm.script(call("letter", position="1"), call("letter", position=1),
                                          call("submit", text="xyno"))
            wrong_url, _ = llm.script(call("submit", text="onyx"))
            good = await run_episode(client, service.url, "w-3", right_url)
            bad = await run_episode(client, service.url, "w-3", wrong_url)
        assert (good["reward"], good["status"], good["reason"], good["outcome"], good["num_turns"]) == (
            0.5, "completed", "completed", "model", 3)
        assert (bad["reward"], bad["info"]["answers"]) == (0.0, ["onyx"])
        observations = [r["messages"][-1]["content"] for r in right.requests[1:]]
        assert observations == ['error: letter: position: expected an integer, got "1" (a string)', "o"]
