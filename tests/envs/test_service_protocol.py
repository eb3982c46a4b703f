"""The env-service protocol (docs/protocols/env-service.md) as served by the SDK (a real
`python -m envs.serve` process): endpoints, capacity (429), cancellation, deadlines, failures, bad
requests, disconnects."""

import asyncio
import re
import time

import httpx
import pytest

from envs.tasks import ArithmeticEnv
from tests.envs.scripted_llm import say
from tests.envs.service_process import episode_request, run_episode
from tests.services import unpublished_bodies

TASK = "arith-00001"


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.tasks.ArithmeticEnv", "--capacity", "2", "--option", "num_tasks=120"))
    return service


def metric(service, name: str) -> float:
    text = service.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def wait_in_flight(service, n: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(service, 'asyncrl_env_in_flight{env="arithmetic"}') != n:
        assert time.monotonic() < deadline, f"in_flight never reached {n}"
        await asyncio.sleep(0.05)


def test_health_info_tasks(service):
    assert service.get("/health").json() == {"status": "ok"}
    assert service.get("/info").json() == {"name": "arithmetic", "domain": "tasks", "capacity": 2,
                                          "num_tasks": 120, "version": "1", "splits": {"train": 120, "eval": 14}}
    page = service.get("/tasks?offset=100&limit=50").json()
    assert page == {"task_ids": [f"arith-{i:05d}" for i in range(100, 120)], "total": 120, "split": "train"}
    assert service.get("/tasks").json()["task_ids"][:2] == ["arith-00000", "arith-00001"]
    bad = service.get("/tasks?limit=0")
    assert bad.status_code == 422 and bad.json()["fields"] == ["limit"]


async def test_capacity_429_then_serves_again(service, scripted_llm):
    answer = ArithmeticEnv().problem(TASK).answers[0]
    async with httpx.AsyncClient() as client:
        slow = [scripted_llm.script(say(answer, delay_s=2.0))[0] for _ in range(2)]
        running = [asyncio.create_task(run_episode(client, service.url, TASK, url)) for url in slow]
        await wait_in_flight(service, 2)
        url, _ = scripted_llm.script(say(answer))
        refused = await client.post(f"{service.url}/episodes", json=episode_request(TASK, url))
        assert refused.status_code == 429 and "capacity" in refused.json()["error"]
        assert [r["reward"] for r in await asyncio.gather(*running)] == [1.0, 1.0]
        again = await run_episode(client, service.url, TASK, url)
    assert again["reward"] == 1.0
    assert metric(service, 'asyncrl_env_rejected_total{env="arithmetic"}') >= 1


async def test_cancel_ends_episode_as_aborted(service, scripted_llm):
    url, _ = scripted_llm.script(say("1", delay_s=30))
    async with httpx.AsyncClient() as client:
        running = asyncio.create_task(run_episode(client, service.url, TASK, url, episode_id="e-cancel-me"))
        await wait_in_flight(service, 1)
        started = time.monotonic()
        cancelled = await client.post(f"{service.url}/episodes/e-cancel-me/cancel")
        assert cancelled.json() == {"episode_id": "e-cancel-me", "cancelled": True}
        result = await running
        assert time.monotonic() - started < 5
        unknown = await client.post(f"{service.url}/episodes/e-never/cancel")
    assert (result["status"], result["reward"], result["num_turns"]) == ("aborted", 0.0, 0)  # its one call unanswered
    assert unknown.status_code == 404 and "e-never" in unknown.json()["error"]


async def test_deadline_is_an_infrastructure_failure_not_a_truncation(service, scripted_llm):
    url, _ = scripted_llm.script(say("1", delay_s=30))
    async with httpx.AsyncClient() as client:
        started = time.monotonic()
        result = await run_episode(client, service.url, TASK, url, deadline_s=1.0)
    assert time.monotonic() - started < 6
    assert (result["status"], result["outcome"], result["reason"]) == ("failed", "infrastructure", "deadline_exceeded")
    assert result["reward"] == 0.0 and result["info"]["deadline_s"] == 1.0


async def test_broken_llm_endpoint_is_failed(service, scripted_llm):
    url, script = scripted_llm.script()  # no replies: every call answers 500
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, TASK, url)
        unreachable = await run_episode(client, service.url, TASK, "http://127.0.0.1:9/v1")
    assert result["status"] == "failed" and "InternalServerError" in result["info"]["error"]
    assert len(script.requests) == 2  # the call and its one retry
    assert unreachable["status"] == "failed" and "APIConnectionError" in unreachable["info"]["error"]
    assert {(r["outcome"], r["reason"]) for r in (result, unreachable)} == {("infrastructure", "llm_error")}


@pytest.mark.parametrize("change,field", [
    (lambda b: b.pop("task_id"), "task_id"),
    (lambda b: b.update(max_turns="many"), "max_turns"),
    (lambda b: b.update(max_turns=0), "max_turns"),
    (lambda b: b["llm"].pop("base_url"), "llm.base_url"),
    (lambda b: b["llm"]["sampling"].update(temperature=-1), "llm.sampling.temperature"),
    (lambda b: b.update(deadline_s=0), "deadline_s"),
    (lambda b: b.update(deadline_s=10 ** 9), "deadline_s"),
    (lambda b: b.update(max_turns=10 ** 9), "max_turns"),
    (lambda b: b.update(max_turns=True), "max_turns"),
    (lambda b: b.update(seed=2 ** 64), "seed"),
    (lambda b: b.update(seed="7"), "seed"),
    (lambda b: b.update(episode_id="e\nforged"), "episode_id"),
    (lambda b: b.update(task_id="t" * 100_000), "task_id"),
    (lambda b: b["llm"].update(base_url="file:///etc/passwd"), "llm.base_url"),
    (lambda b: b["llm"].update(base_url="http://h/" + "x" * 5000), "llm.base_url"),
    (lambda b: b["llm"].update(model="m" * 10_000), "llm.model"),
    (lambda b: b["llm"].update(api_key=["k"]), "llm.api_key"),
    (lambda b: b["llm"]["sampling"].update(max_tokens=10 ** 9), "llm.sampling.max_tokens"),
    (lambda b: b["llm"]["sampling"].update(top_p="1"), "llm.sampling.top_p"),
])
async def test_bad_request_names_the_field(service, change, field):
    body = episode_request(TASK, "http://127.0.0.1:9/v1")
    change(body)
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{service.url}/episodes", json=body)
    assert reply.status_code == 422
    assert reply.json()["fields"] == [field] and field in reply.json()["error"]


async def test_a_body_over_the_limit_is_refused_unread(service):
    body = episode_request(TASK, "http://127.0.0.1:9/v1")
    body["episode_id"] = "e" * 2_000_000
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{service.url}/episodes", json=body)
    assert reply.status_code == 413 and "exceeds" in reply.json()["error"], reply.text[:300]


def test_openapi_publishes_every_request_body(service):
    openapi = service.get("/openapi.json").json()
    assert unpublished_bodies(openapi, frozenset({"POST /episodes/{episode_id}/cancel"})) == []


async def test_unknown_task_duplicate_episode_and_garbage(service, scripted_llm):
    url, _ = scripted_llm.script(say("1", delay_s=1.5))
    async with httpx.AsyncClient() as client:
        unknown = await client.post(f"{service.url}/episodes", json=episode_request("arith-99999", url))
        garbage = await client.post(f"{service.url}/episodes", content=b"{not json",
                                    headers={"content-type": "application/json"})
        running = asyncio.create_task(run_episode(client, service.url, TASK, url, episode_id="e-dup"))
        await wait_in_flight(service, 1)
        duplicate = await client.post(f"{service.url}/episodes", json=episode_request(TASK, url, episode_id="e-dup"))
        await running
    assert unknown.status_code == 404 and "arith-99999" in unknown.json()["error"]
    assert garbage.status_code == 422 and garbage.json()["fields"] == ["body"] and "JSON" in garbage.json()["error"]
    assert duplicate.status_code == 409 and "e-dup" in duplicate.json()["error"]


async def test_caller_hanging_up_aborts_the_episode(service, scripted_llm):
    url, _ = scripted_llm.script(say("1", delay_s=30))
    aborted_before = metric(service, 'asyncrl_env_episodes_total{env="arithmetic",status="aborted"}')
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{service.url}/episodes", json=episode_request(TASK, url), timeout=1.0)
    await wait_in_flight(service, 0, timeout_s=10)
    assert metric(service, 'asyncrl_env_episodes_total{env="arithmetic",status="aborted"}') == aborted_before + 1
