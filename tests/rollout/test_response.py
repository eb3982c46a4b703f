"""Streaming snapshots built incrementally (rollout/response.py) against the from-scratch body."""

from __future__ import annotations

import random

from asyncrl.engine_response import StreamAccumulator
from asyncrl.protocols.engine import GenerateItem, GenerateResponse, SamplingParams
from asyncrl.tokenizer import load_tokenizer
from rollout.request import Req
from rollout.response import StreamView, response_body


class CountingTokenizer:
    """The builtin tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self) -> None:
        self.inner, self.decoded = load_tokenizer("builtin:tiny"), 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def streamed_request(length: int, top: int = 0) -> Req:
    item = GenerateItem(rid="r", input_ids=[1006, 5], stream=True, return_logprob=True, logprob_start_len=0,
                        top_logprobs_num=top, sampling=SamplingParams(max_new_tokens=length, ignore_eos=True))
    return Req(item=item, prompt=[1006, 5], seed=0, stop_ids=frozenset(), on_update=lambda r: None,
               input_logprobs=[None, -1.5])


def test_snapshots_equal_the_from_scratch_body_and_cost_linear_decoding():
    """Every snapshot carries what a from-scratch body of its tokens would (its text without trailing
    replacement characters), and a 2,000-token stream decodes O(n) token ids in all, not O(n^2)."""
    rng, tokenizer = random.Random(0), CountingTokenizer()
    req = streamed_request(2000, top=2)
    view = StreamView(req, tokenizer)
    for n in range(1, 2001):
        req.append_token(rng.randrange(0, 1000), -rng.random(), "0" if n <= 700 else "1",
                         [(-0.1, 7), (-0.2, 9)])
        if n % 3 and n < 2000:  # updates arrive in uneven batches
            continue
        view.advance(n)
        snapshot = response_body(req, tokenizer, "1", view)
        assert snapshot["text"] == tokenizer.inner.decode(req.output_ids[:n]).rstrip("\ufffd")
    decoded_while_streaming = tokenizer.decoded
    req.finish_reason = {"type": "length", "length": 2000}
    final = response_body(req, tokenizer.inner, "1")
    assert snapshot["output_ids"] == final["output_ids"] and snapshot["text"] == final["text"].rstrip("\ufffd")
    for key in ("weight_versions", "output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
        assert snapshot["meta_info"][key] == final["meta_info"][key], key
    assert final["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 700},
                                                     {"version": "1", "start": 700, "end": 2000}]
    assert decoded_while_streaming < 20 * 2000  # from scratch: ~0.5 * 667 * 2000 = 667k ids


def test_incremental_events_carry_only_new_output_and_add_up_to_the_final_body():
    """--incremental-streaming-output: each delta holds the tokens, text, log-prob entries and spans since
    the previous event; StreamAccumulator (what EngineClient reads streams with) rebuilds from them the
    cumulative snapshots and, at the end, exactly the final body."""
    rng, tokenizer = random.Random(1), load_tokenizer("builtin:tiny")
    req = streamed_request(300, top=2)
    view, reader = StreamView(req, tokenizer), StreamAccumulator()
    for n in range(1, 301):
        req.append_token(rng.randrange(0, 1000), -rng.random(), "0" if n <= 120 else "1", [(-0.1, 7), (-0.2, 9)])
        if n % 7 and n < 300:
            continue
        if n == 300:
            req.finish_reason = {"type": "length", "length": 300}
            event = view.delta(response_body(req, tokenizer, "1"))
        else:
            view.advance(n)
            event = view.delta(response_body(req, tokenizer, "1", view))
        first_new = n - len(event["output_ids"])
        assert event["output_ids"] == req.output_ids[first_new:n] and event["meta_info"]["completion_tokens"] == n
        assert len(event["meta_info"]["output_token_logprobs"]) == len(event["output_ids"])
        assert all(first_new <= s["start"] < s["end"] <= n for s in event["meta_info"]["weight_versions"])
        snapshot = reader.add(event)
        assert snapshot.output_ids == req.output_ids[:n]
    final = GenerateResponse.model_validate(response_body(req, tokenizer, "1"))
    assert snapshot.text == final.text and snapshot.output_ids == final.output_ids
    for key in ("weight_versions", "output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        assert getattr(snapshot.meta_info, key) == getattr(final.meta_info, key), key
    assert [(s.start, s.end) for s in snapshot.meta_info.weight_versions] == [(0, 120), (120, 300)]


def test_a_trimmed_stop_string_cannot_be_taken_back_from_an_incremental_stream():
    tokenizer = load_tokenizer("builtin:tiny")
    req = streamed_request(8)
    req.item.sampling.stop = ["lo"]
    view = StreamView(req, tokenizer)
    for token in tokenizer.encode("hello"):
        req.append_token(token, -0.5, "0", None)
    view.advance(len(req.output_ids))
    streamed = view.delta(response_body(req, tokenizer, "0", view))["text"]
    req.finish_reason, req.matched_stop_text = {"type": "stop", "matched": "lo"}, "lo"
    last = view.delta(response_body(req, tokenizer, "0"))
    assert streamed == "hello" and last["text"] == "" and last["output_ids"] == []
