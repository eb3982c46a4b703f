"""Streamed text is the reply's text: a token holding part of a UTF-8 character (byte-level BPE) is held back
until the character is complete, so no delta carries '\\ufffd' and the deltas add up to the plain reply.
The scripted reply (tests/gateway/scripted.py) has a character split into three byte tokens in its
reasoning and one split into two in its content."""

import json

import pytest

from asyncrl.protocols.gateway import ChatCompletionRequest
from gateway.openai_api import ChatReply
from tests.gateway.scripted import CONTENT, REASONING, TOOLS, reply_ids

USER = [{"role": "user", "content": "List the files."}]
FIELDS = ("reasoning_content", "content")


def streamed(template, request, ids) -> list[dict]:
    """The deltas of a reply whose tokens arrive one at a time, then the final call."""
    reply = ChatReply(template, request, 0)
    deltas = [d for k in range(1, len(ids) + 1) for d in reply.deltas(ids[:k], final=False)]
    return deltas + reply.deltas(ids, final=True)


def joined(deltas, field) -> str:
    return "".join(d.get(field, "") for d in deltas)


def test_the_scripted_reply_splits_characters_mid_stream(template):
    """What the tests below rely on: some prefixes of the reply decode to a partial character."""
    ids = reply_ids(template)
    partial = [k for k in range(1, len(ids)) if template.tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert len(partial) == 3  # two after the first and second byte of '->', one after the first of 'e'
    assert "\ufffd" not in template.tokenizer.decode(ids)


@pytest.mark.parametrize("stop", [None, ["zz"], ["\u00e9:"]])
def test_deltas_hold_back_partial_characters_and_add_up_to_the_message(template, stop):
    ids = reply_ids(template)
    request = ChatCompletionRequest(messages=USER, tools=TOOLS, stop=stop)
    deltas = streamed(template, request, ids)
    assert not [d for d in deltas for f in FIELDS if "\ufffd" in d.get(f, "")]
    message = ChatReply(template, request, 0).message(ids)
    assert joined(deltas, "reasoning_content") == message["reasoning_content"] == REASONING
    assert joined(deltas, "content") == (message["content"] or "")
    assert message["content"] == (CONTENT if stop != ["\u00e9:"] else "Listing ")
    assert len([d for d in deltas if "content" in d]) > 1, "the content streamed in several deltas"


def test_a_reply_cut_inside_a_character_gets_its_rest_at_the_end(template):
    """max_tokens can end a reply after the first byte of a character: the text is what the tokens decode to
    ('\\ufffd' last), in the message and in the deltas, of which only the final one carries it."""
    ids = reply_ids(template)
    cut = next(k for k in range(1, len(ids)) if template.tokenizer.decode(ids[:k]).endswith("Listing \ufffd"))
    request = ChatCompletionRequest(messages=USER, tools=TOOLS)
    deltas = streamed(template, request, ids[:cut])
    message = ChatReply(template, request, 0).message(ids[:cut])
    assert message["content"] == "Listing \ufffd" == joined(deltas, "content")
    assert "\ufffd" not in joined(deltas[:-1], "content") and deltas[-1] == {"content": "\ufffd"}


async def test_a_streamed_reply_never_carries_a_partial_character(scripted_client):
    """Through the gateway and the scripted engine (an event per token, unless the engine merges queued ones:
    the tests above are the deterministic ones): streamed deltas have no '\\ufffd', add up to the plain reply
    of the same turn, and the session records that text."""
    texts = {}
    for stream in (False, True):
        session = await scripted_client.create()
        r = await scripted_client.http.post(f"/sessions/{session['session_id']}/v1/chat/completions",
                                            json={"messages": USER, "tools": TOOLS, "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            assert not [d for d in deltas for f in FIELDS if "\ufffd" in (d.get(f) or "")], deltas
            texts[stream] = {f: joined(deltas, f) for f in FIELDS}
        else:
            message = r.json()["choices"][0]["message"]
            texts[stream] = {f: message.get(f) or "" for f in FIELDS}
        [segment] = (await scripted_client.record(session["session_id"]))["segments"]
        recorded = segment["messages"][-1]
        assert (recorded["content"], recorded["reasoning_content"]) == (CONTENT, REASONING)
    assert texts[True] == texts[False] == {"content": CONTENT, "reasoning_content": REASONING}
