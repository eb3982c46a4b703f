"""`asyncrl engine serve`: the built-in engine behind SGLang's native HTTP API (engine.md).

Handlers are thin: parse the typed request, hand it to the engine, await the engine thread's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from safetensors import SafetensorError

from asyncrl.config import ENGINE_API_KEY_ENV
from asyncrl.model.io import read_tensors
from asyncrl.service import (GuardMiddleware, error_response, install_error_handlers, install_metrics, json_body,
                             parse_json_body, serve)
from rollout.engine import MEMORY_TAGS, Engine, EngineArgs
from asyncrl.protocols.engine import (AbortRequest, DestroyWeightsUpdateGroupRequest, GenerateItem, GenerateRequest,
                              GetWeightsByNameRequest, InitWeightsUpdateGroupRequest, MemoryOccupationRequest,
                              PauseGenerationRequest, SamplingParams, UpdateWeightVersionRequest,
                              UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest,
                              UpdateWeightsFromTensorRequest)
from rollout.batch import split_batch
from rollout.request import Req
from rollout.response import StreamView, response_body
from rollout.weights import WeightsUpdateGroup, decode_tensors

log = logging.getLogger("rollout.server")

OPEN_PATHS = ("/health", "/metrics")
"""What SGLang's --api-key leaves open (prefixes: /health_generate too), so probes and scrapers need no key."""
OFFLOAD_PROMPT_SIZE = 16384
"""Prompt characters or ids of one /generate call above which it is tokenized and validated in a thread."""
WEIGHT_PUSH_ROUTES = {"/update_weights_from_tensor": None}
"""Routes without a body limit: a tensor push carries the whole model (protect them with --api-key)."""


class _LoadGauges(Collector):
    """The scheduler's load as SGLang's gauges, read once per scrape (Scheduler.loads walks the queue)."""

    def __init__(self, loads: Callable[[], dict[str, int]]) -> None:
        self.loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.loads()
        yield GaugeMetricFamily("sglang_num_running_reqs", "running requests", value=now["num_running_reqs"])
        yield GaugeMetricFamily("sglang_num_queue_reqs", "waiting requests", value=now["num_waiting_reqs"])
        yield GaugeMetricFamily("sglang_token_usage", "fraction of KV slots in use",
                                value=now["num_used_tokens"] / now["max_total_num_tokens"])


class EngineMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sglang_num_requests", "finished generate requests", ["finish"], registry=r)
        self.prompt_tokens = Counter("sglang_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("sglang_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("sglang_cached_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.e2e_latency = Histogram("sglang_e2e_request_latency_seconds", "request latency", registry=r,
                                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        r.register(_LoadGauges(engine.scheduler.loads))

    def finished(self, req: Req) -> None:
        self.requests.labels(req.finish_reason["type"]).inc()
        self.prompt_tokens.inc(len(req.prompt))
        self.generation_tokens.inc(len(req.output_ids))
        self.cached_tokens.inc(req.cached_tokens)
        self.e2e_latency.observe(time.monotonic() - req.created)


def build_app(engine: Engine) -> FastAPI:
    metrics = EngineMetrics(engine)
    state: dict[str, Optional[WeightsUpdateGroup]] = {"group": None}
    joining = asyncio.Lock()
    """Held while a rendezvous for a weights update group is under way (one at a time)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.stop()

    app = FastAPI(title="asyncrl CPU engine (SGLang native API)", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, auth_token=engine.args.api_key, max_request_bytes=engine.args.max_request_bytes,
                       open_prefixes=OPEN_PATHS, route_limits=WEIGHT_PUSH_ROUTES)
    install_error_handlers(app)
    install_metrics(app, metrics.registry)

    def new_rid() -> str:
        return uuid.uuid4().hex

    def watch(loop: asyncio.AbstractEventLoop) -> tuple[Callable[[Req], None], asyncio.Queue]:
        """An on_update callback for the engine thread and the queue it fills, in `loop`, with (output
        tokens so far, finished) after each update."""
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(req: Req) -> None:  # engine thread: only a note, the body is built by the loop
            count = len(req.output_ids)
            if req.finished:
                metrics.finished(req)
            elif not req.item.stream or (count > 1 and count % engine.args.stream_interval):
                return  # non-streaming clients only need the final state; streams get every interval-th
            loop.call_soon_threadsafe(updates.put_nowait, (count, req.finished))

        return on_update, updates

    async def prepare(items: list[GenerateItem]) -> list[tuple[Req, asyncio.Queue]]:
        """Tokenized and validated requests (not submitted yet), made in a thread when the prompts are large
        (tokenizing a long text takes seconds), so that /health and other requests keep being served."""
        watched = [watch(asyncio.get_running_loop()) for _ in items]

        def make() -> list[tuple[Req, asyncio.Queue]]:
            return [(engine.request(item, on_update), updates) for item, (on_update, updates) in zip(items, watched)]

        size = sum(len(item.text if item.text is not None else item.input_ids) for item in items)
        return await asyncio.to_thread(make) if size > OFFLOAD_PROMPT_SIZE else make()

    def run(item: GenerateItem) -> tuple[Req, asyncio.Queue]:
        """Submit one small item."""
        on_update, updates = watch(asyncio.get_running_loop())
        return engine.submit(engine.request(item, on_update)), updates

    async def until_finished(req: Req, updates: asyncio.Queue, request: Request) -> dict[str, Any]:
        disconnected = asyncio.create_task(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.create_task(updates.get())
                done, _ = await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    engine.call(lambda: engine.scheduler.abort(req.rid, "client disconnected"))
                    return {}
                _, finished = getter.result()
                if finished:
                    return response_body(req, engine.tokenizer, engine.weight_version)
        finally:
            disconnected.cancel()

    @app.api_route("/generate", methods=["POST", "PUT"], openapi_extra=json_body(GenerateRequest))
    async def generate(request: Request) -> Response:
        body = await parse_json_body(request, GenerateRequest)
        items, samples = split_batch(body, new_rid), body.parallel_samples
        prefixes = []
        if samples > 1:  # as SGLang: prefill each prompt once, so that its n samples start from its cached KV
            prefixes = [item.model_copy(update={"rid": new_rid(), "sampling": SamplingParams(max_new_tokens=0),
                                                "stream": False, "return_logprob": False,
                                                "return_routed_experts": False})
                        for item in items[::samples]]
        prepared = await prepare(prefixes + items)
        for req, _ in prepared[:len(prefixes)]:
            engine.submit(req)
        await asyncio.gather(*(until_finished(req, q, request) for req, q in prepared[:len(prefixes)]))
        started = prepared[len(prefixes):]
        for req, _ in started:
            engine.submit(req)
        if body.stream:
            return StreamingResponse(_stream(started, engine), media_type="text/event-stream")
        results = await asyncio.gather(*(until_finished(req, q, request) for req, q in started))
        return JSONResponse(results if body.returns_list else results[0])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if engine.released:  # released memory cannot generate (SGLang's check would time out instead)
            return Response(status_code=503)
        item = GenerateItem(rid=f"HEALTH_CHECK_{new_rid()}", input_ids=[0],
                            sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            req, updates = run(item)
            async with asyncio.timeout(20):
                await until_finished(req, updates, request)
            return Response(status_code=200)
        except (TimeoutError, RuntimeError):
            return Response(status_code=503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {**engine.server_info(), "internal_states": [engine.scheduler.loads()]}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return {"loads": [{"dp_rank": 0, **engine.scheduler.loads()}]}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        """SGLang's per-DP-rank load list: what sglang-router polls for its load-aware policies."""
        now = engine.scheduler.loads()
        return [{"dp_rank": 0, "num_reqs": now["num_running_reqs"] + now["num_waiting_reqs"],
                 "num_waiting_reqs": now["num_waiting_reqs"], "num_tokens": now["num_tokens"]}]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.args.served_model_name, "object": "model",
                                            "owned_by": "asyncrl", "root": engine.args.model_path}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        def flush() -> bool:
            if engine.scheduler.running or engine.scheduler.waiting:
                return False
            engine.scheduler.flush_cache()
            return True
        ok = await asyncio.wrap_future(engine.call(flush))
        if ok:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if not body.abort_all and not body.rid:
            return error_response(400, "give 'rid' or set 'abort_all'")
        rid = None if body.abort_all else body.rid
        count = await asyncio.wrap_future(engine.call(lambda: engine.scheduler.abort(rid, prefix=True)))
        return {"success": True, "num_aborted": count}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest) -> dict[str, Any]:
        def pause() -> None:
            if body.mode == "abort":
                engine.scheduler.abort(None, "aborted by pause_generation")
            elif body.mode == "retract":
                engine.scheduler.retract_all()
            engine.scheduler.paused = True
        await asyncio.wrap_future(engine.call(pause))
        return {"status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        def resume() -> None:
            engine.scheduler.paused = False
        await asyncio.wrap_future(engine.call(resume))
        return {"status": "ok"}

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> JSONResponse:
        def relabel() -> None:
            if body.abort_all_requests:
                engine.scheduler.abort(None, "aborted by update_weight_version")
            engine.scheduler.weight_version = body.new_version
        await asyncio.wrap_future(engine.call(relabel))
        return JSONResponse({"success": True, "message": f"Weight version updated to {body.new_version}.",
                             "new_version": body.new_version})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameRequest) -> Response:
        try:
            rows = await asyncio.wrap_future(engine.call(lambda: engine.weights_by_name(body.name, body.truncate_size)))
        except ValueError as err:
            return error_response(400, str(err))
        return Response(orjson.dumps(rows), media_type="application/json")

    async def memory(body: Optional[MemoryOccupationRequest], change: Callable[[frozenset[str]], str]) -> JSONResponse:
        tags = frozenset((body.tags if body else None) or MEMORY_TAGS)
        if not tags <= MEMORY_TAGS:
            return error_response(400, f"tags: unknown {sorted(tags - MEMORY_TAGS)} (known: {sorted(MEMORY_TAGS)})")
        try:
            message = await asyncio.wrap_future(engine.call(lambda: change(tags)))
        except ValueError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> JSONResponse:
        return await memory(body, engine.release_memory)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> JSONResponse:
        return await memory(body, engine.resume_memory)

    async def update(receive, strict: bool, version: Optional[str], flush: bool, abort_all: bool = False
                     ) -> JSONResponse:
        try:
            message = await asyncio.wrap_future(engine.update_weights(receive, strict, version, flush, abort_all))
        except (ValueError, RuntimeError, OSError, KeyError, SafetensorError) as err:  # a bad payload or checkpoint
            return JSONResponse({"success": False, "message": f"{type(err).__name__}: {err}"}, status_code=400)
        if version is not None:
            message += f" Weight version updated to {version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        return await update(lambda: read_tensors(body.model_path), True, body.weight_version, body.flush_cache,
                            body.abort_all_requests)

    @app.post("/update_weights_from_tensor", openapi_extra=json_body(UpdateWeightsFromTensorRequest))
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        body = await parse_json_body(request, UpdateWeightsFromTensorRequest)  # a whole model: parsed off the loop
        try:
            tensors = await asyncio.to_thread(decode_tensors, body.serialized_named_tensors, body.load_format)
        except ValueError as err:
            return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return await update(lambda: tensors, False, body.weight_version, body.flush_cache)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        try:
            await asyncio.to_thread(socket.getaddrinfo, body.master_address, body.master_port)
        except (socket.gaierror, UnicodeError) as err:
            return JSONResponse({"success": False, "message": f"master_address {body.master_address!r} does not "
                                 f"resolve ({err})"}, status_code=400)

        if joining.locked():
            return JSONResponse({"success": False, "message": "a weights update group is being joined already"},
                                status_code=409)
        async with joining:  # the rendezvous waits for rank 0: in a thread of its own, never the engine's,
            try:             # so that generation goes on while a trainer (or a wrong address) keeps it waiting
                state["group"] = await _in_daemon_thread(
                    WeightsUpdateGroup, body.master_address, body.master_port, body.rank_offset, body.world_size,
                    body.backend, body.group_name)
            except (RuntimeError, ValueError) as err:
                return JSONResponse({"success": False, "message": str(err)}, status_code=400)
        return JSONResponse({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"})

    def no_group_named(name: str) -> Optional[JSONResponse]:
        """A 400 unless the engine has joined the weights update group called `name`."""
        group = state["group"]
        if group is None or group.group_name != name:
            return JSONResponse({"success": False, "message": f"no weights update group {name!r}"}, status_code=400)
        return None

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        if (refused := no_group_named(body.group_name)) is not None:
            return refused
        group = state["group"]
        return await update(lambda: group.receive(body.names, body.dtypes, body.shapes), False, body.weight_version,
                            body.flush_cache)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        if (refused := no_group_named(body.group_name)) is not None:
            return refused
        group = state["group"]
        await asyncio.wrap_future(engine.call(group.destroy))
        state["group"] = None
        return JSONResponse({"success": True, "message": f"destroyed {body.group_name}"})

    return app


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` in a daemon thread: a rendezvous that never completes must hold neither the event
    loop nor the process's exit (the default executor's threads are joined at exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as err:
            done.set_exception(err)

    threading.Thread(target=run, name=f"rollout-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return asyncio.wrap_future(done)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(started: list[tuple[Req, asyncio.Queue]], engine: Engine) -> AsyncIterator[bytes]:
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


def parse_args(argv: Optional[list[str]] = None) -> tuple[EngineArgs, Optional[str]]:
    p = argparse.ArgumentParser(prog="asyncrl engine serve", description=__doc__)
    p.add_argument("--model", "--model-path", dest="model_path", required=True, help="HF-format checkpoint dir")
    p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer_path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --url-file)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--context-length", type=int)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--served-model-name", default="asyncrl")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--stream-interval", type=int, default=1, help="streamed tokens per SSE event (first token: at once)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record each token's routed experts so requests may ask for them (SGLang's flag)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream events carry only the new tokens, text and log-probs (SGLang's flag)")
    p.add_argument("--api-key", default=os.environ.get(ENGINE_API_KEY_ENV),
                   help=f"require Authorization: Bearer <key> on every route but /health*, /metrics (SGLang's flag; "
                        f"default ${ENGINE_API_KEY_ENV}, which keeps it off the command line)")
    p.add_argument("--max-request-bytes", type=int, default=EngineArgs.max_request_bytes,
                   help="largest request body (413 beyond); update_weights_from_tensor has no limit")
    p.add_argument("--url-file", help="write the bound URL here once serving")
    args = vars(p.parse_args(argv))
    if args["stream_interval"] < 1:
        p.error("--stream-interval must be >= 1")
    if args["max_request_bytes"] < 1:
        p.error("--max-request-bytes must be >= 1")
    url_file = args.pop("url_file")
    return EngineArgs(**args), url_file


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args, url_file = parse_args(argv)
    engine = Engine(args).start()
    serve(build_app(engine), args.host, args.port, url_file=url_file)


if __name__ == "__main__":
    main()
