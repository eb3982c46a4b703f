"""Every sampling field of every API is checked at the gateway for type and range (a 400 naming the field,
before any engine sees it), and an engine's own 4xx is passed back as a 400 naming what it said, never
retried; meanwhile a long turn through the same gateway and engine finishes normally."""

import asyncio
import re

import pytest

from asyncrl.protocols.engine import MAX_SEED
from tests.gateway.test_failover import FAILOVER, token_turn

PROMPT = [1006, 1008, 1011, 72, 1012, 1014]
USER = [{"role": "user", "content": "hi"}]

CHAT_MALFORMED = [
    ("temperature", "hot"), ("temperature", True), ("temperature", -0.5), ("temperature", 2.5),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "1"), ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5),
    ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "8"), ("max_completion_tokens", -3),
    ("max_completion_tokens", False), ("seed", -1), ("seed", MAX_SEED + 1), ("seed", "7"), ("seed", 1.5),
    ("stop", 5), ("stop", [1]), ("stop", {"a": 1}), ("n", 2), ("n", "1"), ("logprobs", "yes"), ("logprobs", 1),
    ("top_logprobs", 21), ("top_logprobs", -1), ("top_logprobs", "2"), ("frequency_penalty", 3),
    ("frequency_penalty", "0"), ("presence_penalty", -2.5), ("repetition_penalty", 0), ("logit_bias", "none"),
    ("logit_bias", {"5": "up"}), ("response_format", "json"), ("stream", "yes"),
]
NATIVE_MALFORMED = [
    ("temperature", "hot"), ("temperature", -1), ("top_p", 0), ("top_k", -3), ("top_k", True), ("min_p", 2),
    ("max_new_tokens", -1), ("max_new_tokens", True), ("max_new_tokens", 4.0), ("min_new_tokens", -1),
    ("stop", 5), ("stop", [1]), ("stop_token_ids", "x"), ("stop_token_ids", [True]), ("ignore_eos", "yes"),
    ("sampling_seed", -1), ("sampling_seed", MAX_SEED + 1), ("sampling_seed", "3"), ("n", 2), ("n", "1"),
    ("skip_special_tokens", 0), ("no_stop_trim", "no"), ("spaces_between_special_tokens", 1),
]


async def test_malformed_sampling_is_a_400_naming_the_field_while_a_long_turn_runs(random_client):
    interruptions = await engine_interruptions(random_client)
    long_sid = (await random_client.create())["session_id"]
    long_turn = asyncio.create_task(token_turn(random_client, long_sid, PROMPT, FAILOVER))
    sid = (await random_client.create())["session_id"]
    answers = []
    for field, value in CHAT_MALFORMED:
        r = await random_client.http.post(f"/sessions/{sid}/v1/chat/completions",
                                          json={"messages": USER, "max_tokens": 4, field: value})
        answers.append((field, value, r.status_code, r.json()["error"]["message"]))
    for field, value in NATIVE_MALFORMED:
        r = await random_client.http.post(f"/sessions/{sid}/generate",
                                          json={"input_ids": PROMPT, "sampling_params": {field: value}})
        answers.append((f"sampling_params.{field}", value, r.status_code, r.json().get("error", r.text)))
    for field, value in [("input_ids", [True]), ("input_ids", [-1]), ("input_ids", "12"), ("return_logprob", 1),
                         ("top_logprobs_num", "3")]:
        r = await random_client.http.post(f"/sessions/{sid}/generate", json={"input_ids": PROMPT, field: value})
        answers.append((field, value, r.status_code, r.json().get("error", r.text)))
    for value in (-1, MAX_SEED + 1, "5", 0.5):
        r = await random_client.http.post("/sessions", json={"sampling": {"sampling_seed": value}})
        answers.append(("sampling.sampling_seed", value, r.status_code, r.json().get("error", r.text)))
    wrong = [(field, value, status, message) for field, value, status, message in answers
             if status != 400 or field.split(".")[-1] not in message]
    assert not wrong, wrong
    out = await long_turn
    assert len(out["output_ids"]) == FAILOVER["max_new_tokens"] and out["meta_info"]["finish_reason"]["type"] == "length"
    [segment] = (await random_client.record(long_sid))["segments"]
    assert [t["finish_reason"] for t in segment["turns"]] == ["length"]  # one call: nothing aborted it
    assert (await random_client.record(sid))["segments"] == []  # no malformed turn reached the ledger
    assert await engine_interruptions(random_client) == interruptions  # the gateway is shared: earlier tests count


async def engine_interruptions(client) -> float:
    metrics = (await client.http.get("/metrics")).text
    return float(re.search(r"^asyncrl_gateway_engine_interruptions_total (\S+)$", metrics, re.M).group(1))


async def test_the_extremes_of_the_seed_range_are_served(random_client):
    sid = (await random_client.create(sampling={"sampling_seed": MAX_SEED}))["session_id"]
    for seed in (None, 0):  # turn 0: the session's seed; turn 1 would be 2**64 (wraps to 0), here the request's
        r = await random_client.http.post(f"/sessions/{sid}/generate", json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}})
        assert r.status_code == 200, r.text
    r = await random_client.http.post(f"/sessions/{sid}/generate", json={"input_ids": [72], "sampling_params": {
        "max_new_tokens": 2}})  # turn 2: MAX_SEED + 2, wrapped
    assert r.status_code == 200, r.text
    [segment] = (await random_client.record(sid))["segments"]
    assert [t["sampling"].get("sampling_seed") for t in segment["turns"]] == [MAX_SEED, 0, 1]


@pytest.mark.parametrize("api", ["chat", "native"])
async def test_an_engine_refusal_is_a_400_naming_it_and_not_retried(api, random_client):
    """A prompt id outside the vocabulary (token-native) or a budget beyond the context (chat): the engine
    answers 4xx; the gateway makes that one call and passes the engine's reason back."""
    sid = (await random_client.create())["session_id"]
    requests_before = {e["url"]: e["requests"] for e in (await random_client.http.get("/engines")).json()["engines"]}
    if api == "native":
        r = await random_client.http.post(f"/sessions/{sid}/generate", json={"input_ids": [10**6]})
        message, reason = r.json()["error"], "outside the vocabulary"
    else:
        r = await random_client.http.post(f"/sessions/{sid}/v1/chat/completions",
                                          json={"messages": USER, "max_tokens": 10**7})
        message, reason = r.json()["error"]["message"], "context length"
    assert r.status_code == 400 and reason in message and "engine" in message, r.text
    engines = (await random_client.http.get("/engines")).json()["engines"]
    assert {e["url"]: e["requests"] - requests_before[e["url"]] for e in engines} == {engines[0]["url"]: 1}
    assert all(e["healthy"] and e["failures"] == 0 for e in engines)
