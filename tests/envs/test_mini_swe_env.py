"""mini-swe-agent's own loop on a shipped SWE task, end to end through a real service and sandbox: scripted
bash actions that fix the task earn 1, actions that do not earn 0, and the actions ran inside the
sandbox; out of turns, cut replies and a passed deadline end the way the SDK's AgentLoop reports them."""

import asyncio
import json

import httpx
import pytest

from envs.swe.env import DATA
from tests.envs.isolation import NAMESPACES, SANDBOX_ARGS
from tests.envs.scripted_llm import Reply, call, say
from tests.envs.service_process import ROOT, run_episode

TASKS = [json.loads(line) for line in DATA.read_text().splitlines()]
SUBMIT = call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.mini_swe.MiniSweAgentEnv", *SANDBOX_ARGS))
    return service


def bash(command: str) -> Reply:
    return call("bash", command=command)


def write(path: str, content: str) -> Reply:
    return bash(f"cat > {path} <<'ASYNCRL_EOF'\n{content}ASYNCRL_EOF")


def observations(script) -> list[dict]:
    """What each bash action returned, as mini-swe-agent's observation template showed it to the model."""
    return [json.loads(r["messages"][-1]["content"]) for r in script.requests[1:]
            if r["messages"][-1]["role"] == "tool"]


async def test_scripted_fix_solves_the_task_inside_the_sandbox(service, scripted_llm):
    task = TASKS[7]
    module = task["module"]
    url, script = scripted_llm.script(
        bash(f"hostname; pwd; ls; ls {ROOT} >/dev/null 2>&1 && echo host-visible || echo host-hidden"),
        write(module, task["solution"][module]), bash("python3 -m unittest 2>&1 | tail -1"), SUBMIT)
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, task["task_id"], url)
    assert (result["reward"], result["status"], result["reason"], result["num_turns"]) == (1.0, "completed",
                                                                                          "completed", 4)
    assert result["info"]["exit_status"] == "Submitted" and result["info"]["submitted"] is True
    assert result["info"]["tests_passed"] == result["info"]["tests_run"] > 0
    where, wrote, tests = observations(script)
    hostname, workdir, listing = where["output"].split("\n", 2)
    assert workdir != str(ROOT) and module.split("/")[0] in listing  # the episode's repository, not the service's
    if NAMESPACES:
        assert hostname == "sandbox" and listing.rstrip().endswith("host-hidden")  # the host's files are not there
    assert wrote["returncode"] == 0 and tests["output"].strip() == "OK"
    first = script.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["bash"]  # mini-swe-agent's one tool
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in first["messages"][1]["content"]  # its own templates
    assert task["visible_test"] in first["messages"][1]["content"]  # with the SWE env's brief


async def test_actions_that_do_not_fix_the_task_earn_nothing(service, scripted_llm):
    task = TASKS[7]
    cheat = "import unittest\n\n\nclass TestVisible(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    url, script = scripted_llm.script(write(task["visible_test"], cheat), bash("python3 -m unittest 2>&1 | tail -1"),
                                      SUBMIT)
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, task["task_id"], url)
    assert observations(script)[1]["output"].strip() == "OK"  # the rewritten test passes in the sandbox...
    assert (result["reward"], result["status"], result["info"]["submitted"]) == (0.0, "completed", True)
    assert result["info"]["tests_passed"] < result["info"]["tests_run"]  # ...grading runs the original ones


async def test_out_of_turns_and_cut_replies_are_truncated_as_the_agent_loop_reports_them(service, scripted_llm):
    task = TASKS[3]
    busy_url, _ = scripted_llm.script(bash("ls"), bash("ls"))
    cut = Reply(content="Let me think about", finish_reason="length")
    cut_url, cut_script = scripted_llm.script(cut, cut, cut)
    chat_url, _ = scripted_llm.script(say("Done."), say("Done."), say("Done."))
    async with httpx.AsyncClient() as client:
        busy = await run_episode(client, service.url, task["task_id"], busy_url, max_turns=2)
        cut_off, chatty = [await run_episode(client, service.url, task["task_id"], url) for url in (cut_url, chat_url)]
    assert (busy["status"], busy["reason"], busy["num_turns"], busy["info"]["exit_status"]) == (
        "truncated", "max_turns", 2, "LimitsExceeded")
    assert (cut_off["status"], cut_off["reason"], cut_off["num_turns"]) == ("truncated", "max_tokens", 3)
    assert (chatty["status"], chatty["reason"], chatty["info"]["exit_status"]) == ("completed", "completed",
                                                                                  "RepeatedFormatError")
    assert busy["reward"] == cut_off["reward"] == chatty["reward"] == 0.0
    retry = cut_script.requests[1]["messages"]  # the cut reply stays in the conversation, the error follows it
    assert [m["role"] for m in retry[-2:]] == ["assistant", "user"] and retry[-2]["content"] == cut.content


async def test_a_passed_deadline_or_a_cancel_stops_the_harness(service, scripted_llm):
    """Mid-command (the sandbox's) and mid-model-call: the episode ends at once and its thread asks nothing more
    (the command and the reply would be done within the wait below: an unstopped harness would ask again)."""
    task = TASKS[3]
    sleeper_url, sleeper = scripted_llm.script(bash("sleep 3"), bash("ls"), SUBMIT)
    waiter_url, waiter = scripted_llm.script(bash("ls"), Reply(content="...", delay_s=1.5), bash("ls"), SUBMIT)
    async with httpx.AsyncClient() as client:
        expired = await run_episode(client, service.url, task["task_id"], sleeper_url, deadline_s=2)
        running = asyncio.create_task(run_episode(client, service.url, task["task_id"], waiter_url,
                                                  episode_id="e-cancel-mini-swe"))
        while len(waiter.requests) < 2:
            await asyncio.sleep(0.05)
        await client.post(f"{service.url}/episodes/e-cancel-mini-swe/cancel")
        cancelled = await asyncio.wait_for(running, 5)
    assert (expired["status"], expired["reason"]) == ("failed", "deadline_exceeded")
    assert (cancelled["status"], cancelled["reason"]) == ("aborted", "cancelled")
    await asyncio.sleep(4)
    assert (len(sleeper.requests), len(waiter.requests)) == (1, 2)


async def test_the_envs_context_management_folds_mini_swe_agents_own_history(start_services, scripted_llm):
    """keep-recent-k (`--context-option`) edits the history mini-swe-agent's loop keeps: older bash
    observations reach the model as placeholders, and the episode reports the folds."""
    (folding,) = start_services(("envs.mini_swe.MiniSweAgentEnv", *SANDBOX_ARGS, "--context-option", "keep_recent_k=2"))
    task = TASKS[0]
    url, script = scripted_llm.script(*[bash(f"echo step-{i}") for i in range(5)], SUBMIT)
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, folding.url, task["task_id"], url)
    assert result["status"] == "completed" and result["num_turns"] == 6
    last = [m for m in script.requests[-1]["messages"] if m["role"] == "tool"]
    assert [m["content"].startswith("[tool output folded") for m in last] == [True] * 3 + [False] * 2
    assert "step-4" in last[-1]["content"]
    assert result["info"]["context"]["folds"] == 3 and result["info"]["context"]["calls"] == 6
