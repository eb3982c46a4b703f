"""The learnable tasks end to end: real service process, scripted model, rewards 1 / 0 / partial."""

import httpx
import pytest

from envs.tasks import ArithmeticEnv, ChainArithmeticEnv, CopyEnv, SortEnv
from tests.envs.scripted_llm import say
from tests.envs.service_process import run_episode


@pytest.fixture(scope="module")
def services(start_services):
    names = ("arithmetic", "chain", "copy", "sort")
    targets = ("ArithmeticEnv", "ChainArithmeticEnv", "CopyEnv", "SortEnv")
    started = start_services(*[(f"envs.tasks.{t}", "--option", "num_tasks=50") for t in targets])
    return dict(zip(names, started))


@pytest.mark.parametrize("name,env", [("arithmetic", ArithmeticEnv), ("copy", CopyEnv), ("sort", SortEnv)])
async def test_single_turn_right_and_wrong(services, scripted_llm, name, env):
    service, problem = services[name], env(num_tasks=50).problem(f"{env.prefix}-00007")
    answer = problem.answers[0]
    async with httpx.AsyncClient() as client:
        right_url, right = scripted_llm.script(say(f" {answer}\n"))
        wrong_url, _ = scripted_llm.script(say("zzz 99999"))
        good = await run_episode(client, service.url, f"{env.prefix}-00007", right_url)
        bad = await run_episode(client, service.url, f"{env.prefix}-00007", wrong_url)
    assert (good["status"], good["reward"], good["num_turns"]) == ("completed", 1.0, 1)
    assert (bad["status"], bad["reward"]) == ("completed", 0.0)
    sent = right.requests[0]
    assert sent["messages"] == [{"role": "user", "content": problem.prompts[0]}]
    assert sent["model"] == "scripted" and sent["max_tokens"] == 64 and "tools" not in sent


async def test_sort_gives_partial_credit(services, scripted_llm):
    problem = SortEnv(num_tasks=50).problem("sort-00003")
    digits = problem.answers[0].split()
    wrong_tail = " ".join(digits[:-1] + ["x"])
    url, _ = scripted_llm.script(say(wrong_tail))
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, services["sort"].url, "sort-00003", url)
    assert result["reward"] == pytest.approx((len(digits) - 1) / len(digits))


async def test_multi_turn_chain(services, scripted_llm):
    problem = ChainArithmeticEnv(num_tasks=50).problem("chain-00011")
    first, second = problem.answers
    async with httpx.AsyncClient() as client:
        both_url, both = scripted_llm.script(say(first), say(second))
        half_url, _ = scripted_llm.script(say(first), say("-1000"))
        none_url, _ = scripted_llm.script(say("-1000"), say("-1000"))
        short_url, _ = scripted_llm.script(say(first), say(second))
        results = [await run_episode(client, services["chain"].url, "chain-00011", url) for url in (both_url, half_url,
                                                                                                   none_url)]
        short = await run_episode(client, services["chain"].url, "chain-00011", short_url, max_turns=1)
    assert [r["reward"] for r in results] == [1.0, 0.5, 0.0]
    assert all(r["num_turns"] == 2 and r["status"] == "completed" for r in results)
    # the second turn sees the whole dialogue so far
    assert both.requests[1]["messages"] == [
        {"role": "user", "content": problem.prompts[0]}, {"role": "assistant", "content": first},
        {"role": "user", "content": problem.prompts[1]}]
    assert (short["status"], short["num_turns"], short["reward"]) == ("truncated", 1, 0.5)


async def test_extra_sampling_keys_reach_the_endpoint(services, scripted_llm):
    url, script = scripted_llm.script(say("0"))
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 8, "top_k": 5, "stop": ["\n"]}
    async with httpx.AsyncClient() as client:
        await run_episode(client, services["arithmetic"].url, "arith-00000", url,
                          llm={"base_url": url, "model": "m", "sampling": sampling})
    sent = script.requests[0]
    assert {k: sent[k] for k in sampling} == sampling and sent["model"] == "m"


def test_same_seed_same_tasks():
    a, b, other = ArithmeticEnv(seed=3), ArithmeticEnv(seed=3), ArithmeticEnv(seed=4)
    ids = [f"arith-{i:05d}" for i in range(20)]
    assert [a.problem(t) for t in ids] == [b.problem(t) for t in ids]
    assert [a.problem(t) for t in ids] != [other.problem(t) for t in ids]
