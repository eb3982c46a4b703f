"""Streaming snapshots built incrementally (rollout/response.py) against the from-scratch body."""

from __future__ import annotations

import random

from asyncrl.protocols.engine import GenerateItem, SamplingParams
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
