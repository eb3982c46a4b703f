"""Every request field is honoured or refused with a 400 naming it, for chat, streamed chat and token-native
turns, through a real gateway and engine (the scripted model, tests/gateway/scripted.py); a refused turn
leaves the session untouched. Fields that change the sampling distribution are refused (the trainer would
not reproduce the recorded log-probs); tool_choice and parallel_tool_calls are honoured, without changing
the distribution; logprobs / top_logprobs are honoured streamed or not."""

import json
import math

import openai
import pytest

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.protocols.gateway import ChatCompletionRequest
from asyncrl.tokenizer import load_tokenizer
from gateway.openai_api import tool_plan
from tests.gateway.checks import assert_ledger_consistent, assert_teacher_forced
from tests.gateway.conftest import error_message
from tests.gateway.scripted import COMMAND, CONTENT, REASONING, TOOLS

USER = [{"role": "user", "content": "List the files."}]
GREEDY = {"messages": USER, "tools": TOOLS, "temperature": 0}


def chat_path(session) -> str:
    return f"/sessions/{session['session_id']}/v1/chat/completions"


async def assert_refused(client, session, body: dict, *names: str) -> None:
    """Plain and streamed: a 400 whose message names each of `names`."""
    for stream in (False, True):
        r = await client.http.post(chat_path(session), json={**body, "stream": stream})
        assert r.status_code == 400, (stream, r.text)
        assert r.headers["content-type"].startswith("application/json"), "refused before any stream started"
        for name in names:
            assert name in error_message(r), (stream, name, error_message(r))


async def assert_untouched_then_serves(client, session) -> dict:
    """The refusals left no trace, and the session still serves a turn."""
    assert (await client.record(session["session_id"]))["segments"] == []
    r = await client.http.post(chat_path(session), json=GREEDY)
    assert r.status_code == 200, r.text
    [segment] = (await client.record(session["session_id"]))["segments"]
    assert len(segment["turns"]) == 1
    return r.json()


# Refused: what changes the sampling distribution ------------------------------------------------------
RESHAPING = [("frequency_penalty", 0.5, "penalty"), ("presence_penalty", -0.5, "penalty"),
             ("repetition_penalty", 1.2, "penalty"), ("logit_bias", {"100": 5.0}, "logit bias"),
             ("response_format", {"type": "json_object"}, "constrained decoding"),
             ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
              "constrained decoding")]


@pytest.mark.parametrize("field,value,why", RESHAPING, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(RESHAPING)])
async def test_a_field_that_changes_the_distribution_is_refused(field, value, why, scripted_client):
    session = await scripted_client.create()
    await assert_refused(scripted_client, session, {**GREEDY, field: value}, field, why, "trainer")
    await assert_untouched_then_serves(scripted_client, session)


NATIVE_RESHAPING = [("frequency_penalty", 0.5), ("presence_penalty", 0.1), ("repetition_penalty", 1.1),
                    ("logit_bias", {"7": -100}), ("json_schema", '{"type": "object"}'), ("regex", "a+"),
                    ("ebnf", 'root ::= "a"'), ("structural_tag", "{}"), ("custom_params", {"k": 1})]


async def test_token_native_refuses_the_same_fields_and_unknown_ones(scripted_client, template):
    session = await scripted_client.create()
    path = f"/sessions/{session['session_id']}/generate"
    prompt = template.render(USER, TOOLS, add_generation_prompt=True)
    for field, value in NATIVE_RESHAPING:
        r = await scripted_client.http.post(path, json={"input_ids": prompt, "sampling_params": {field: value}})
        assert r.status_code == 400 and f"{field}=" in error_message(r) and "trainer" in error_message(r), r.text
    refusals = [({"sampling_params": {"n": 2}}, "n=2"), ({"sampling_params": {"temprature": 0.5}}, "'temprature'"),
                ({"sampling_params": {"stop_regex": "x"}}, "'stop_regex'"), ({"text": "hi"}, "text="),
                ({"rid": "mine"}, "rid="), ({"logprob_start_len": 0}, "logprob_start_len="),
                ({"return_routed_experts": True}, "return_routed_experts="), ({"lora_path": "x"}, "'lora_path'"),
                ({"top_logprobs_num": 2, "return_logprob": False}, "top_logprobs_num=2")]
    for extra, name in refusals:
        r = await scripted_client.http.post(path, json={"input_ids": prompt, **extra})
        assert r.status_code == 400 and name in error_message(r), (extra, r.text)
    assert (await scripted_client.record(session["session_id"]))["segments"] == []
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
               "json_schema": None, "temperature": 0, "max_new_tokens": 4}
    r = await scripted_client.http.post(path, json={"input_ids": prompt, "sampling_params": neutral,
                                                    "rid": None, "logprob_start_len": -1})
    assert r.status_code == 200, r.text
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    assert not set(segment["turns"][0]["sampling"]) & {"frequency_penalty", "logit_bias", "json_schema"}


# Refused: what the gateway cannot honour ------------------------------------------------------------------
UNHONOURED = [
    ("functions", [{"name": "f"}], "tools"), ("function_call", "auto", "tool_choice"),
    ("audio", {"voice": "alloy", "format": "wav"}, "text only"), ("modalities", ["text", "audio"], "text only"),
    ("prediction", {"type": "content", "content": "x"}, "predicted"), ("reasoning_effort", "low", "--no-thinking"),
    ("verbosity", "low", "verbosity"), ("web_search_options", {}, "web search"), ("store", True, "stores no"),
    ("metadata", {"k": "v"}, "stores none"), ("service_tier", "flex", "one service tier"),
    ("prompt_cache_key", "k", "prefix"), ("prompt_cache_retention", "24h", "prefix caches"),
    ("user", "alice", "per-user"), ("safety_identifier", "h", "per-user"),
    ("best_of", 2, "unknown"), ("min_tokens", 3, "unknown"), ("chat_template_kwargs", {"enable_thinking": False}, "unknown"),
    ("tool_choice", "always", "one of none, auto, required"),
    ("tool_choice", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "named function only"),
    ("tool_choice", {"type": "function", "function": {"name": "cat"}}, "not among the tools"),
    ("top_logprobs", 2, "needs logprobs=true"), ("n", 2, "n=1"),
]


@pytest.mark.parametrize("field,value,why", UNHONOURED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(UNHONOURED)])
async def test_a_field_the_gateway_cannot_honour_is_refused(field, value, why, scripted_client):
    session = await scripted_client.create()
    await assert_refused(scripted_client, session, {**GREEDY, field: value}, field, why)
    await assert_untouched_then_serves(scripted_client, session)


async def test_request_shapes_that_cannot_be_honoured_are_refused(scripted_client, scripted_gateway, openai_client):
    session = await scripted_client.create()
    for body, names in [({**GREEDY, "tools": None, "tool_choice": "required"}, ("tool_choice", "needs tools")),
                        ({**GREEDY, "stream_options": {"include_usage": True, "chunk_size": 3}}, ("'chunk_size'",)),
                        ({**GREEDY, "stream_options": {"include_obfuscation": True}}, ("include_obfuscation",))]:
        await assert_refused(scripted_client, session, body, *names)
    plain = await scripted_client.http.post(chat_path(session), json={**GREEDY, "stream_options": {"include_usage": True}})
    assert plain.status_code == 400 and "stream_options: only with stream=true" in error_message(plain)
    # The official client raises the refusal with its message.
    client = openai_client(base_url=session["base_url"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty=0.7"):
        await client.chat.completions.create(model="m", messages=USER, frequency_penalty=0.7)
    with pytest.raises(openai.BadRequestError, match="user='a'"):
        await client.chat.completions.create(model="m", messages=USER, user="a", stream=True)
    await assert_untouched_then_serves(scripted_client, session)


async def test_neutral_values_are_honoured_and_not_sent_to_the_engine(scripted_client):
    session = await scripted_client.create()
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {},
               "response_format": {"type": "text"}, "store": False, "metadata": {}, "service_tier": "auto",
               "modalities": ["text"], "parallel_tool_calls": True, "tool_choice": "auto", "n": 1, "user": None,
               "an_unknown_field_at_null": None, "stream_options": {"include_usage": False}, "stream": True}
    r = await scripted_client.http.post(chat_path(session), json={**GREEDY, **neutral})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    assert segment["messages"][-1]["content"] == CONTENT and segment["messages"][-1]["tool_calls"]
    assert not set(segment["turns"][0]["sampling"]) & {"frequency_penalty", "logit_bias", "response_format"}


# Honoured: tool_choice and parallel_tool_calls --------------------------------------------------------
async def tool_turn(client, session, stream: bool, **fields) -> tuple[dict, dict]:
    """(the assistant message and finish reason as the client saw them, the session's segment)."""
    r = await client.http.post(chat_path(session), json={**GREEDY, "stream": stream, **fields})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        message = {"content": "".join(d["delta"].get("content") or "" for d in deltas) or None,
                   "reasoning_content": "".join(d["delta"].get("reasoning_content") or "" for d in deltas),
                   "tool_calls": [c for d in deltas for c in d["delta"].get("tool_calls") or []] or None}
        finish = [d["finish_reason"] for d in deltas if d["finish_reason"]][-1]
    else:
        choice = r.json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
    [segment] = (await client.record(session["session_id"]))["segments"]
    return {**message, "finish_reason": finish}, segment


def generated(segment) -> list[int]:
    return [t for t, m in zip(segment["tokens"], segment["loss_mask"]) if m]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_required_writes_the_call_opening_after_the_reasoning(stream, scripted_client, template,
                                                                              scripted_model):
    tok = template.tokenizer
    auto = await scripted_client.create()
    auto_message, auto_segment = await tool_turn(scripted_client, auto, stream)
    assert auto_message["content"] == CONTENT  # what the model says unforced: text, then the call
    session = await scripted_client.create()
    message, segment = await tool_turn(scripted_client, session, stream, tool_choice="required")
    assert message["finish_reason"] == "tool_calls" and not message["content"]
    assert message["reasoning_content"] == REASONING
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "bash" and COMMAND in call["function"]["arguments"]
    # The gateway wrote <tool_call> right after the model's </think>: a prompt token (mask 0), the model's
    # own tokens on both sides with their log-probs; the content the model would have written is gone.
    tokens, mask = segment["tokens"], segment["loss_mask"]
    forced_at = tokens.index(tok.token_id("</think>")) + 1
    assert tokens[forced_at] == tok.token_id("<tool_call>") and mask[forced_at] == 0
    assert mask[forced_at - 1] == 1 and mask[forced_at + 1] == 1 and all(mask[forced_at + 1:])
    assert [t["finish_reason"] for t in segment["turns"]] == ["stop", "stop"]
    assert_ledger_consistent(segment)
    assert_teacher_forced(scripted_model, segment)  # log-probs are the model's, in the context it saw
    # The model generated all of its unforced reply but the content and the <tool_call> the gateway wrote.
    assert len(generated(segment)) == len(generated(auto_segment)) - len(tok.encode(CONTENT, allow_special=False)) - 1


async def test_tool_choice_named_writes_the_function_name(scripted_client, template, scripted_model):
    tok = template.tokenizer
    session = await scripted_client.create()
    named = {"type": "function", "function": {"name": "bash"}}
    message, segment = await tool_turn(scripted_client, session, False, tool_choice=named)
    assert message["finish_reason"] == "tool_calls" and not message["content"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["bash"]
    forced = [tok.token_id("<tool_call>"), *tok.encode("bash", allow_special=False)]
    at = segment["tokens"].index(tok.token_id("</think>")) + 1
    assert segment["tokens"][at:at + len(forced)] == forced and segment["loss_mask"][at:at + len(forced)] == [0] * len(forced)
    assert_ledger_consistent(segment)
    assert_teacher_forced(scripted_model, segment)
    # The reply, sent back with the tool's result, extends the same segment.
    call = message["tool_calls"][0]
    follow = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "a.py"}]
    r = await scripted_client.http.post(chat_path(session), json={**GREEDY, "messages": follow})
    assert r.status_code == 200, r.text
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    assert segment["tokens"][at:at + len(forced)] == forced and len(segment["turns"]) == 3


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_none_ends_the_turn_where_a_call_would_open(stream, scripted_client, template):
    tok = template.tokenizer
    session = await scripted_client.create()
    message, segment = await tool_turn(scripted_client, session, stream, tool_choice="none")
    assert message["finish_reason"] == "stop" and not message.get("tool_calls")
    assert message["content"] == CONTENT and message["reasoning_content"] == REASONING
    assert generated(segment)[-1] == tok.token_id("<tool_call>")  # the model's own token, kept as generated
    r = await scripted_client.http.post(chat_path(session), json={**GREEDY, "messages": USER + [
        {"role": "assistant", "content": CONTENT}, {"role": "user", "content": "Go on."}]})
    assert r.status_code == 200, r.text
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    assert len(segment["turns"]) == 2, "the reply sent back extends the segment"
    assert_ledger_consistent(segment)


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_false_ends_the_turn_after_one_call(stream, scripted_client, template):
    tok = template.tokenizer
    session = await scripted_client.create()
    message, segment = await tool_turn(scripted_client, session, stream, parallel_tool_calls=False)
    assert message["finish_reason"] == "tool_calls" and len(message["tool_calls"]) == 1
    assert generated(segment)[-1] == tok.token_id("</tool_call>")  # unforced, the model goes on to <|observation|>
    call = message["tool_calls"][0]
    follow = USER + [{"role": "assistant", "content": CONTENT, "reasoning_content": REASONING, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "a.py"}]
    r = await scripted_client.http.post(chat_path(session), json={**GREEDY, "messages": follow})
    assert r.status_code == 200, r.text
    [segment] = (await scripted_client.record(session["session_id"]))["segments"]
    end = segment["turns"][0]["prompt_len"] + segment["turns"][0]["output_len"]
    assert segment["tokens"][end] == tok.token_id("<|observation|>") and segment["loss_mask"][end] == 0
    assert segment["tokens"][:segment["turns"][1]["prompt_len"]] == template.render(
        follow, TOOLS, add_generation_prompt=True), "the template's own rendering: the model saw a canonical turn"
    assert_ledger_consistent(segment)


def test_without_thinking_the_forced_opening_comes_first():
    template = GlmChatTemplate(load_tokenizer("builtin:tiny"), thinking=False)
    plan = tool_plan(template, ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required"))
    assert plan.forced == (template.tokenizer.token_id("<tool_call>"),) and plan.forced_after is None
    assert tool_plan(template, ChatCompletionRequest(messages=USER, tools=TOOLS)).forced == ()


# Honoured: logprobs and top_logprobs, streamed or not ------------------------------------------------
async def test_logprobs_and_top_logprobs_streamed_and_not(scripted_client, openai_client):
    replies = []
    for stream in (False, True):
        session = await scripted_client.create()
        client = openai_client(base_url=session["base_url"])
        kwargs = dict(model="m", messages=USER, tools=TOOLS, temperature=0, logprobs=True, top_logprobs=3)
        if stream:
            chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
            entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            entries = (await client.chat.completions.create(**kwargs)).choices[0].logprobs.content
        [segment] = (await scripted_client.record(session["session_id"]))["segments"]
        recorded = [lp for lp, m in zip(segment["rollout_logprobs"], segment["loss_mask"]) if m]
        assert [e.logprob for e in entries] == pytest.approx(recorded, abs=1e-6)
        for e in entries:  # greedy: the sampled token is the most likely one
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
            assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(b for e in entries for b in e.bytes).decode().startswith(REASONING)
        replies.append([(e.token, e.logprob) for e in entries])
    assert replies[0] == replies[1]


async def test_token_native_top_logprobs_and_text_options(scripted_client, template):
    tok = template.tokenizer
    prompt = template.render(USER, TOOLS, add_generation_prompt=True)
    stops = list(template.stop_token_ids)

    async def generate(sampling=None, **fields):
        session = await scripted_client.create()
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "stop_token_ids": stops, **(sampling or {})},
                **fields}
        r = await scripted_client.http.post(f"/sessions/{session['session_id']}/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    plain = await generate()
    assert plain["text"] == tok.decode(plain["output_ids"]) and plain["text"].endswith("<|observation|>")
    top = await generate(top_logprobs_num=2, return_text_in_logprobs=True)
    rows = top["meta_info"]["output_top_logprobs"]
    assert len(rows) == len(top["output_ids"]) and all(len(row) == 2 for row in rows)
    for (lp, token_id, text), row in zip(top["meta_info"]["output_token_logprobs"], rows):
        assert row[0][1] == token_id and math.isclose(row[0][0], lp, abs_tol=1e-6) and text == tok.decode([token_id])
    skipped = await generate(sampling={"skip_special_tokens": True})
    assert skipped["output_ids"] == plain["output_ids"]
    assert skipped["text"] == tok.decode(plain["output_ids"], skip_special_tokens=True) != plain["text"]
    trimmed = await generate(sampling={"no_stop_trim": False})
    assert trimmed["text"] == tok.decode(plain["output_ids"][:-1]) and trimmed["output_ids"] == plain["output_ids"]
