"""SWE env: generated repositories are sound (bug fails visible and held-out tests, the fix passes
both), and end to end a scripted fix earns 1 while no fix or a rewritten test earns 0."""

import json

import httpx
import pytest

from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend
from envs.swe.env import DATA, SweEnv
from envs.swe.generate import generate
from envs.swe.mutations import count_sites, mutate
from tests.envs.isolation import NAMESPACES, SANDBOX_ARGS
from tests.envs.scripted_llm import call, say
from tests.envs.service_process import run_episode

TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.swe.SweEnv", *SANDBOX_ARGS))
    return service


def test_shipped_tasks_are_the_generators_output():
    assert generate(seed=0, count=12) == TASKS[:12]
    assert len(TASKS) == 300 and len({t["task_id"] for t in TASKS}) == 300
    assert len({(t["bug"]["function"], t["bug"]["change"]) for t in TASKS}) > 100  # varied bugs...
    assert len({json.dumps(t["repo"], sort_keys=True) for t in TASKS}) == 300  # ...in 300 distinct repositories
    assert {t["theme"] for t in TASKS} == {"text", "numbers", "lists", "grading"}


def test_mutations_change_exactly_one_spot():
    source = "def f(a, b):\n    return a + 1 < b\n"
    mutants = [mutate(source, i) for i in range(count_sites(source))]
    assert sorted(m[0].splitlines()[1].strip() for m in mutants) == ["return a + 1 <= b", "return a + 2 < b",
                                                                      "return a - 1 < b"]
    assert sorted(m[1] for m in mutants) == ["line 2: + -> -", "line 2: 1 -> 2", "line 2: < -> <="]


async def test_sample_of_tasks_is_sound_in_the_sandbox():
    """Per theme: the bug fails visible and held-out tests, the reference fix passes both."""
    env = SweEnv()
    sample = [next(t for t in TASKS if t["theme"] == theme) for theme in ("text", "numbers", "lists", "grading")]
    backend = make_sandbox_backend(SandboxConfig(type="namespace" if NAMESPACES else "local_unsafe"))
    await backend.probe()
    try:
        for task in sample:
            async with backend.session(task["task_id"]) as sandbox:
                await sandbox.write_files(task["repo"])
                buggy_visible = await env.unittest(sandbox, ".")
                buggy_graded = await env.grade(sandbox, task)
                await sandbox.write_files(task["solution"])
                fixed_graded = await env.grade(sandbox, task)
            assert not buggy_visible.ok and "FAILED" in buggy_visible.output, task["task_id"]
            assert not buggy_graded.ok and fixed_graded.ok, (task["task_id"], fixed_graded.output)
    finally:
        await backend.close()


def fix_script(task: dict, *extra):
    module = task["module"]
    return [call("read_file", path=module), call("write_file", path=module, content=task["solution"][module]),
            call("run_tests"), *extra, call("submit")]


async def test_scripted_fix_and_failures(service, scripted_llm):
    task = TASKS[7]
    cheat = "import unittest\n\n\nclass TestVisible(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    async with httpx.AsyncClient() as client:
        right_url, right = scripted_llm.script(*fix_script(task))
        idle_url, _ = scripted_llm.script(call("run_tests"), call("submit"))
        cheat_url, cheat_script = scripted_llm.script(call("write_file", path=task["visible_test"], content=cheat),
                                                      call("run_tests"), call("submit"))
        silent_url, _ = scripted_llm.script(*fix_script(task)[:2], say("I fixed it."))
        good, idle, cheated, silent = [await run_episode(client, service.url, task["task_id"], url)
                                       for url in (right_url, idle_url, cheat_url, silent_url)]
    assert (good["reward"], good["status"], good["num_turns"], good["info"]["submitted"]) == (1.0, "completed", 4,
                                                                                              True)
    assert good["info"]["tests_passed"] == good["info"]["tests_run"] > 0
    observations = [r["messages"][-1]["content"] for r in right.requests[1:]]
    assert observations[0] == task["repo"][task["module"]]  # read_file returned the buggy module
    assert observations[2].startswith("exit code 0") and "OK" in observations[2]
    assert idle["reward"] == 0.0 and idle["info"]["tests_passed"] < idle["info"]["tests_run"]
    assert "OK" in cheat_script.requests[2]["messages"][-1]["content"]  # the rewritten test passes locally...
    assert cheated["reward"] == 0.0  # ...but grading uses the original tests
    assert (silent["reward"], silent["info"]["submitted"]) == (1.0, False)
    assert [t["function"]["name"] for t in right.requests[0]["tools"]] == ["read_file", "write_file", "run_tests",
                                                                          "submit"]


async def test_paths_outside_the_repository_are_refused(service, scripted_llm):
    task = TASKS[3]
    url, script = scripted_llm.script(call("read_file", path="/etc/passwd"), call("read_file", path="../../x"),
                                      call("write_file", path="../escape.py", content="x"), call("submit"))
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, task["task_id"], url)
    errors = [r["messages"][-1]["content"] for r in script.requests[1:]]
    assert all("not a relative path inside the repository" in e for e in errors)
    assert result["reward"] == 0.0
