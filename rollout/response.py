"""SGLang's /generate response body of a request: the final one, and the snapshots of a stream.

A stream sends cumulative snapshots (engine.md). Rebuilt from scratch, every snapshot re-decodes the
whole text, re-scans every token's weight version and rebuilds every log-prob entry: quadratic in the
output length (a 2,048-token stream ran at 0.57x the rate of the same request unstreamed). `StreamView`
extends those pieces by the new tokens only. The final body is always built from scratch: exact text,
stop-string trimming, finish reason. With SGLang's --incremental-streaming-output, `StreamView.delta`
cuts each body down to what the stream has not sent yet, so an event's size no longer grows either.

Both run on the HTTP event loop while the engine thread may append tokens. They read the first `n`
entries of Req's output lists, which only grow, so a snapshot never sees a half-written token.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Iterable, Optional

from asyncrl.tokenizer import Tokenizer
from asyncrl.version_spans import version_spans
from rollout.request import Req


class StreamView:
    """The pieces of a streamed request's snapshots, extended token by token (`advance`)."""

    def __init__(self, req: Req, tokenizer: Tokenizer) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.count = 0
        """Output tokens folded in so far."""
        self.text = ""
        """Text of the folded tokens without trailing replacement characters (a partial UTF-8 sequence at
        the end shows once the token that completes it arrives)."""
        self._settled = ""  # text of the tokens before the window's read offset: final
        self._text_window = (0, 0)  # (prefix, read) token offsets of incremental detokenization
        self.spans: list[dict[str, Any]] = []
        self.logprobs: list[list[Any]] = []
        self.top_logprobs: list[list[list[Any]]] = []
        self._input: tuple[int, list, list] = (-1, [], [])  # (len(req.input_logprobs), entries, top entries)
        self._sent: tuple[int, str] = (0, "")  # (output tokens, text) earlier delta events carried

    def advance(self, count: int) -> None:
        """Fold output tokens [self.count, count) in, text included: O(new tokens)."""
        self.fold(count)
        self._advance_text(self.req.output_ids[:count])

    def fold(self, count: int) -> None:
        """Extend the spans and log-prob entries to the first `count` output tokens (not the text)."""
        req, item, start = self.req, self.req.item, self.count
        version_spans(req.output_versions[start:count], self.spans, offset=start)
        if item.return_logprob:
            with_text = item.return_text_in_logprobs
            self.logprobs += entries(zip(req.output_logprobs[start:count], req.output_ids[start:count]),
                                     self.tokenizer, with_text)
            if item.top_logprobs_num > 0:
                self.top_logprobs += [entries(top, self.tokenizer, with_text)
                                      for top in req.output_top_logprobs[start:count]]
        self.count = count

    def _advance_text(self, ids: list[int]) -> None:
        """Incremental detokenization (as SGLang's and vLLM's): decode the unsettled tokens with one settled
        token run of left context, and settle them once they end on a complete character."""
        skip = self.req.item.sampling.skip_special_tokens
        prefix, read = self._text_window
        known = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        window = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if window.endswith("\ufffd"):  # maybe a character still being completed: show up to it
            self.text = self._settled + window.rstrip("\ufffd")[len(known):]
            return
        self._settled += window[len(known):]
        self._text_window = (read, len(ids))
        self.text = self._settled

    def delta(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's incremental event: `body` (a snapshot or the final body) less what earlier deltas sent.

        output_ids, text, output log-prob entries and weight-version spans (absolute positions) cover the
        new tokens only; the rest of meta_info is as in a cumulative event (completion_tokens counts all
        tokens so far, as SGLang's does). Text the final body trims away (a stop string streamed before
        it was complete) cannot be taken back: its delta is then empty."""
        tokens, text = self._sent
        meta = dict(body["meta_info"])
        for key in ("output_token_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = meta[key][tokens:]
        meta["weight_versions"] = [{**span, "start": max(span["start"], tokens)}
                                   for span in meta["weight_versions"] if span["end"] > tokens]
        full_text = body["text"]
        self._sent = (len(body["output_ids"]), full_text)
        new_text = full_text[len(text):] if full_text.startswith(text) else ""
        return {"output_ids": body["output_ids"][tokens:], "meta_info": meta, "text": new_text}

    def input_logprobs(self) -> tuple[list, list]:
        """Prompt entries, rebuilt only when the engine recorded more of them."""
        recorded = len(self.req.input_logprobs)
        if self._input[0] != recorded:
            self._input = (recorded, *_input_entries(self.req, self.tokenizer))
        return self._input[1], self._input[2]


def response_body(req: Req, tokenizer: Tokenizer, current_version: str, view: Optional[StreamView] = None
                  ) -> dict[str, Any]:
    """The /generate response: of the finished request, or (view) a snapshot of its first view.count tokens."""
    item = req.item
    if view is None:  # the finished request: every token folded at once, the exact (stop-trimmed) text
        view = StreamView(req, tokenizer)
        view.fold(len(req.output_ids))
        finish, text = req.finish_reason, final_text(req, tokenizer)
    else:
        finish, text = None, view.text
    n, spans = view.count, view.spans
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": finish, "prompt_tokens": len(req.prompt),
        "completion_tokens": n, "cached_tokens": req.cached_tokens,
        "weight_version": spans[-1]["version"] if spans else current_version,
        "weight_versions": spans, "e2e_latency": time.monotonic() - req.created,
    }
    if req.spec_verify_ct:  # SGLang's: accept length = completion_tokens / spec_verify_ct
        meta["spec_verify_ct"] = req.spec_verify_ct
    if item.return_logprob:
        input_part, input_top = view.input_logprobs()
        meta["output_token_logprobs"], meta["input_token_logprobs"] = view.logprobs, input_part
        # SGLang's: entries so far, also in an incremental event (whose list has the new ones only); SGLang's
        # streamed OpenAI layer reads it to slice the new entries off
        meta["output_token_logprobs_length"] = len(view.logprobs)
        if item.top_logprobs_num > 0:
            meta["output_top_logprobs"], meta["input_top_logprobs"] = view.top_logprobs, input_top
    if item.return_routed_experts and finish is not None:  # as SGLang: on the final body only
        routed = req.routed_experts.numpy() if req.routed_experts is not None else b""
        meta["routed_experts"] = base64.b64encode(routed).decode()  # int32 row-major, like SGLang's
    return {"output_ids": req.output_ids[:n], "meta_info": meta, "text": text}


def final_text(req: Req, tokenizer: Tokenizer) -> str:
    """The finished request's text: a matched stop token or stop string is cut unless no_stop_trim."""
    finish, sampling = req.finish_reason, req.item.sampling
    text_ids = req.output_ids
    if finish and finish["type"] == "stop" and req.matched_stop_text is None and not sampling.no_stop_trim and text_ids:
        text_ids = text_ids[:-1]
    text = tokenizer.decode(text_ids, skip_special_tokens=sampling.skip_special_tokens)
    if finish and req.matched_stop_text and not sampling.no_stop_trim and req.matched_stop_text in text:
        text = text[:text.find(req.matched_stop_text)]
    return text


def entries(pairs: Iterable, tokenizer: Tokenizer, with_text: bool) -> list[list[Any]]:
    """SGLang's log-prob entries [logprob, token_id, text or None]."""
    return [[lp, tid, tokenizer.decode([tid]) if with_text else None] for lp, tid in pairs]


def _input_entries(req: Req, tokenizer: Tokenizer) -> tuple[list, list]:
    item, with_text = req.item, req.item.return_text_in_logprobs
    start = max(item.logprob_start_len, 0)
    prompt_part = list(zip(req.input_logprobs, req.prompt[start:])) if item.logprob_start_len >= 0 else []
    top = ([None if t is None else entries(t, tokenizer, with_text) for t in req.input_top_logprobs]
           if item.top_logprobs_num > 0 else [])
    return entries(prompt_part, tokenizer, with_text), top
