"""Where an episode's outcome class is decided: the SDK's runner (envs/sdk/runner.py) playing real
episodes against the scripted LLM, in process, with the local sandbox. Only what the environment
returns is a model outcome (trained); whatever broke around it is a failure with the reason that
names what broke (excluded from training), and /metrics counts each per class and env."""

import asyncio
import itertools
import logging
import math
import re
import shutil

import pytest
from pydantic import ValidationError

from asyncrl.protocols.env_service import EpisodeRequest, EpisodeResponse, LLMEndpoint
from envs.sdk import AgentLoop, Environment, EpisodeReason, EpisodeResult, EpisodeStatus, Tool, ToolResult, schema
from envs.sdk.metrics import ServiceMetrics
from envs.sdk.runner import EpisodeRunner
from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend
from tests.envs.scripted_llm import Reply, call, say


class ScenarioEnv(Environment):
    """The task id names what the episode does."""

    name, domain = "scenarios", "test"
    requires_sandbox = True

    async def list_tasks(self):
        return ["play", "tool-raises", "returns-failed", "claims-deadline", "nan-reward", "huge-reward",
                "own-timeout", "sandbox-gone", "sleeps"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        if task_id == "returns-failed":
            return EpisodeResult(0.0, EpisodeStatus.failed)
        if task_id == "claims-deadline":
            return EpisodeResult(0.0, EpisodeStatus.truncated, reason=EpisodeReason.deadline_exceeded)
        if task_id == "nan-reward":
            return EpisodeResult(math.nan)
        if task_id == "huge-reward":  # finite, but no reward this env can give (reward_range)
            return EpisodeResult(1e30)
        if task_id == "own-timeout":  # the env's own timeout, not the episode's deadline
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        if task_id == "sandbox-gone":  # the episode directory vanished under the sandbox
            shutil.rmtree(sandbox.workdir)
            await sandbox.run("ls")
        if task_id == "sleeps":
            await asyncio.sleep(30)

        async def broken() -> str:
            raise RuntimeError("grader database is down")

        async def noop() -> ToolResult:
            return ToolResult("ok")

        tools = [Tool("noop", "Do nothing.", schema({}), noop), Tool("broken", "Break.", schema({}), broken)]
        outcome = await AgentLoop(llm, ctx, tools).run([{"role": "user", "content": task_id}])
        return EpisodeResult(1.0, status=outcome.status, reason=outcome.reason, info={"final": outcome.final_text})


@pytest.fixture
async def runner(tmp_path):
    sandboxes = make_sandbox_backend(SandboxConfig(type="local_unsafe", root_dir=str(tmp_path)))
    await sandboxes.probe()
    runner = EpisodeRunner(ScenarioEnv(), capacity=8, sandboxes=sandboxes, metrics=ServiceMetrics("scenarios", "local"))
    await runner.load_tasks()
    yield runner
    await sandboxes.close()


EPISODE_IDS = itertools.count()


def request(task_id: str, base_url: str = "http://127.0.0.1:9/v1", **overrides) -> EpisodeRequest:
    fields = {"episode_id": f"e-{next(EPISODE_IDS)}", "max_turns": 2, **overrides}
    return EpisodeRequest(task_id=task_id, llm=LLMEndpoint(base_url=base_url, model="scripted"), **fields)


def outcome_of(response: EpisodeResponse) -> tuple[str, str, str]:
    return response.status.value, response.outcome.value, response.reason.value


def counted(runner: EpisodeRunner, outcome: str, reason: str) -> float:
    found = re.search(rf'^asyncrl_env_outcomes_total{{env="scenarios",outcome="{outcome}",reason="{reason}"}} (\S+)$',
                      runner.metrics.render().decode(), re.M)
    assert found, f"no series for {outcome}/{reason}"
    return float(found.group(1))


async def test_model_outcomes_are_completed_or_truncated_by_turns_or_tokens(runner, scripted_llm):
    done, _ = scripted_llm.script(say("finished"))
    turns, _ = scripted_llm.script(call("noop"), call("noop"))
    tokens, _ = scripted_llm.script(call("noop"), Reply(content="the answer is", finish_reason="length"))
    results = [await runner.run(request("play", url)) for url in (done, turns, tokens)]
    assert [outcome_of(r) for r in results] == [("completed", "model", "completed"), ("truncated", "model", "max_turns"),
                                                ("truncated", "model", "max_tokens")]
    assert [r.reward for r in results] == [1.0, 1.0, 1.0]  # the env's verdict stands: these are trained
    assert results[2].info["final"] == "the answer is"  # a cut reply is still the model's last word
    assert [counted(runner, "model", reason) for reason in ("completed", "max_turns", "max_tokens")] == [1, 1, 1]


async def test_a_retried_model_call_is_one_turn(runner, scripted_llm):
    """The OpenAI client retries a 503 (as a gateway answers when no engine came back in time): the episode
    made one model call, not two."""
    url, script = scripted_llm.script(Reply(status=503), say("finished"))
    result = await runner.run(request("play", url))
    assert outcome_of(result) == ("completed", "model", "completed") and len(script.requests) == 2
    assert result.num_turns == 1


async def test_an_env_result_without_a_reason_gets_its_status_default(runner, scripted_llm):
    class Plain(ScenarioEnv):
        async def run_episode(self, task_id, llm, sandbox, ctx):
            return EpisodeResult(0.5, EpisodeStatus.truncated if task_id == "sleeps" else EpisodeStatus.completed)

    runner.env = Plain()
    assert outcome_of(await runner.run(request("play"))) == ("completed", "model", "completed")
    assert outcome_of(await runner.run(request("sleeps"))) == ("truncated", "model", "max_turns")


@pytest.mark.parametrize("task_id,reason,error", [
    ("tool-raises", "env_error", "RuntimeError: grader database is down"),
    ("returns-failed", "env_error", "raise to report a failure"),
    ("claims-deadline", "env_error", "with reason 'deadline_exceeded'"),
    ("nan-reward", "env_error", "non-finite reward"),
    ("huge-reward", "env_error", "reward 1e+30 outside ScenarioEnv.reward_range [-100, 100]"),
    ("own-timeout", "env_error", "TimeoutError"),
    ("sandbox-gone", "sandbox_error", "SandboxError: cannot start 'bash' in the sandbox"),
])
async def test_failures_are_classified_by_what_broke(runner, scripted_llm, caplog, task_id, reason, error):
    url, _ = scripted_llm.script(call("broken"))
    with caplog.at_level(logging.WARNING, logger="envs.runner"):
        response = await runner.run(request(task_id, url))
    outcome = "environment" if reason == "env_error" else "infrastructure"
    assert outcome_of(response) == ("failed", outcome, reason) and response.reward == 0.0
    assert error in response.info["error"]
    assert counted(runner, outcome, reason) == 1
    assert f"task={task_id} status=failed reason={reason}" in caplog.text and error in caplog.text  # logged


async def test_an_env_sets_its_reward_range(runner, scripted_llm):
    class Large(ScenarioEnv):
        reward_range = (0.0, 1e31)

    runner.env = Large()
    response = await runner.run(request("huge-reward"))
    assert outcome_of(response) == ("completed", "model", "completed") and response.reward == 1e30


async def test_deadline_and_llm_endpoint_are_infrastructure_failures(runner, scripted_llm, caplog):
    broken_llm, _ = scripted_llm.script()  # answers 500
    slow_llm, _ = scripted_llm.script(say("late", delay_s=30))
    with caplog.at_level(logging.WARNING, logger="envs.runner"):
        cut_in_env = await runner.run(request("sleeps", deadline_s=0.3))
    assert "task=sleeps status=failed reason=deadline_exceeded" in caplog.text  # a deadline cut is logged
    cut_in_llm_call = await runner.run(request("play", slow_llm, deadline_s=0.3))
    llm_down = await runner.run(request("play", broken_llm))
    assert [outcome_of(r) for r in (cut_in_env, cut_in_llm_call)] == [("failed", "infrastructure",
                                                                       "deadline_exceeded")] * 2
    assert outcome_of(llm_down) == ("failed", "infrastructure", "llm_error")
    assert "InternalServerError" in llm_down.info["error"]
    assert counted(runner, "infrastructure", "deadline_exceeded") == 2
    assert counted(runner, "infrastructure", "llm_error") == 1
    assert counted(runner, "model", "completed") == 0


async def test_a_cancelled_episode_is_aborted(runner):
    playing = asyncio.create_task(runner.run(request("sleeps", episode_id="e-cancel")))
    while runner.in_flight == 0:
        await asyncio.sleep(0.01)
    assert runner.cancel("e-cancel")
    assert outcome_of(await playing) == ("aborted", "cancelled", "cancelled")
    assert counted(runner, "cancelled", "cancelled") == 1


def test_responses_of_services_without_reasons_are_read_by_their_status():
    body = {"episode_id": "e", "task_id": "t", "reward": 0.0, "num_turns": 1}
    deadline = EpisodeResponse.model_validate({**body, "status": "truncated", "info": {"reason": "deadline_exceeded"}})
    assert outcome_of(deadline) == ("failed", "infrastructure", "deadline_exceeded")  # no longer a truncation
    assert outcome_of(EpisodeResponse.model_validate({**body, "status": "truncated"})) == ("truncated", "model",
                                                                                          "max_turns")
    assert outcome_of(EpisodeResponse.model_validate({**body, "status": "failed"})) == ("failed", "environment",
                                                                                       "env_error")
    with pytest.raises(ValidationError, match="reason 'llm_error' means status 'failed'"):
        EpisodeResponse.model_validate({**body, "status": "completed", "reason": "llm_error"})
    sent = EpisodeResponse.model_validate({**body, "status": "completed", "reason": "completed"})
    assert sent.model_dump(mode="json")["outcome"] == "model"
