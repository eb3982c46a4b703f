"""A new environment written only against the SDK and the protocol, outside envs/: served by
`python -m envs.serve`, it registers with an orchestrator and plays the episodes it is sent."""

import asyncio

import httpx
import pytest

from envs.sdk import AgentLoop, Environment, EpisodeResult, Tool, ToolResult, schema

WORDS = {"w-1": "ember", "w-2": "fjord", "w-3": "onyx"}


class ReverseWordEnv(Environment):
    """The agent must submit the task's word reversed through a `submit` tool."""

    name = "reverse-word"
    domain = "toy"

    def __init__(self, bonus: float = 1.0):
        self.bonus = bonus

    async def list_tasks(self):
        return sorted(WORDS)

    async def run_episode(self, task_id, llm, sandbox, ctx):
        submitted = []

        async def submit(text: str) -> ToolResult:
            submitted.append(text)
            return ToolResult("thanks", done=True)

        messages = [{"role": "user", "content": f"Reverse the word {WORDS[task_id]} and submit it."}]
        outcome = await AgentLoop(llm, ctx, [Tool("submit", "Submit the answer.", schema({"text": "answer"}),
                                                  submit)]).run(messages)
        right = submitted == [WORDS[task_id][::-1]]
        return EpisodeResult(reward=self.bonus if right else 0.0, status=outcome.status, reason=outcome.reason,
                             info={"submitted": submitted})


@pytest.fixture
def harness(tmp_path):
    from tests.envs.recording_orchestrator import RecordingOrchestrator
    from tests.envs.scripted_llm import ScriptedLLM
    from tests.envs.service_process import ServiceProcess

    llm, orchestrator = ScriptedLLM().start(), RecordingOrchestrator().start()
    service = ServiceProcess("tests.test_custom_env.ReverseWordEnv", tmp_path, "--orchestrator", orchestrator.url,
                             "--option", "bonus=0.5").start()
    yield llm, orchestrator, service
    assert service.stop() == 0
    orchestrator.stop()
    llm.stop()


async def test_custom_env_registers_and_plays_episodes(harness):
    from tests.envs.scripted_llm import call
    from tests.envs.service_process import run_episode

    llm, orchestrator, service = harness
    (registration,) = await asyncio.to_thread(orchestrator.wait_for, orchestrator.registrations)
    assert registration.body["name"] == "reverse-word" and registration.body["url"] == service.url
    assert service.get("/tasks").json() == {"task_ids": ["w-1", "w-2", "w-3"], "total": 3, "split": "train"}
    async with httpx.AsyncClient() as client:
        right_url, _ = llm.script(call("submit", text="xyno"))
        wrong_url, _ = llm.script(call("submit", text="onyx"))
        good = await run_episode(client, service.url, "w-3", right_url)
        bad = await run_episode(client, service.url, "w-3", wrong_url)
    assert (good["reward"], good["status"], good["reason"], good["outcome"], good["num_turns"]) == (
        0.5, "completed", "completed", "model", 1)
    assert (bad["reward"], bad["info"]["submitted"]) == (0.0, ["onyx"])
