"""Credentials end to end: a gateway with a token, an orchestrator with its own token (and the gateway's
and the env services'), an env service with its own token registering with the orchestrator's, the
built-in CPU engine (tiny model) with an API key that the gateway sends. Episodes
talk to the model with their session's own credential and are recorded; a missing or wrong credential is
refused (401) at the engine, the gateway, the orchestrator and the env service, and a session credential
opens no other session."""

import httpx
import pytest

from asyncrl.store import Store
from tests.orchestrator.conftest import group_records, journal, start_envs
from tests.services import ServiceProcess

GATEWAY_TOKEN = "gw-token-e2e"
ORCHESTRATOR_TOKEN = "orch-token-e2e"
ENGINE_KEY = "engine-key-e2e"
ENV_TOKEN = "env-token-e2e"


@pytest.fixture
def authed_engine(tiny_checkpoint, tmp_path):
    from tests.rollout.conftest import start_engine

    engine = start_engine(tiny_checkpoint, tmp_path, "--api-key", ENGINE_KEY, name="engine")
    yield engine
    assert engine.stop() == 0, engine.log()


@pytest.fixture
def authed_gateway(authed_engine, tmp_path, redis_server, run_name):
    proc = ServiceProcess("gateway.server", ["--engine", authed_engine.url, "--redis-url", redis_server.url, "--run",
                                             run_name, "--auth-token", GATEWAY_TOKEN, "--engine-api-key", ENGINE_KEY],
                          tmp_path, name="gateway")
    yield proc
    assert proc.stop() == 0, proc.log()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_episodes_run_with_tokens_everywhere_and_wrong_credentials_are_refused(
        authed_engine, authed_gateway, orchestrators, tmp_path, redis_server, run_name):
    orch = orchestrators("--gateway", authed_gateway.url, "--gateway-token", GATEWAY_TOKEN,
                         "--auth-token", ORCHESTRATOR_TOKEN, "--env-token", ENV_TOKEN, "--group-size", "2", "--max-groups", "2",
                         "--sampling", '{"max_new_tokens": 4}', token=ORCHESTRATOR_TOKEN)
    (service,) = start_envs(tmp_path, 1, "--capacity", "4", "--option", "sleep_s=0.1", "--option", "llm_turns=2",
                            "--option", f"journal={tmp_path}", "--orchestrator", orch.url,
                            "--orchestrator-token", ORCHESTRATOR_TOKEN, "--auth-token", ENV_TOKEN)
    status = orch.wait_done(2, timeout_s=180)
    with httpx.Client(base_url=service.url, timeout=30) as env_service:
        for headers in ({}, bearer("wrong"), bearer(ORCHESTRATOR_TOKEN), bearer(GATEWAY_TOKEN)):
            for method, path in (("GET", "/info"), ("GET", "/tasks"), ("POST", "/episodes")):
                assert env_service.request(method, path, headers=headers).status_code == 401, (method, path)
        assert env_service.get("/info", headers=bearer(ENV_TOKEN)).status_code == 200
        assert env_service.get("/health").status_code == 200 and env_service.get("/metrics").status_code == 200
    service.stop()
    assert status["completed"] == 4 and status["failed"] == 0, status
    records = await group_records(redis_server.url, run_name)
    assert len(records) == 2
    store = Store.connect(redis_server.url, run_name)
    try:
        samples = await store.get_samples([ref for r in records for ref in r.sample_refs])
    finally:
        await store.close()
    assert len(samples) == 4 and all(s.status == "completed" and s.num_turns == 2 and s.loss_mask.sum() >= 2
                                     for s in samples)
    assert len([e for e in journal(tmp_path) if e["event"] == "start"]) == 4  # none retried

    with httpx.Client(base_url=authed_gateway.url, timeout=30) as gateway:
        for headers in ({}, bearer("wrong"), bearer(ORCHESTRATOR_TOKEN)):
            assert gateway.post("/sessions", json={}, headers=headers).status_code == 401
        mine, other = (gateway.post("/sessions", json={}, headers=bearer(GATEWAY_TOKEN)).json() for _ in range(2))
        as_mine = bearer(mine["api_key"])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert gateway.post(f"/sessions/{mine['session_id']}/v1/chat/completions", json=chat,
                            headers=as_mine).status_code == 200
        assert gateway.post(f"/sessions/{other['session_id']}/v1/chat/completions", json=chat,
                            headers=as_mine).status_code == 401
        assert gateway.post(f"/sessions/{mine['session_id']}/finish", json={"reward": 1.0},
                            headers=as_mine).status_code == 401
        assert gateway.post(f"/sessions/{mine['session_id']}/v1/chat/completions", json=chat,
                            headers=bearer("wrong")).status_code == 401

    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for headers in ({}, bearer("wrong"), bearer(GATEWAY_TOKEN), bearer(mine["api_key"])):
        assert httpx.post(authed_engine.url + "/generate", json=generate, headers=headers).status_code == 401
    assert httpx.post(authed_engine.url + "/generate", json=generate, headers=bearer(ENGINE_KEY)).status_code == 200

    with httpx.Client(base_url=orch.url, timeout=30) as orchestrator:
        registration = {"name": "intruder", "url": "http://127.0.0.1:9", "capacity": 1}
        for headers in ({}, bearer("wrong"), bearer(GATEWAY_TOKEN), bearer(mine["api_key"])):
            assert orchestrator.get("/v1/status", headers=headers).status_code == 401
            assert orchestrator.post("/v1/envs", json=registration, headers=headers).status_code == 401
        assert orchestrator.get("/health").status_code == 200 and orchestrator.get("/metrics").status_code == 200
    assert [e["name"] for e in orch.envs()] == []  # the service deregistered; nobody else got in
