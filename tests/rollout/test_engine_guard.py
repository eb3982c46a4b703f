"""The engine's edge: SGLang's --api-key (401 without the key; /health*, /metrics open), the request-body
limit (413), and an event loop that keeps answering /health while a maximal request is tokenized."""

import time

import httpx
import pytest

from asyncrl.config import ENGINE_API_KEY_ENV
from asyncrl.engine_client import EngineClient, EngineError
from rollout.engine import EngineArgs
from tests.rollout.conftest import start_engine
from tests.services import ServiceProcess, health_latencies_while

KEY = "engine-secret"
MAX_BYTES = EngineArgs.max_request_bytes


@pytest.fixture(scope="module")
def keyed_engine(tiny_checkpoint, tmp_path_factory):
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("keyed-engine"), "--api-key", KEY,
                        "--max-request-bytes", str(MAX_BYTES), name="keyed-engine")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
async def test_missing_or_wrong_key_is_401(keyed_engine, headers):
    async with httpx.AsyncClient(base_url=keyed_engine.url, timeout=30, headers=headers) as http:
        for method, path in [("POST", "/generate"), ("GET", "/get_model_info"), ("POST", "/update_weights_from_tensor"),
                             ("POST", "/abort_request")]:
            response = await http.request(method, path, json={"input_ids": [1]})
            assert response.status_code == 401, (path, response.text)
            assert "bearer token" in response.json()["error"]
        for path in ["/health", "/health_generate", "/metrics"]:  # SGLang's open paths
            assert (await http.get(path)).status_code == 200, path


async def test_the_right_key_is_accepted(keyed_engine):
    async with EngineClient(keyed_engine.url, timeout_s=60, api_key=KEY) as client:
        out = await client.generate([1006, 1008], {"max_new_tokens": 3, "ignore_eos": True})
        assert len(out.output_ids) == 3 and (await client.model_info())["is_generation"]
    async with EngineClient(keyed_engine.url, timeout_s=60, retries=0) as keyless:
        with pytest.raises(EngineError) as refused:
            await keyless.generate([1006, 1008], {"max_new_tokens": 3})
        assert refused.value.status == 401


async def test_a_body_over_the_limit_is_413_but_a_weight_push_is_not_limited(keyed_engine):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=keyed_engine.url, timeout=60, headers=headers) as http:
        big = await http.post("/generate", json={"text": "x" * (MAX_BYTES + 10)})
        assert big.status_code == 413 and str(MAX_BYTES) in big.json()["error"]
        push = await http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["A" * (MAX_BYTES + 8)]})
        assert push.status_code == 400 and "safetensors" in push.json()["message"]  # read whole, then refused


MAXIMAL = {"text": lambda: {"text": "hello world, " * ((MAX_BYTES - 1024) // 13)},
           "input_ids": lambda: {"input_ids": [1000 + i % 9 for i in range((MAX_BYTES - 1024) // 6)]}}
"""Requests as large as the default limit admits: seconds of tokenizing, or ~1.4M ids to validate."""


@pytest.mark.parametrize("prompt", sorted(MAXIMAL))
async def test_health_answers_fast_while_a_maximal_request_is_handled(keyed_engine, prompt):
    """The largest prompt the limit allows is parsed, validated and tokenized off the event loop (then
    fails the context-length check): the loop keeps serving meanwhile."""
    body = MAXIMAL[prompt]()
    async with httpx.AsyncClient(base_url=keyed_engine.url, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:
        started = time.monotonic()
        response, latencies = await health_latencies_while(http, "/generate", body)
        elapsed = time.monotonic() - started
    assert response.status_code == 400 and "context length" in response.json()["error"]
    # the ids case takes ~0.3 s: the first poll precedes the upload, a later one spans the handling
    assert elapsed > 0.1 and len(latencies) >= 2, f"the request was too quick to test anything ({elapsed:.2f} s)"
    print(f"/health: {len(latencies)} polls, max {max(latencies) * 1000:.0f} ms")  # -s shows it
    assert max(latencies) < 0.5, latencies


@pytest.mark.parametrize("key", [KEY, None])
async def test_the_gateway_reaches_a_keyed_engine_with_its_key(keyed_engine, tmp_path, key):
    """With --engine-api-key the gateway's turns reach the engine; without it the engine refuses them, and
    the turn's error is the gateway's (502, naming the setting), not the client's (400)."""
    args = ["--engine", keyed_engine.url, "--engine-timeout-s", "10"] + (["--engine-api-key", key] if key else [])
    gateway = ServiceProcess("gateway.server", args, tmp_path, name="gateway", env={ENGINE_API_KEY_ENV: ""})
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            turn = await http.post(f"/sessions/{sid}/generate",
                                   json={"input_ids": [1006, 1008], "sampling_params": {"max_new_tokens": 2}})
        if key:
            assert turn.status_code == 200 and len(turn.json()["output_ids"]) == 2, turn.text
        else:
            assert turn.status_code == 502 and "rollout.api_key" in turn.json()["error"], turn.text
    finally:
        assert gateway.stop() == 0, gateway.log()
