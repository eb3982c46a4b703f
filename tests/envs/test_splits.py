"""Task splits: the learnable tasks hold a share of their *problems* out (task ids alone would hold
nothing out: 1,000 train ids cover single-digit addition's 100 problems many times), the env service
lists each split (GET /tasks?split=), the orchestrator's client asks for train, and an env written
before splits serves train only and answers eval with a clear 404."""

import asyncio

import httpx
import pytest

from envs.sdk import Environment, EpisodeResult
from envs.sdk.runner import EpisodeRunner
from envs.tasks import ArithmeticEnv, ChainArithmeticEnv, CopyEnv, SortEnv
from tests.envs.scripted_llm import say
from tests.envs.service_process import run_episode


@pytest.mark.parametrize("cls", [ArithmeticEnv, ChainArithmeticEnv, CopyEnv, SortEnv])
def test_held_out_problems_never_reach_training(cls):
    env = cls()
    train, held_out = asyncio.run(env.list_tasks()), asyncio.run(env.list_tasks("eval"))
    assert env.splits == ("train", "eval") and len(train) == 1000 and held_out
    eval_problems = [env.problem(t) for t in held_out]
    assert len(set(eval_problems)) == len(eval_problems)  # distinct problems: the number of tasks is honest
    assert all(env.held_out(p) for p in eval_problems)
    assert not set(eval_problems) & {env.problem(t) for t in train}
    demos = {tuple(m["content"] for m in d if m["role"] == "user") for d in env.demonstrations(2000)}
    assert not demos & {p.prompts for p in eval_problems}  # the warm-up never sees one either
    assert [cls().problem(t) for t in held_out] == eval_problems  # stable across instances


def test_arithmetic_holds_out_a_fixed_share_of_its_100_problems():
    env = ArithmeticEnv()
    held_out = {env.problem(t).prompts[0] for t in asyncio.run(env.list_tasks("eval"))}
    seen_in_training = {env.problem(t).prompts[0] for t in asyncio.run(env.list_tasks())}
    assert len(held_out) == 14 and len(seen_in_training) == 86  # the hash's share of 0.2, exhausted
    assert len(asyncio.run(ArithmeticEnv(num_eval_tasks=5).list_tasks("eval"))) == 5
    assert ArithmeticEnv(seed=1).problem("arith-eval-00000") != env.problem("arith-eval-00000")  # seeded order


def test_no_held_out_split_when_turned_off():
    env = ArithmeticEnv(eval_fraction=0.0)
    assert env.splits == ("train",)
    with pytest.raises(ValueError, match="no 'eval' split"):
        asyncio.run(env.list_tasks("eval"))
    with pytest.raises(ValueError):
        ArithmeticEnv(eval_fraction=1.0)


class Overlapping(Environment):
    name, domain, splits = "overlap", "test", ("train", "eval")

    async def list_tasks(self, split="train"):
        return ["a", "b"] if split == "train" else ["b", "c"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        return EpisodeResult(0.0)


def test_a_split_sharing_task_ids_with_train_refuses_to_load():
    runner = EpisodeRunner(Overlapping(), 1, None, None)
    with pytest.raises(ValueError, match="shares task ids.*'b'"):
        asyncio.run(runner.load_tasks())


@pytest.fixture(scope="module")
def services(start_services):
    arith, old = start_services(("envs.tasks.ArithmeticEnv", "--option", "num_tasks=30"),
                                ("tests.orchestrator.timed_env.TimedEnv", "--option", "num_tasks=7"))
    return arith, old


async def test_service_lists_each_split_and_plays_held_out_tasks(services, scripted_llm):
    arith, _ = services
    info = arith.get("/info").json()
    assert info["num_tasks"] == 30 and info["splits"] == {"train": 30, "eval": 14}
    held_out = arith.get("/tasks?split=eval&limit=5").json()
    assert held_out == {"task_ids": [f"arith-eval-{i:05d}" for i in range(5)], "total": 14, "split": "eval"}
    assert arith.get("/tasks").json()["split"] == "train"
    unknown = arith.get("/tasks?split=test")
    assert unknown.status_code == 404 and "no 'test' split" in unknown.json()["error"]
    answer = ArithmeticEnv().problem("arith-eval-00003").answers[0]
    url, _ = scripted_llm.script(say(answer))
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, arith.url, "arith-eval-00003", url)  # admitted: a task of the service
    assert (result["reward"], result["status"]) == (1.0, "completed")


async def test_orchestrator_trains_on_the_train_split(services):
    from orchestrator.envclient import EnvClient
    from orchestrator.http import client_session

    arith, old = services
    http = client_session()
    try:
        client = EnvClient(http)
        assert await client.tasks(arith.url) == [f"arith-{i:05d}" for i in range(30)]
        assert await client.tasks(old.url) == [f"t-{i:04d}" for i in range(7)]  # a service without splits
    finally:
        await http.close()


def test_an_env_without_splits_serves_train_and_refuses_eval(services):
    _, old = services
    assert old.get("/info").json()["splits"] == {"train": 7}
    refused = old.get("/tasks?split=eval")
    assert refused.status_code == 404 and "no 'eval' split" in refused.json()["error"]
    assert refused.json()["fields"] == ["split"]
