"""A new environment, written only against the SDK and the protocol outside envs/
(tests/test_custom_env.py's ReverseWordEnv), self-registers with the orchestrator and plays the
GRPO groups it is sent; no orchestrator code knows it. Its agent talks to the scripted LLM."""

import re

from tests.envs.scripted_llm import ScriptedLLM, call
from tests.orchestrator.conftest import group_records
from tests.envs.service_process import ServiceProcess as EnvProcess


def reverse_the_word(messages: list[dict]):
    word = re.search(r"Reverse the word (\w+)", messages[0]["content"]).group(1)
    return call("submit", text=word[::-1])


async def test_custom_env_registers_and_receives_groups(orchestrators, tmp_path, redis_server, run_name):
    llm = ScriptedLLM().start()
    try:
        url, script = llm.script(*[reverse_the_word] * 50)
        orch = orchestrators("--llm-url", url, "--group-size", "2", "--max-groups", "3")
        service = EnvProcess("tests.test_custom_env.ReverseWordEnv", tmp_path, "--orchestrator", orch.url,
                             "--option", "bonus=0.5").start()
        status = orch.wait_done(3)
        assert service.stop() == 0
    finally:
        llm.stop()
    assert status["by_env"]["reverse-word"]["completed"] == 6 and status["failed"] == 0
    records = await group_records(redis_server.url, run_name)
    assert sorted(r.group_id for r in records) == [f"g{i:07d}-reverse-word" for i in (1, 2, 3)]
    assert {r.task_id for r in records} <= {"w-1", "w-2", "w-3"}
    assert len(script.requests) == 6
    assert all("submit" in [t["function"]["name"] for t in r["tools"]] for r in script.requests)
    metrics = orch.http.get("/metrics").text
    assert 'asyncrl_orchestrator_reward_sum{env="reverse-word"} 3.0' in metrics  # 6 right answers x bonus 0.5
