"""One turn of a session through each API: OpenAI chat (plain and streamed) and token-native.

Every turn holds the session's lock from planning to commit, so turns of a session apply in order.
A client that disconnects mid-turn gets its engine call aborted; the turn is not committed and
the session stays as it was before the turn.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Optional

import orjson
from starlette.requests import Request

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.protocols.gateway import ChatCompletionRequest, SessionGenerateRequest
from asyncrl.tokenizer import Tokenizer
from asyncrl.version_spans import version_spans
from gateway.errors import ClientGoneError, NoEngineError, SessionClosedError
from gateway.generation import TurnRunner
from gateway.metrics import GatewayMetrics
from gateway.openai_api import (ChatReply, ToolPlan, chat_chunk, chat_completion, chat_sampling, finish_reason,
                                token_logprobs, tool_plan, turn_sampling, usage)
from gateway.sampling import check_sampling
from gateway.session_ledger import Session, Turn

OFFLOAD_CHARS = 64 * 1024
"""Chat messages longer than this (characters) are rendered and tokenized in a thread."""


class Turns:
    def __init__(self, template: GlmChatTemplate, runner: TurnRunner, metrics: GatewayMetrics, model_name: str,
                 spawn: Callable) -> None:
        self.template = template
        self.runner = runner
        self.metrics = metrics
        self.model_name = model_name
        self.spawn = spawn

    # OpenAI chat -------------------------------------------------------------------------------------
    async def plan_chat(self, session: Session, request: ChatCompletionRequest) -> tuple[Turn, ToolPlan]:
        """The turn a chat request makes: rendered and tokenized in a thread when its messages are long
        (megabytes take seconds, and the event loop serves every other session meanwhile)."""
        if _message_chars(request.messages) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self._plan_chat, session, request)
        return self._plan_chat(session, request)

    def _plan_chat(self, session: Session, request: ChatCompletionRequest) -> tuple[Turn, ToolPlan]:
        plan = tool_plan(self.template, request)
        turn = session.chat_turn(self.template, request.messages, request.tools)
        turn.forced, turn.forced_after = list(plan.forced), plan.forced_after
        turn.top_logprobs = (request.top_logprobs or 0) if request.logprobs else 0
        return turn, plan

    def chat_sampling(self, session: Session, request: ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any]:
        """The turn's engine sampling params; SamplingPolicyError (400) if the session's policy refuses them."""
        stops = [*self.template.stop_token_ids, *plan.stops]
        return check_sampling(chat_sampling(request, session.sampling, session.num_turns, stops),
                              session.sampling.allow_truncation)

    def _logprobs(self, turn: Turn) -> dict[str, Any]:
        return token_logprobs(self.template.tokenizer, turn.generated_ids, turn.output_logprobs,
                              turn.output_top_logprobs if turn.top_logprobs else ())

    async def chat(self, session: Session, request: ChatCompletionRequest, client: Request
                   ) -> tuple[dict[str, Any], float]:
        """-> the chat.completion and the engine's own latency of the turn (seconds)."""
        started = time.perf_counter()
        async with session.lock:
            session.ensure_open()
            turn, plan = await self.plan_chat(session, request)
            reply = ChatReply(self.template, request, session.num_turns, plan)
            await self._run_watching_client(session, turn, self.chat_sampling(session, request, plan), client)
            message = reply.message(turn.output_ids)
            session.commit(turn, message, reply.parse_failures(turn.output_ids, message))
        self._count(session, turn, "chat", started)
        logprobs = self._logprobs(turn) if request.logprobs else None
        completion = chat_completion(_completion_id(), self.model_name, message,
                                     finish_reason(message, turn.finish_reason), _usage(turn), logprobs)
        return completion, turn.engine_latency_s

    async def chat_stream(self, session: Session, request: ChatCompletionRequest) -> AsyncIterator[bytes]:
        """SSE chunks; the handler has validated the turn by planning it once (errors were 4xx)."""
        started = time.perf_counter()
        completion_id = _completion_id()
        async with session.lock:
            session.ensure_open()
            turn, plan = await self.plan_chat(session, request)
            reply = ChatReply(self.template, request, session.num_turns, plan)
            sampling = self.chat_sampling(session, request, plan)
            yield _sse(chat_chunk(completion_id, self.model_name, {"role": "assistant", "content": ""}))
            try:
                async with _AbortUnlessCommitted(self, session) as committed:
                    async with aclosing(self.runner.stream(session, turn, sampling)) as outputs:
                        async for output_ids in outputs:
                            for delta in reply.deltas(output_ids, final=False):
                                yield _sse(chat_chunk(completion_id, self.model_name, delta))
                    message = reply.message(turn.output_ids)
                    session.commit(turn, message, reply.parse_failures(turn.output_ids, message))
                    committed.set()
            except (NoEngineError, SessionClosedError, ValueError) as err:  # headers are sent: an SSE error event
                yield _sse({"error": {"message": str(err), "type": type(err).__name__, "code": None}})
                return
        self._count(session, turn, "chat_stream", started)
        for delta in reply.deltas(turn.output_ids, final=True):
            yield _sse(chat_chunk(completion_id, self.model_name, delta))
        logprobs = self._logprobs(turn) if request.logprobs else None  # all in the last chunk: they add up
        yield _sse(chat_chunk(completion_id, self.model_name, {}, finish_reason(message, turn.finish_reason),
                              logprobs=logprobs))
        if (request.stream_options or {}).get("include_usage"):
            yield _sse(chat_chunk(completion_id, self.model_name, None, usage_=_usage(turn)))
        yield b"data: [DONE]\n\n"

    # Token-native --------------------------------------------------------------------------------------
    async def generate(self, session: Session, request: SessionGenerateRequest, client: Request) -> dict[str, Any]:
        """Engine /generate shape; input_ids are appended to the session's last segment."""
        started = time.perf_counter()
        async with session.lock:
            session.ensure_open()
            turn = session.token_turn(request.input_ids)
            turn.top_logprobs = request.top_logprobs_num if request.return_logprob else 0
            given = {name: value for name, value in request.sampling_params.items() if value is not None}
            sampling = check_sampling({**turn_sampling(session.sampling, session.num_turns), **given},
                                      session.sampling.allow_truncation)  # null: the session's default
            await self._run_watching_client(session, turn, sampling, client)
            session.commit(turn)
        self._count(session, turn, "generate", started)
        return _generate_response(turn, self._native_text(turn, request.sampling_params), request,
                                  self.template.tokenizer)

    def _native_text(self, turn: Turn, params: dict[str, Any]) -> str:
        """The output's text, as SGLang writes it for the given skip_special_tokens / no_stop_trim; unset,
        the decode of every output id (the ids are the record; the text hides nothing of them)."""
        ids, trim = turn.output_ids, params.get("no_stop_trim") is False and turn.finish_reason == "stop"
        matched = turn.calls[-1].matched_stop if turn.calls else None
        if trim and isinstance(matched, int) and ids[-1:] == [matched]:
            ids = ids[:-1]
        text = self.template.tokenizer.decode(ids, skip_special_tokens=bool(params.get("skip_special_tokens")))
        if trim and isinstance(matched, str) and matched in text:
            text = text[:text.index(matched)]
        return text

    # Plumbing ------------------------------------------------------------------------------------------
    async def _run_watching_client(self, session: Session, turn: Turn, sampling: dict[str, Any],
                                   client: Request) -> None:
        """Run the turn; if the client disconnects first, abort the engine call and raise ClientGoneError."""
        run = asyncio.ensure_future(self.runner.run(session, turn, sampling))
        gone = asyncio.ensure_future(_client_gone(client))
        try:
            await asyncio.wait((run, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client left, or this handler itself was cancelled (shutdown)
            gone.cancel()
            unfinished = not run.done()
            if unfinished:
                in_flight = dict(session.in_flight)
                run.cancel()
                self.spawn(self.runner.abort(in_flight))
        if unfinished:
            self.metrics.client_disconnects.inc()
            raise ClientGoneError
        run.result()

    def _count(self, session: Session, turn: Turn, api: str, started: float) -> None:
        if turn.segment is None and len(session.segments) > 1:
            self.metrics.new_segments.inc()
        self.metrics.turns.labels(api, turn.finish_reason).inc()
        self.metrics.prompt_tokens.inc(len(turn.new_ids))
        self.metrics.cached_prompt_tokens.inc(turn.cached_tokens)
        self.metrics.generated_tokens.inc(len(turn.generated_ids))
        elapsed = time.perf_counter() - started
        self.metrics.turn_latency.labels(api).observe(elapsed)
        self.metrics.added_latency.labels(api).observe(max(elapsed - turn.engine_latency_s, 0.0))
        self.metrics.own_latency.labels(api).observe(max(elapsed - turn.engine_wall_s, 0.0))


class _AbortUnlessCommitted:
    """Around a streamed generation: if it ends without a commit (client gone, error), abort the
    engine calls still running."""

    def __init__(self, turns: Turns, session: Session) -> None:
        self.turns, self.session = turns, session
        self.committed = asyncio.Event()

    async def __aenter__(self) -> asyncio.Event:
        return self.committed

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if not self.committed.is_set() and self.session.in_flight:
            self.turns.spawn(self.turns.runner.abort(dict(self.session.in_flight)))
            if exc_type is asyncio.CancelledError or exc_type is GeneratorExit:
                self.turns.metrics.client_disconnects.inc()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _message_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(c) if isinstance(c := m.get("content"), str) else len(str(c or "")) for m in messages)


def _completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(turn: Turn) -> dict[str, int]:
    """Completion tokens are the generated ones; tokens the gateway forced (tool_choice) count as prompt."""
    generated = len(turn.generated_ids)
    return usage(turn.base_len + len(turn.new_ids) + len(turn.output_ids) - generated, generated, turn.cached_tokens)


def _generate_response(turn: Turn, text: str, request: SessionGenerateRequest, tokenizer: Tokenizer) -> dict[str, Any]:
    """SGLang's /generate reply for the whole turn (its engine calls joined)."""
    last = turn.calls[-1]
    finish: dict[str, Any] = {"type": last.finish_reason}
    if last.finish_reason == "stop":
        finish["matched"] = last.matched_stop
    elif last.finish_reason == "length":
        finish["length"] = len(turn.output_ids)
    versions = [v for call in turn.calls if not call.forced for v in call.versions]
    meta: dict[str, Any] = {
        "id": secrets.token_hex(12), "finish_reason": finish, "prompt_tokens": turn.base_len + len(turn.new_ids),
        "completion_tokens": len(turn.output_ids), "cached_tokens": turn.cached_tokens,
        "weight_version": str(versions[-1]) if versions else None, "weight_versions": version_spans(versions),
        "e2e_latency": turn.engine_latency_s, "engines": turn.engines}
    if request.return_logprob:
        token_text = (lambda t: tokenizer.decode([t])) if request.return_text_in_logprobs else (lambda t: None)
        meta["output_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(turn.output_logprobs, turn.output_ids)]
        if turn.top_logprobs:
            meta["output_top_logprobs"] = [[[lp, t, token_text(t)] for lp, t in top] for top in turn.output_top_logprobs]
    return {"text": text, "output_ids": turn.output_ids, "meta_info": meta}

