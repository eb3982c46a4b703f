"""/generate and /health_generate on the engine: requests are made and submitted from the HTTP event loop,
and each waits for the engine thread's updates on a queue of its own (engine.md)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asyncrl.protocols.engine import GenerateItem, GenerateRequest, SamplingParams
from rollout.batch import split_batch
from rollout.engine import Engine
from rollout.metrics import EngineMetrics
from rollout.request import Req
from rollout.response import StreamView, response_body

OFFLOAD_PROMPT_SIZE = 16384
"""Prompt characters or ids of one /generate call above which it is tokenized and validated in a thread."""
HEALTH_CHECK_TIMEOUT_S = 20
"""How long /health_generate waits for its one-token request before answering 503."""

Watched = tuple[Req, asyncio.Queue]
"""A request and the queue the engine thread fills with (output tokens so far, finished) after updates."""


def new_rid() -> str:
    return uuid.uuid4().hex


class Generation:
    """Runs /generate calls on the engine and answers them, whole or as a stream."""

    def __init__(self, engine: Engine, metrics: EngineMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        items, samples = split_batch(body, new_rid), body.parallel_samples
        prefixes = []
        if samples > 1:  # as SGLang: prefill each prompt once, so that its n samples start from its cached KV
            prefixes = [item.model_copy(update={"rid": new_rid(), "sampling": SamplingParams(max_new_tokens=0),
                                                "stream": False, "return_logprob": False,
                                                "return_routed_experts": False})
                        for item in items[::samples]]
        prepared = await self._prepare(prefixes + items)
        await self._run_all(prepared[:len(prefixes)], request)
        started = prepared[len(prefixes):]
        for req, _ in started:
            self.engine.submit(req)
        if body.stream:
            return StreamingResponse(_stream(started, self.engine), media_type="text/event-stream")
        results = await asyncio.gather(*(self._until_finished(req, q, request) for req, q in started))
        return JSONResponse(results if body.returns_list else results[0])

    async def healthy(self, request: Request) -> bool:
        """Whether a one-token request finishes in time (released memory cannot generate: SGLang's check
        would time out instead)."""
        if self.engine.released:
            return False
        item = GenerateItem(rid=f"HEALTH_CHECK_{new_rid()}", input_ids=[0],
                            sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            on_update, updates = self._watch(asyncio.get_running_loop())
            req = self.engine.submit(self.engine.request(item, on_update))
            async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
                await self._until_finished(req, updates, request)
            return True
        except (TimeoutError, RuntimeError):
            return False

    def _watch(self, loop: asyncio.AbstractEventLoop) -> tuple[Callable[[Req], None], asyncio.Queue]:
        """An on_update callback for the engine thread and the queue it fills, in `loop`, with (output
        tokens so far, finished) after each update."""
        updates: asyncio.Queue = asyncio.Queue()
        interval = self.engine.args.stream_interval

        def on_update(req: Req) -> None:  # engine thread: only a note, the body is built by the loop
            count = len(req.output_ids)
            if req.finished:
                self.metrics.finished(req)
            elif not req.item.stream or (count > 1 and count % interval):
                return  # non-streaming clients only need the final state; streams get every interval-th
            loop.call_soon_threadsafe(updates.put_nowait, (count, req.finished))

        return on_update, updates

    async def _prepare(self, items: list[GenerateItem]) -> list[Watched]:
        """Tokenized and validated requests (not submitted yet), made in a thread when the prompts are large
        (tokenizing a long text takes seconds), so that /health and other requests keep being served."""
        watched = [self._watch(asyncio.get_running_loop()) for _ in items]

        def make() -> list[Watched]:
            return [(self.engine.request(item, on_update), updates)
                    for item, (on_update, updates) in zip(items, watched)]

        size = sum(len(item.text if item.text is not None else item.input_ids) for item in items)
        return await asyncio.to_thread(make) if size > OFFLOAD_PROMPT_SIZE else make()

    async def _run_all(self, prepared: list[Watched], request: Request) -> None:
        """Submit `prepared` and wait until all of them have finished."""
        for req, _ in prepared:
            self.engine.submit(req)
        await asyncio.gather(*(self._until_finished(req, q, request) for req, q in prepared))

    async def _until_finished(self, req: Req, updates: asyncio.Queue, request: Request) -> dict[str, Any]:
        """The request's final body; {} (and the request aborted) if the client goes away first."""
        disconnected = asyncio.create_task(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.create_task(updates.get())
                done, _ = await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    self.engine.call(lambda: self.engine.scheduler.abort(req.rid, "client disconnected"))
                    return {}
                _, finished = getter.result()
                if finished:
                    return response_body(req, self.engine.tokenizer, self.engine.weight_version)
        finally:
            disconnected.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(started: list[Watched], engine: Engine) -> AsyncIterator[bytes]:
    """SSE: one event per update of any request in the batch, then [DONE]: cumulative output, or with
    --incremental-streaming-output only what is new since the request's last event. Updates that queued
    up while the client was being served are merged into one event. If the client goes away, the
    generator is closed and its requests are aborted."""
    pending = {i: q for i, (_, q) in enumerate(started)}
    views = [StreamView(req, engine.tokenizer) for req, _ in started]

    def event(i: int, update: tuple[int, bool]) -> bytes:
        while not update[1] and not pending[i].empty():
            update = pending[i].get_nowait()
        req, (count, finished) = started[i][0], update
        if finished:
            body = response_body(req, engine.tokenizer, engine.weight_version)
        else:
            views[i].advance(count)
            body = response_body(req, engine.tokenizer, engine.weight_version, views[i])
        if engine.args.incremental_streaming_output:
            body = views[i].delta(body)
        if len(started) > 1:
            body["index"] = i
        if finished:
            pending.pop(i)
        return b"data: " + orjson.dumps(body) + b"\n\n"

    try:
        while len(started) == 1 and pending:  # the common case: no task per update
            yield event(0, await pending[0].get())
        while pending:
            getters = {asyncio.create_task(q.get()): i for i, q in pending.items()}
            done, rest = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for task in rest:
                task.cancel()
            for task in done:
                yield event(getters[task], task.result())
        yield b"data: [DONE]\n\n"
    finally:
        for i in pending:
            rid = started[i][0].rid
            engine.call(lambda rid=rid: engine.scheduler.abort(rid, "client disconnected"))
