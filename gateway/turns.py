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
from asyncrl.protocols.engine import version_spans
from asyncrl.protocols.gateway import ChatCompletionRequest, SessionGenerateRequest
from gateway.generation import NoEngineError, TurnRunner
from gateway.metrics import GatewayMetrics
from gateway.openai_api import (ChatReply, chat_chunk, chat_completion, chat_sampling, finish_reason, token_logprobs,
                                turn_sampling, usage)
from gateway.sampling import check_sampling
from gateway.session import Session, SessionClosedError, Turn


class ClientGoneError(Exception):
    """The client disconnected before its turn finished."""


class Turns:
    def __init__(self, template: GlmChatTemplate, runner: TurnRunner, metrics: GatewayMetrics, model_name: str,
                 spawn: Callable) -> None:
        self.template = template
        self.runner = runner
        self.metrics = metrics
        self.model_name = model_name
        self.spawn = spawn

    # OpenAI chat -------------------------------------------------------------------------------------
    def plan_chat(self, session: Session, request: ChatCompletionRequest) -> Turn:
        return session.chat_turn(self.template, request.messages, request.tools)

    def chat_sampling(self, session: Session, request: ChatCompletionRequest) -> dict[str, Any]:
        """The turn's engine sampling params; SamplingPolicyError (400) if the session's policy refuses them."""
        params = chat_sampling(request, session.sampling, session.num_turns, self.template.stop_token_ids)
        check_sampling(params, session.sampling.allow_truncation)
        return params

    async def chat(self, session: Session, request: ChatCompletionRequest, client: Request
                   ) -> tuple[dict[str, Any], float]:
        """-> the chat.completion and the engine's own latency of the turn (seconds)."""
        started = time.perf_counter()
        async with session.lock:
            session.ensure_open()
            turn = self.plan_chat(session, request)
            reply = ChatReply(self.template, request, session.num_turns)
            await self._run_watching_client(session, turn, self.chat_sampling(session, request), client)
            message = reply.message(turn.output_ids)
            session.commit(turn, message)
        self._count(session, turn, "chat", started)
        logprobs = token_logprobs(self.template.tokenizer, turn.output_ids, turn.output_logprobs) \
            if request.logprobs else None
        completion = chat_completion(_completion_id(), self.model_name, message,
                                     finish_reason(message, turn.finish_reason), _usage(turn), logprobs)
        return completion, turn.engine_latency_s

    async def chat_stream(self, session: Session, request: ChatCompletionRequest) -> AsyncIterator[bytes]:
        """SSE chunks; the handler has validated the turn by planning it once (errors were 4xx)."""
        started = time.perf_counter()
        completion_id = _completion_id()
        async with session.lock:
            session.ensure_open()
            turn = self.plan_chat(session, request)
            reply = ChatReply(self.template, request, session.num_turns)
            yield _sse(chat_chunk(completion_id, self.model_name, {"role": "assistant", "content": ""}))
            try:
                async with _AbortUnlessCommitted(self, session) as committed:
                    async with aclosing(self.runner.stream(session, turn, self.chat_sampling(session, request))) as outputs:
                        async for output_ids in outputs:
                            for delta in reply.deltas(output_ids, final=False):
                                yield _sse(chat_chunk(completion_id, self.model_name, delta))
                    message = reply.message(turn.output_ids)
                    session.commit(turn, message)
                    committed.set()
            except (NoEngineError, SessionClosedError, ValueError) as err:  # headers are sent: an SSE error event
                yield _sse({"error": {"message": str(err), "type": type(err).__name__, "code": None}})
                return
        self._count(session, turn, "chat_stream", started)
        for delta in reply.deltas(turn.output_ids, final=True):
            yield _sse(chat_chunk(completion_id, self.model_name, delta))
        yield _sse(chat_chunk(completion_id, self.model_name, {}, finish_reason(message, turn.finish_reason)))
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
            sampling = {**turn_sampling(session.sampling, session.num_turns),
                        **{k: v for k, v in request.sampling_params.items() if v is not None}}
            check_sampling(sampling, session.sampling.allow_truncation)
            await self._run_watching_client(session, turn, sampling, client)
            session.commit(turn)
        self._count(session, turn, "generate", started)
        return _generate_response(turn, self.template.tokenizer.decode(turn.output_ids), request.return_logprob)

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
        self.metrics.generated_tokens.inc(len(turn.output_ids))
        self.metrics.turn_latency.labels(api).observe(time.perf_counter() - started)


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


def _completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(turn: Turn) -> dict[str, int]:
    return usage(turn.base_len + len(turn.new_ids), len(turn.output_ids))


def _generate_response(turn: Turn, text: str, return_logprob: bool) -> dict[str, Any]:
    """SGLang's /generate reply for the whole turn (its engine calls joined)."""
    last = turn.calls[-1]
    finish: dict[str, Any] = {"type": last.finish_reason}
    if last.finish_reason == "stop":
        finish["matched"] = last.matched_stop
    elif last.finish_reason == "length":
        finish["length"] = len(turn.output_ids)
    versions = [v for call in turn.calls for v in call.versions]
    meta: dict[str, Any] = {
        "id": secrets.token_hex(12), "finish_reason": finish, "prompt_tokens": turn.base_len + len(turn.new_ids),
        "completion_tokens": len(turn.output_ids), "cached_tokens": 0,
        "weight_version": str(versions[-1]) if versions else None, "weight_versions": version_spans(versions),
        "e2e_latency": turn.engine_latency_s, "engines": turn.engines}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(turn.output_logprobs, turn.output_ids)]
    return {"text": text, "output_ids": turn.output_ids, "meta_info": meta}

