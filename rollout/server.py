"""`asyncrl engine serve`: the built-in engine behind SGLang's native HTTP API (engine.md).

Handlers are thin: each validates its typed request, calls one method of the engine's HTTP-side parts
(rollout/generation.py, rollout/control.py, rollout/weight_updates.py) and returns its typed answer
(asyncrl/protocols/engine.py); a refused control call (rollout/errors.py) is SGLang's
`{"success": false, "message"}`.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from asyncrl.config import ENGINE_API_KEY_ENV
from asyncrl.protocols.engine import (AbortRequest, AbortResponse, DestroyWeightsUpdateGroupRequest, GenerateRequest,
                                      GenerationStatusResponse, GetWeightsByNameRequest, InitWeightsUpdateGroupRequest,
                                      LoadEntry, LoadsResponse, MemoryOccupationRequest, ModelCard, ModelList,
                                      PauseGenerationRequest, RankLoad, SuccessResponse,
                                      UpdateWeightVersionRequest, UpdateWeightVersionResponse,
                                      UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest,
                                      UpdateWeightsFromTensorRequest, WeightsUpdateResponse, WeightVersionResponse)
from asyncrl.service import GuardMiddleware, install_error_handlers, install_metrics, json_body, parse_json_body, serve
from rollout.control import EngineControl
from rollout.engine import Engine, EngineArgs
from rollout.errors import Refused
from rollout.generation import Generation
from rollout.metrics import EngineMetrics
from rollout.weight_updates import WeightUpdates

OPEN_PATHS = ("/health", "/metrics")
"""What SGLang's --api-key leaves open (prefixes: /health_generate too), so probes and scrapers need no key."""
WEIGHT_PUSH_ROUTES = {"/update_weights_from_tensor": None}
"""Routes without a body limit: a tensor push carries the whole model (protect them with --api-key)."""


def build_app(engine: Engine) -> FastAPI:
    metrics = EngineMetrics(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.stop()

    app = FastAPI(title="asyncrl CPU engine (SGLang native API)", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, auth_token=engine.args.api_key, max_request_bytes=engine.args.max_request_bytes,
                       open_prefixes=OPEN_PATHS, route_limits=WEIGHT_PUSH_ROUTES)
    install_error_handlers(app)
    app.add_exception_handler(Refused, _refused)
    install_metrics(app, metrics.registry)
    _generation_routes(app, Generation(engine, metrics))
    _info_routes(app, engine)
    _control_routes(app, EngineControl(engine))
    _weight_update_routes(app, WeightUpdates(engine))
    return app


async def _refused(_: Request, exc: Refused) -> JSONResponse:
    return JSONResponse(SuccessResponse(success=False, message=exc.message).model_dump(), status_code=exc.status)


def _generation_routes(app: FastAPI, generation: Generation) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"], openapi_extra=json_body(GenerateRequest))
    async def generate(request: Request) -> Response:
        return await generation.generate(await parse_json_body(request, GenerateRequest), request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return Response(status_code=200 if await generation.healthy(request) else 503)


def _info_routes(app: FastAPI, engine: Engine) -> None:
    """What the engine is and how loaded it is: read without the engine thread."""

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {**engine.server_info(), "internal_states": [engine.scheduler.loads()]}

    @app.get("/get_weight_version")
    async def get_weight_version() -> WeightVersionResponse:
        return WeightVersionResponse(weight_version=engine.weight_version)

    @app.get("/v1/loads")
    async def loads() -> LoadsResponse:
        return LoadsResponse(loads=[LoadEntry(dp_rank=0, **engine.scheduler.loads())])

    @app.get("/get_load")
    async def get_load() -> list[RankLoad]:
        """SGLang's per-DP-rank load list: what sglang-router polls for its load-aware policies."""
        now = engine.scheduler.loads()
        return [RankLoad(dp_rank=0, num_reqs=now["num_running_reqs"] + now["num_waiting_reqs"],
                         num_waiting_reqs=now["num_waiting_reqs"], num_tokens=now["num_tokens"])]

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.args.served_model_name, root=engine.args.model_path)])


def _control_routes(app: FastAPI, control: EngineControl) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await control.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> AbortResponse:
        return await control.abort(body)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest) -> GenerationStatusResponse:
        return await control.pause(body)

    @app.post("/continue_generation")
    async def continue_generation() -> GenerationStatusResponse:
        return await control.resume()

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> UpdateWeightVersionResponse:
        return await control.update_weight_version(body)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameRequest) -> Response:
        """Rows of floats: serialized by orjson, not validated into a model."""
        return Response(orjson.dumps(await control.weights_by_name(body)), media_type="application/json")

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> SuccessResponse:
        return await control.release_memory(body)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: Optional[MemoryOccupationRequest] = None) -> SuccessResponse:
        return await control.resume_memory(body)


def _weight_update_routes(app: FastAPI, updates: WeightUpdates) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> WeightsUpdateResponse:
        return await updates.from_disk(body)

    @app.post("/update_weights_from_tensor", openapi_extra=json_body(UpdateWeightsFromTensorRequest))
    async def update_weights_from_tensor(request: Request) -> WeightsUpdateResponse:
        body = await parse_json_body(request, UpdateWeightsFromTensorRequest)  # a whole model: parsed off the loop
        return await updates.from_tensor(body)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> SuccessResponse:
        return await updates.join_group(body)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> WeightsUpdateResponse:
        return await updates.from_distributed(body)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> SuccessResponse:
        return await updates.destroy_group(body)


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
    p.add_argument("--speculative-algorithm", choices=["NEXTN", "EAGLE"],
                   help="speculative decoding with the checkpoint's MTP layer (SGLang's flag; NEXTN = EAGLE here)")
    p.add_argument("--speculative-num-steps", type=int, default=EngineArgs.speculative_num_steps,
                   help="MTP drafts per decode step, the one layer reused for each (SGLang's flag)")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branches per step: only 1 (a chain)")
    p.add_argument("--speculative-num-draft-tokens", type=int,
                   help="tokens verified per step: num_steps + 1 for a chain (the default)")
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
