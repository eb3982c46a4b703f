"""A null engine hop under load: the machine's floor under the gateway's engine-hop figure.

The control-plane benchmark (bench/control_plane_scale.py) runs one `serve` process on the engines' CPUs
and one `probe` process on the gateway's, both at SCHED_FIFO by default (no process of the run delays them). Every `--interval-s` the probe
sends the server a request the size of a gateway turn's /generate and the server answers at once with a
reply the size of a stand-in engine's, over the client the gateway itself uses (asyncrl.engine_client.
AiohttpTransport on uvloop). The round trip is what any process on the gateway's CPU pays for one HTTP
call to the engines' CPU under that load, with no work at either end and no wait for a CPU; the gateway's hop (its call's wall
time minus the engine's own seconds) is that plus the gateway's encoding and parsing and the engine
server's work and its waits for a CPU. The probe also records how late its timer fired: at SCHED_FIFO, the
stalls of the machine itself (the hypervisor, the kernel), which every process on the CPU sees.

    python -m bench.hop_probe serve --port 0 --url-file F
    python -m bench.hop_probe probe --target URL --port 0 --url-file F    # GET /samples?since=&until=
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from pathlib import Path

import httpx
import orjson
from aiohttp import web

from asyncrl.engine_client import AiohttpTransport

PROMPT_TOKENS = 600
"""About a turn's prompt in the benchmark (the conversation after two tool results)."""
OUTPUT_TOKENS = 32
"""The stand-in engines' mean output (16-48 tokens)."""
REQUEST = orjson.dumps({"input_ids": list(range(1000, 1000 + PROMPT_TOKENS)), "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 48, "temperature": 1.0}, "rid": "0" * 24})
REPLY = orjson.dumps({"text": "", "output_ids": list(range(OUTPUT_TOKENS)), "meta_info": {
    "id": "0" * 24, "finish_reason": {"type": "length", "length": OUTPUT_TOKENS}, "prompt_tokens": PROMPT_TOKENS,
    "completion_tokens": OUTPUT_TOKENS, "cached_tokens": 0, "weight_version": "1", "e2e_latency": 0.0,
    "output_token_logprobs": [[-1.234567, i, None] for i in range(OUTPUT_TOKENS)]}})


async def _answer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=REPLY, content_type="application/json")


class Probe:
    def __init__(self, target: str, interval_s: float) -> None:
        self.target, self.interval_s = f"{target}/generate", interval_s
        self.samples: list[tuple[float, float, float]] = []
        """(time.time() at the end, round trip s, timer lateness s)."""
        self.transport = AiohttpTransport()

    async def run(self) -> None:
        headers = {"content-type": "application/json"}
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = time.perf_counter() - due
            started = time.perf_counter()
            try:
                reply = await self.transport.request("POST", self.target, REQUEST, headers, 10.0)
            except httpx.TransportError:  # the machine too loaded to connect in time: no sample
                continue
            if reply.status_code == 200:
                self.samples.append((time.time(), time.perf_counter() - started, late))

    async def window(self, request: web.Request) -> web.Response:
        since, until = float(request.query.get("since", 0)), float(request.query.get("until", time.time()))
        return web.json_response([s for s in self.samples if since <= s[0] <= until])


async def serve(args: argparse.Namespace) -> None:
    app = web.Application()
    probe = None
    if args.role == "serve":
        app.add_routes([web.post("/generate", _answer)])
    else:
        probe = Probe(args.target, args.interval_s)
        app.add_routes([web.get("/samples", probe.window)])
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=75.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    task = asyncio.create_task(probe.run()) if probe else None
    if args.url_file:
        tmp = Path(args.url_file).with_suffix(".tmp")
        tmp.write_text(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        tmp.replace(args.url_file)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    if task is not None:
        task.cancel()
        await probe.transport.close()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("role", choices=("serve", "probe"))
    p.add_argument("--target", help="probe: the serve process's URL")
    p.add_argument("--interval-s", type=float, default=0.02, help="probe: between round trips")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--url-file", help="write the URL here once serving")
    args = p.parse_args()
    if args.role == "probe" and not args.target:
        p.error("probe needs --target")
    import uvloop

    uvloop.install()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
