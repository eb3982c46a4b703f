"""A forwarding proxy that does nothing: POST /generate is passed to the engine byte for byte.

The floor of any HTTP gateway on the machine (same server stack and client as the gateway:
FastAPI/uvicorn on uvloop, aiohttp): gateway_bench.py reports the gateway's overhead next to it.

    python bench/null_proxy.py --engine URL --port 0 --url-file F
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.service import serve  # noqa: E402


def build_app(engine: str) -> FastAPI:
    app = FastAPI()
    state: dict[str, aiohttp.ClientSession] = {}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        if "session" not in state:
            state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))
        async with state["session"].post(f"{engine}/generate", data=await request.body(),
                                         headers={"content-type": "application/json"}) as reply:
            return Response(await reply.read(), status_code=reply.status, media_type="application/json")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--url-file")
    args = p.parse_args()
    serve(build_app(args.engine), "127.0.0.1", args.port, url_file=args.url_file)


if __name__ == "__main__":
    main()
