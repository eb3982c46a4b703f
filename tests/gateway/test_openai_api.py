"""The official `openai` client against a session base_url, unchanged; and the API's 4xx answers."""

import asyncio
import inspect

import httpx
import openai
import pytest

from asyncrl.config import GatewayConfig
from gateway.server import build_app
from tests.gateway.conftest import AUTH_TOKEN, error_message
from tests.gateway.scripted import COMMAND, CONTENT, REASONING, TOOLS
from tests.services import unpublished_bodies

USER = [{"role": "user", "content": "List the files."}]


async def test_chat_models_and_usage(scripted_client, openai_client):
    session = await scripted_client.create()
    client = openai_client(base_url=session["base_url"], api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == ["asyncrl"]
    reply = await client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    call = reply.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "bash" and call.id == "call_0_0"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    with_logprobs = await client.chat.completions.create(model="asyncrl", messages=USER + [
        reply.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                                 "content": "x"}], tools=TOOLS, logprobs=True)
    entries = with_logprobs.choices[0].logprobs.content
    assert len(entries) == with_logprobs.usage.completion_tokens and all(e.logprob <= 0 for e in entries)
    # Each entry's bytes are its token's own: some tokens hold part of a character (their `token` is '\ufffd').
    assert bytes(b for e in entries for b in e.bytes).decode().startswith(REASONING)


async def test_streaming_matches_the_plain_reply(scripted_client, openai_client):
    session = await scripted_client.create(sampling={"sampling_seed": 5})
    client = openai_client(base_url=session["base_url"], api_key="unused")
    stream = await client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == CONTENT
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "bash" and COMMAND in calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    assert segment["messages"][-1]["tool_calls"][0]["function"]["name"] == "bash"
    # The streamed reply, sent back by the client, extends the same segment.
    message = {"role": "assistant", "content": CONTENT, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "bash", "arguments": calls[0].function.arguments}}]}
    await client.chat.completions.create(model="asyncrl", messages=USER + [message, {
        "role": "tool", "tool_call_id": calls[0].id, "content": "a.py"}], tools=TOOLS)
    record = await scripted_client.record(session["session_id"])
    assert len(record["segments"]) == 1 and len(record["segments"][0]["turns"]) == 2


async def test_session_id_header_route(scripted_gateway, scripted_client, openai_client):
    session = await scripted_client.create()
    client = openai_client(base_url=scripted_gateway.url + "/v1", api_key="unused",
                                default_headers={"X-Session-Id": session["session_id"]})
    reply = await client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len((await scripted_client.record(session["session_id"]))["segments"][0]["turns"]) == 1
    missing = await scripted_client.http.post("/v1/chat/completions", json={"messages": USER})
    assert missing.status_code == 400 and "X-Session-Id" in error_message(missing)


async def test_bad_requests_get_clear_4xx(scripted_gateway, scripted_client, openai_client):
    session = await scripted_client.create()
    client = openai_client(base_url=session["base_url"], api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        await client.chat.completions.create(model="m", messages=USER, n=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role 'robot'"):
        await client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        await client.chat.completions.create(model="m", messages=USER + [
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"arguments": "{}"}}]}])
    http = scripted_client.http
    sid = session["session_id"]
    malformed = await http.post(f"/sessions/{sid}/v1/chat/completions", content=b"{not json",
                                headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and "malformed JSON" in error_message(malformed)
    empty = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and "messages" in error_message(empty)
    bad_temperature = await http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": USER, "temperature": -1})
    assert bad_temperature.status_code == 400 and "temperature" in error_message(bad_temperature)
    huge = await http.post(f"/sessions/{sid}/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "x" * 100_000}]})
    assert huge.status_code == 413 and "65536" in error_message(huge)
    with pytest.raises(openai.NotFoundError):
        await openai_client(base_url=f"{scripted_gateway.url}/sessions/nope/v1", api_key="u",
                                 max_retries=0).chat.completions.create(model="m", messages=USER)
    assert (await http.get("/sessions/nope")).status_code == 404
    await scripted_client.finish(sid, reward=0.0)
    with pytest.raises(openai.ConflictError, match="completed"):
        await client.chat.completions.create(model="m", messages=USER)
    record = await scripted_client.record(sid)
    assert record["status"] == "completed" and record["segments"] == []


def test_every_error_handler_is_a_coroutine(template):
    """Starlette runs a plain-function handler in its thread pool: a thread hop per error reply, and at a
    gateway's first one an import of anyio's thread backend on the event loop (~110 ms, seen by py-spy while the
    maximal-request test polled /health)."""
    handlers = build_app(GatewayConfig(), template, None).exception_handlers
    assert handlers and all(inspect.iscoroutinefunction(handler) for handler in handlers.values()), handlers


async def test_bearer_token_guards_every_route(random_gateway, openai_client):
    async with httpx.AsyncClient(base_url=random_gateway.url) as anonymous:
        for method, path in [("POST", "/sessions"), ("GET", "/engines"), ("GET", "/v1/models"),
                             ("POST", "/sessions/x/finish"), ("GET", "/server_info")]:
            r = await anonymous.request(method, path)
            assert r.status_code == 401 and "bearer token" in error_message(r), path
        for path in ("/health", "/metrics"):  # open to probers, as at every service (the supervisor probes /health)
            assert (await anonymous.get(path)).status_code == 200, path
        wrong = await anonymous.post("/sessions", json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await anonymous.post("/sessions", json={}, headers={"Authorization": f"Bearer {AUTH_TOKEN}"})
        assert ok.status_code == 201
    sid = ok.json()["session_id"]
    assert len(sid) >= 32 and ok.json()["base_url"].endswith(f"/sessions/{sid}/v1")  # 24 random bytes
    unauthorized = openai_client(base_url=ok.json()["base_url"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await unauthorized.models.list()


async def test_a_session_credential_opens_its_own_model_routes_only(random_client, openai_client):
    """Each session's api_key works for its own OpenAI base_url and token-native turn while it is active;
    on another session, the admin routes or once finished it is refused (401)."""
    mine, other = await random_client.create(), await random_client.create()
    sid, key = mine["session_id"], mine["api_key"]
    assert key and other["api_key"] and key != other["api_key"] and AUTH_TOKEN not in (key, other["api_key"])
    client = openai_client(base_url=mine["base_url"], api_key=key, max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == ["asyncrl"]
    reply = await client.chat.completions.create(model="asyncrl", messages=USER, max_tokens=2)
    assert reply.usage.completion_tokens >= 1
    as_session = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=random_client.url, headers=as_session) as http:
        turn = await http.post(f"/sessions/{sid}/generate",
                               json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
        assert turn.status_code == 200, turn.text
        by_header = await http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                                    json={"messages": USER, "max_tokens": 1})
        assert by_header.status_code == 200, by_header.text
        osid = other["session_id"]
        refused = [("POST", f"/sessions/{osid}/v1/chat/completions"), ("POST", f"/sessions/{osid}/generate"),
                   ("GET", f"/sessions/{osid}/v1/models"), ("POST", f"/sessions/{sid}/finish"),
                   ("GET", f"/sessions/{sid}"), ("DELETE", f"/sessions/{sid}"), ("POST", "/sessions"),
                   ("GET", "/engines"), ("POST", "/engines"), ("GET", "/v1/models"), ("GET", "/server_info")]
        for method, path in refused:
            r = await http.request(method, path, json={"messages": USER, "input_ids": [5]})
            assert r.status_code == 401, (method, path, r.text)
        header_other = await http.post("/v1/chat/completions", headers={"X-Session-Id": osid}, json={"messages": USER})
        assert header_other.status_code == 401
        await random_client.finish(sid, reward=1.0)
        after = await http.post(f"/sessions/{sid}/generate", json={"input_ids": [5]})
        assert after.status_code == 401, after.text


async def test_openapi_publishes_every_request_body(scripted_gateway):
    async with httpx.AsyncClient(base_url=scripted_gateway.url) as http:
        openapi = (await http.get("/openapi.json")).json()
    assert unpublished_bodies(openapi) == []
    chat = openapi["paths"]["/sessions/{sid}/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "messages" in chat["schema"]["required"] and "$ref" not in str(chat)  # self-contained


async def test_concurrent_turns_of_one_session_apply_in_order(scripted_client, openai_client):
    session = await scripted_client.create()
    client = openai_client(base_url=session["base_url"], api_key="unused")
    await asyncio.gather(*(client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=4)
                           for _ in range(3)))
    record = await scripted_client.record(session["session_id"])
    # The same first message three times: the second and third are edits of history (new segments).
    assert [len(s["turns"]) for s in record["segments"]] == [1, 1, 1]


async def test_samples_count_the_tool_calls_parsed_and_those_that_did_not_parse(scripted_client, openai_client,
                                                                                 store, template):
    """A reply whose tool call parses counts one call; one cut by max_tokens inside its call (the call stays
    in the content as text) counts one parse failure (the trainer's agent metrics read both)."""
    from tests.gateway.scripted import reply_ids

    session = await scripted_client.create(sampling={"allow_truncation": True})
    client = openai_client(base_url=session["base_url"], api_key="unused")
    whole = await client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, temperature=0)
    call = whole.choices[0].message
    cut_at = reply_ids(template).index(template.tokenizer.token_id("</tool_call>"))  # before the call closes
    cut = await client.chat.completions.create(model="asyncrl", messages=USER + [
        call.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "a"}],
        tools=TOOLS, temperature=0, max_tokens=cut_at)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert "<tool_call>" in cut.choices[0].message.content
    finished = await scripted_client.finish(session["session_id"], reward=1.0)
    [sample] = await store.get_samples(finished["sample_refs"])
    assert (sample.metadata["tool_calls"], sample.metadata["tool_call_parse_failures"]) == (1, 1)
