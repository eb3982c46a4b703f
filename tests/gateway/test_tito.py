"""Token-in-token-out through real gateways and engines: the record is exactly what the model saw
and said, the loss mask marks exactly its tokens, the log-probs are the model's (docs/protocols/gateway.md,
"Token-in-token-out rules")."""

import numpy as np

from tests.gateway.checks import assert_engine_replays, assert_ledger_consistent, assert_teacher_forced
from tests.gateway.conftest import AUTH_TOKEN
from tests.gateway.scripted import COMMAND, CONTENT, REASONING, TOOLS

SEED = 1234


def sampling(template, max_tokens):
    """The engine sampling params the gateway sends for chat turn k (session seed SEED)."""
    return lambda k: {"temperature": 1.0, "max_new_tokens": max_tokens[k], "sampling_seed": SEED + k,
                      "stop_token_ids": list(template.stop_token_ids)}


async def test_scripted_tool_conversation_is_recorded_token_exact(scripted_client, scripted_engine, template,
                                                                  scripted_model, store, openai_client):
    session = await scripted_client.create(group_id="g-tools", task_id="t-1", env="terminal",
                                           sampling={"sampling_seed": SEED, "temperature": 1.0}, metadata={"k": 1})
    client = openai_client(base_url=session["base_url"], api_key="unused")
    messages = [{"role": "system", "content": "You run shell commands."}, {"role": "user", "content": "List the files."}]
    max_tokens = [64, 64, 3, 64]
    follow_ups = [[{"role": "tool", "content": "a.py b.py"}],
                  [{"role": "tool", "content": "done"}, {"role": "user", "content": "Summarise."}],
                  [{"role": "user", "content": "Go on."}], []]
    replies = []
    for k, limit in enumerate(max_tokens):
        reply = await client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS, max_tokens=limit)
        replies.append(reply)
        message = reply.choices[0].message
        messages += [message.model_dump(exclude_none=True), *follow_ups[k]]
        if follow_ups[k] and follow_ups[k][0]["role"] == "tool":
            follow_ups[k][0]["tool_call_id"] = message.tool_calls[0].id
    tool_turn = replies[0].choices[0]
    assert tool_turn.finish_reason == "tool_calls" and tool_turn.message.content == CONTENT
    assert tool_turn.message.tool_calls[0].function.name == "bash"
    assert tool_turn.message.tool_calls[0].function.arguments == f'{{"command": "{COMMAND}"}}'
    assert tool_turn.message.model_extra["reasoning_content"] == REASONING
    assert replies[1].choices[0].message.tool_calls[0].id != tool_turn.message.tool_calls[0].id
    assert replies[2].choices[0].finish_reason == "length" and replies[2].usage.completion_tokens == 3
    assert replies[3].choices[0].finish_reason == "tool_calls"

    record = await scripted_client.record(session["session_id"])
    assert record["status"] == "active" and len(record["segments"]) == 1
    segment = record["segments"][0]
    assert [t["output_len"] for t in segment["turns"]] == [r.usage.completion_tokens for r in replies]
    assert [t["prompt_len"] for t in segment["turns"]] == [r.usage.prompt_tokens for r in replies]
    assert_ledger_consistent(segment)
    # Turn 0's prompt is the full render; turn 1 adds only the tool result (its <|observation|> is the
    # model's own stop token) and the generation prompt; the conversation so far renders canonically.
    turns, tokens = segment["turns"], segment["tokens"]
    assert tokens[:turns[0]["prompt_len"]] == template.render(messages[:2], TOOLS, add_generation_prompt=True)
    end_0 = turns[0]["prompt_len"] + turns[0]["output_len"]
    assert tokens[end_0:turns[1]["prompt_len"]] == template.render_incremental(messages[:3], tokens[:end_0], messages[3:4])
    assert tokens[:turns[1]["prompt_len"]] == template.render(messages[:4], TOOLS, add_generation_prompt=True)
    await assert_engine_replays(scripted_engine.url, segment, sampling(template, max_tokens))
    assert_teacher_forced(scripted_model, segment)

    finished = await scripted_client.finish(session["session_id"], reward=1.0, info={"passed": True})
    [sample] = await store.get_samples(finished["sample_refs"])
    assert sample.session_id == session["session_id"] and sample.group_id == "g-tools" and sample.reward == 1.0
    assert sample.tokens.tolist() == tokens and sample.loss_mask.tolist() == segment["loss_mask"]
    assert np.array_equal(sample.rollout_logprobs, np.array(segment["rollout_logprobs"], dtype=np.float32))
    assert sample.weight_versions.tolist() == segment["weight_versions"] and sample.num_turns == 4
    assert sample.engines == [scripted_engine.url] and sample.metadata["info"] == {"passed": True}


async def test_sampled_conversation_logprobs_equal_teacher_forcing(random_client, random_engine, template,
                                                                   reference_model, openai_client):
    session = await random_client.create(sampling={"sampling_seed": SEED})
    client = openai_client(base_url=session["base_url"], api_key=AUTH_TOKEN)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for k in range(3):
        reply = await client.chat.completions.create(model="asyncrl", messages=messages, max_tokens=24,
                                                     temperature=1.0, tools=TOOLS)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "x", "content": f"result {k}"}]
    [segment] = (await random_client.record(session["session_id"]))["segments"]
    assert len(segment["turns"]) == 3
    assert_ledger_consistent(segment)
    await assert_engine_replays(random_engine.url, segment, sampling(template, [24, 24, 24]))
    assert_teacher_forced(reference_model, segment)


async def test_edited_history_opens_a_new_segment(random_client, template, store, openai_client):
    session = await random_client.create()
    client = openai_client(base_url=session["base_url"], api_key=AUTH_TOKEN)
    messages = [{"role": "user", "content": "Hello"}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    edited = [{"role": "user", "content": "Hello, edited"}]  # context management rewrote history
    await client.chat.completions.create(model="m", messages=edited, max_tokens=4)
    record = await random_client.record(session["session_id"])
    assert [len(s["turns"]) for s in record["segments"]] == [2, 1]
    assert record["segments"][1]["tokens"][:-4] == template.render(edited, add_generation_prompt=True)
    for segment in record["segments"]:
        assert_ledger_consistent(segment)
    finished = await random_client.finish(session["session_id"], reward=0.5)
    samples = await store.get_samples(finished["sample_refs"])
    assert [s.sample_id for s in samples] == [f"{session['session_id']}-0", f"{session['session_id']}-1"]
    assert [s.metadata["segment"] for s in samples] == [0, 1]


async def test_token_native_turns_append_input_ids(random_client, random_engine, template, reference_model):
    session = await random_client.create(sampling={"sampling_seed": 7})
    sid = session["session_id"]
    first_ids = template.render([{"role": "user", "content": "Count."}], add_generation_prompt=True)
    params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    r1 = await random_client.http.post(f"/sessions/{sid}/generate", json={"input_ids": first_ids,
                                                                          "sampling_params": params})
    assert r1.status_code == 200, r1.text
    more = [1011, 72, 101, 1012, 1014]
    r2 = await random_client.http.post(f"/sessions/{sid}/generate", json={"input_ids": more, "sampling_params": params})
    out1, out2 = r1.json(), r2.json()
    assert len(out1["output_ids"]) == 8 and out1["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert [e[1] for e in out2["meta_info"]["output_token_logprobs"]] == out2["output_ids"]
    [segment] = (await random_client.record(sid))["segments"]
    assert segment["tokens"] == first_ids + out1["output_ids"] + more + out2["output_ids"]
    assert segment["messages"] is None
    assert_ledger_consistent(segment)
    await assert_engine_replays(random_engine.url, segment, lambda k: {**params, "sampling_seed": 7 + k})
    assert_teacher_forced(reference_model, segment)
