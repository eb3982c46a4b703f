"""Stand-in engines: real HTTP servers that speak the engine protocol (docs/protocols/engine.md, the subset
the gateway and the trainer's tensor push use) with a latency model and no model inside, so the control
plane (gateway, orchestrator, Redis, weight push) can be measured at cluster scale on a laptop.

    python -m bench.standin_engine --engines 16 --port 0 --url-file engines.url   # 16 engines, one process
    python -m bench.standin_engine --engines 1 --port 41234 ...                    # one engine, a fixed port

Several engines share a process (one event loop, one port each) to save memory; an engine that must die
alone gets a process of its own (bench/control_plane_scale.py kills and restarts it on the same port).

Latency model of one /generate (seconds of "active" time, i.e. while the engine is not paused):
    ttft   = ttft_s + prefill_s_per_token x (prompt tokens - cached tokens)
    finish = ttft + decode_s_per_token x output tokens
Prefix cache: a per-engine LRU of `block`-token prompt blocks keyed by the hash of the whole prefix up to
each block (as SGLang's radix cache and vLLM's block hashes do). cached_tokens = the tokens of the longest
run of leading blocks found; after a request its prompt + output blocks are inserted; `cache_tokens` bounds
the LRU; a weight update with flush_cache empties it, a restarted engine starts cold. So an affine router
(a session's turns on one engine) shows a high cached ratio and shorter turns.

Output: its length drawn uniformly from [min_out, max_out] by the request's sampling_seed (or rid) and
prompt length, capped by max_new_tokens (finish `length`), else ended by the first stop_token_id (finish
`stop`); the ids are the tokenizer's ordinary tokens after `</think>` (the GLM template's reasoning end,
so the gateway parses a plain content reply), log-probs -Exp(2) (mean -0.5), deterministic per seed.

Pause (/pause_generation): `abort` ends every running request now (finish abort, tokens so far kept);
`in_place` and `retract` hold them (no progress, no new request starts) until /continue_generation, after
which their remaining tokens carry the new weight version (meta_info.weight_versions spans). The stand-in
does not model retract's re-prefill. /update_weights_from_tensor decodes the payload (safetensors, numpy),
keeps each tensor's first rows for /get_weights_by_name (so the trainer's verify_weights reads back what
it sent) and serves the new weight_version.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import random
import secrets
import signal
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

import orjson
from aiohttp import web
from safetensors.numpy import load as load_safetensors

from asyncrl.tokenizer import BUILTIN_TINY, load_tokenizer

KEPT_ROWS = 100
"""Rows of each pushed tensor kept for /get_weights_by_name (SGLang's default truncate_size)."""


@dataclass
class LatencyModel:
    ttft_s: float = 0.1
    prefill_s_per_token: float = 0.00005
    decode_s_per_token: float = 0.02
    min_out: int = 16
    max_out: int = 48
    block: int = 16
    cache_tokens: int = 262144
    stream_every: int = 8
    """Tokens per streamed event."""


class PrefixCache:
    """LRU of prompt blocks, each keyed by the hash of the whole prefix ending with it."""

    def __init__(self, block: int, capacity_tokens: int) -> None:
        self.block, self.capacity = block, max(capacity_tokens // block, 1)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def _keys(self, ids: list[int]) -> list[bytes]:
        keys, h = [], b""
        for start in range(0, len(ids) - self.block + 1, self.block):
            h = hashlib.blake2b(h + orjson.dumps(ids[start:start + self.block]), digest_size=12).digest()
            keys.append(h)
        return keys

    def match(self, ids: list[int]) -> int:
        """Cached tokens: the leading blocks found (touched as recently used)."""
        hits = 0
        for key in self._keys(ids):
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            hits += 1
        return hits * self.block

    def insert(self, ids: list[int]) -> None:
        for key in self._keys(ids):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def flush(self) -> None:
        self.blocks.clear()


@dataclass
class Running:
    """A /generate in progress."""

    rid: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False


class Vocabulary:
    """Which ids a stand-in generates: the tokenizer's ordinary tokens, after its `</think>` if it has one."""

    def __init__(self, spec: str) -> None:
        tok = load_tokenizer(spec)
        special = set(tok.special_tokens.values())
        self.ordinary = [i for i in range(tok.vocab_size) if i not in special]
        self.prefix = [tok.token_id("</think>")] if tok.has_token("</think>") else []
        self.tokenizer = tok


class StandinEngine:
    def __init__(self, model: LatencyModel, vocab: Vocabulary, name: str) -> None:
        self.model, self.vocab, self.name = model, vocab, name
        self.cache = PrefixCache(model.block, model.cache_tokens)
        self.weight_version = "0"
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, Running] = {}
        self.weights: dict[str, list] = {}
        self.counters = {"num_requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
                         "aborted_requests": 0}
        self.health_checks = 0
        """GET /health answered: how often the gateway probes it (standin_health_checks_total, not SGLang's)."""

    # Generation --------------------------------------------------------------------------------------
    def plan(self, ids: list[int], params: dict, rid: str) -> tuple[list[int], list[float], str]:
        """(output ids, their log-probs, finish type) of a request, deterministic per seed and prompt length."""
        seed = params.get("sampling_seed")
        rng = random.Random(f"{seed if seed is not None else rid}:{len(ids)}")
        budget = params.get("max_new_tokens")
        budget = 128 if budget is None else budget
        natural = rng.randint(self.model.min_out, self.model.max_out)
        stops = params.get("stop_token_ids") or []
        fill = max(natural - len(self.vocab.prefix) - bool(stops), 0)
        out = self.vocab.prefix + [rng.choice(self.vocab.ordinary) for _ in range(fill)] + stops[:1]
        finish = "stop" if stops and len(out) <= budget else "length"
        out = out[:budget]
        return out, [-rng.expovariate(2.0) for _ in out], finish

    async def progress(self, req: Running, ttft: float, n: int, stream_every: Optional[int]
                       ) -> AsyncIterator[tuple[int, list[tuple[str, int, int]]]]:
        """Advance the request through its active time; yields (tokens done, version spans) at every
        `stream_every` tokens (None: at the end only), and once more if it is aborted."""
        active, done, spans = 0.0, 0, []
        total = ttft + n * self.model.decode_s_per_token
        while done < n and not req.aborted:
            while self.paused and not req.aborted:
                await self.resumed.wait()
            if req.aborted:
                break
            version = self.weight_version
            target = total if stream_every is None else min(total, ttft + min(done + stream_every, n) *
                                                           self.model.decode_s_per_token)
            began = time.monotonic()
            req.wake.clear()
            try:
                async with asyncio.timeout(max(target - active, 0.0)):
                    await req.wake.wait()
            except TimeoutError:
                pass
            # The clock, not the timer: a loop's timer may fire a little before its time by time.monotonic()
            # (libuv times it from the iteration's cached clock), and a request then reported an e2e_latency
            # under the model's; the loop sleeps the rest.
            active += time.monotonic() - began
            now_done = self.tokens_by(active, ttft, n)
            if now_done > done:
                if spans and spans[-1][0] == version:
                    spans[-1] = (version, spans[-1][1], now_done)
                else:
                    spans.append((version, done, now_done))
                done = now_done
                if stream_every is not None or done == n:
                    yield done, spans
        if req.aborted:
            yield done, spans

    def tokens_by(self, active: float, ttft: float, n: int) -> int:
        """Output tokens finished after `active` seconds of a request's active time."""
        per_token = self.model.decode_s_per_token
        if active >= ttft + n * per_token - 1e-9:
            return n
        return 0 if per_token <= 0 else min(n, max(0, int((active - ttft) / per_token + 1e-9)))

    def meta(self, rid: str, ids: list[int], out: list[int], lps: list[float], done: int, spans, finish: Optional[dict],
             cached: int, started: float, top: int) -> dict:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": done,
                "cached_tokens": cached, "weight_version": spans[-1][0] if spans else self.weight_version,
                "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
                "e2e_latency": time.monotonic() - started, "input_token_logprobs": [],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps[:done], out[:done])],
                "output_token_logprobs_length": done}
        if top:
            meta["output_top_logprobs"] = [[[lp, t, None]] + [[lp - 1.0 - k, (t + k + 1) % len(self.vocab.ordinary),
                                                                None] for k in range(top - 1)]
                                           for lp, t in zip(lps[:done], out[:done])]
        return {"text": self.vocab.tokenizer.decode(out[:done]), "output_ids": out[:done], "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body = orjson.loads(await request.read())
            ids, params = body["input_ids"], body.get("sampling_params") or {}
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError("input_ids: a list of token ids (one prompt: the stand-in takes no batches)")
            if (params.get("n") or 1) != 1:
                raise ValueError("sampling_params.n: the stand-in generates one sample per request")
        except (ValueError, KeyError, TypeError) as err:
            return web.json_response({"error": f"{type(err).__name__}: {err}"}, status=400)
        rid = body.get("rid") or secrets.token_hex(8)
        out, lps, finish_type = self.plan(ids, params, rid)
        cached = self.cache.match(ids)
        ttft = self.model.ttft_s + self.model.prefill_s_per_token * (len(ids) - cached)
        req = self.running[rid] = Running(rid)
        self.counters["num_requests"] += 1
        top = int(body.get("top_logprobs_num") or 0)
        try:
            if not body.get("stream"):
                done, spans = 0, []
                async for done, spans in self.progress(req, ttft, len(out), None):
                    pass
                return web.Response(body=orjson.dumps(self._finish(req, ids, out, lps, done, spans, finish_type,
                                                                   cached, started, top)),
                                    content_type="application/json")
            return await self._stream(request, req, ids, out, lps, finish_type, cached, ttft, started, top)
        finally:
            self.running.pop(rid, None)

    def _finish(self, req: Running, ids, out, lps, done, spans, finish_type, cached, started, top) -> dict:
        if req.aborted:
            finish = {"type": "abort", "message": "aborted by pause_generation or abort_request"}
            self.counters["aborted_requests"] += 1
        elif finish_type == "stop":
            finish = {"type": "stop", "matched": out[-1]}
        else:
            finish = {"type": "length", "length": len(out)}
        self.counters["prompt_tokens"] += len(ids)
        self.counters["cached_tokens"] += cached
        self.counters["generation_tokens"] += done
        if not req.aborted:
            self.cache.insert(ids + out)
        return self.meta(req.rid, ids, out, lps, done, spans, finish, cached, started, top)

    async def _stream(self, request, req, ids, out, lps, finish_type, cached, ttft, started, top):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0
        async for done, spans in self.progress(req, ttft, len(out), self.model.stream_every):
            last = done == len(out) or req.aborted
            event = (self._finish(req, ids, out, lps, done, spans, finish_type, cached, started, top) if last else
                     self.meta(req.rid, ids, out, lps, done, spans, None, cached, started, top))
            if last or done > sent:
                await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
                sent = done
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # Control -----------------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"mode {mode!r}: abort, retract or in_place"}, status=400)
        self.paused = True
        self.resumed.clear()
        for req in self.running.values():
            req.aborted = req.aborted or mode == "abort"
            req.wake.set()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _: web.Request) -> web.Response:
        self.paused = False
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        body = await _body(request)
        rid, every = body.get("rid") or "", bool(body.get("abort_all"))
        if not rid and not every:
            return web.json_response({"error": "give 'rid' or set 'abort_all'"}, status=400)
        hit = [r for r in self.running.values() if every or r.rid.startswith(rid)]
        for req in hit:
            req.aborted = True
            req.wake.set()
        return web.json_response({"success": True, "num_aborted": len(hit)})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            for payload in body["serialized_named_tensors"]:
                for name, array in load_safetensors(base64.b64decode(payload, validate=True)).items():
                    self.weights[name] = array[:KEPT_ROWS].astype("float32").tolist()
        except Exception as err:  # noqa: BLE001 - a bad payload is the client's mistake: say what it was
            return web.json_response({"success": False, "message": f"{type(err).__name__}: {err}"}, status=400)
        return self._new_version(body)

    def _new_version(self, body: dict) -> web.Response:
        self.weight_version = str(body.get("weight_version") or int(self.weight_version) + 1)
        if body.get("flush_cache", True):
            self.cache.flush()
        return web.json_response({"success": True, "message": f"weights now version {self.weight_version}",
                                  "num_paused_requests": len(self.running) if self.paused else 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all_requests", True):
            for req in self.running.values():
                req.aborted = True
                req.wake.set()
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {self.weight_version}.",
                                  "new_version": self.weight_version})

    async def weights_by_name(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("name") not in self.weights:
            return web.json_response({"error": f"no tensor named {body.get('name')!r} was pushed"}, status=400)
        return web.json_response(self.weights[body["name"]][:int(body.get("truncate_size") or KEPT_ROWS)])

    async def flush_cache(self, _: web.Request) -> web.Response:
        if self.running:
            return web.Response(text="Cache not flushed: requests are running or waiting.\n", status=400)
        self.cache.flush()
        return web.Response(text="Cache flushed.\n")

    # Info --------------------------------------------------------------------------------------------
    def loads(self) -> dict:
        return {"dp_rank": 0, "num_running_reqs": 0 if self.paused else len(self.running),
                "num_waiting_reqs": len(self.running) if self.paused else 0,
                "num_tokens": len(self.cache.blocks) * self.cache.block}

    async def health(self, _: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response()

    def model_info(self) -> dict:
        return {"model_path": f"standin:{self.name}", "tokenizer_path": BUILTIN_TINY, "is_generation": True,
                "weight_version": self.weight_version, "architectures": ["StandinEngine"]}

    def server_info(self) -> dict:
        return {**self.model.__dict__, "model_path": f"standin:{self.name}", "version": "standin",
                "internal_states": [self.loads()]}

    def metrics(self) -> str:
        lines = [f"# TYPE sglang_{k}_total counter\nsglang_{k}_total {v}" for k, v in self.counters.items()]
        lines.append(f"# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs {len(self.running)}")
        lines.append(f"# TYPE standin_health_checks_total counter\nstandin_health_checks_total {self.health_checks}")
        return "\n".join(lines) + "\n"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        j = lambda f: (lambda _: web.json_response(f()))  # noqa: E731
        app.add_routes([
            web.post("/generate", self.generate), web.put("/generate", self.generate),
            web.get("/health", self.health), web.get("/health_generate", lambda _: web.Response()),
            web.post("/pause_generation", self.pause), web.post("/continue_generation", self.resume),
            web.post("/abort_request", self.abort), web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/update_weight_version", self.update_weight_version),
            web.post("/get_weights_by_name", self.weights_by_name), web.get("/get_weights_by_name", self.weights_by_name),
            web.post("/flush_cache", self.flush_cache), web.get("/flush_cache", self.flush_cache),
            web.get("/get_model_info", j(self.model_info)), web.get("/model_info", j(self.model_info)),
            web.get("/get_server_info", j(self.server_info)), web.get("/server_info", j(self.server_info)),
            web.get("/get_weight_version", j(lambda: {"weight_version": self.weight_version})),
            web.get("/v1/loads", j(lambda: {"loads": [self.loads()]})),
            web.get("/get_load", j(lambda: [{"dp_rank": 0, "num_reqs": len(self.running),
                                             "num_waiting_reqs": self.loads()["num_waiting_reqs"],
                                             "num_tokens": self.loads()["num_tokens"]}])),
            web.get("/metrics", lambda _: web.Response(text=self.metrics(), content_type="text/plain")),
        ])
        return app


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    return orjson.loads(raw) if raw else {}


async def serve(args: argparse.Namespace) -> None:
    model = LatencyModel(args.ttft_s, args.prefill_s_per_token, args.decode_s_per_token, args.min_out, args.max_out,
                         args.block, args.cache_tokens, args.stream_every)
    vocab = Vocabulary(args.tokenizer)
    urls, runners = [], []
    for i in range(args.engines):
        runner = web.AppRunner(StandinEngine(model, vocab, f"{args.name}{i}").app(), access_log=None,
                               keepalive_timeout=75.0)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port if args.engines == 1 else 0, backlog=4096)
        await site.start()
        urls.append(f"http://{args.host}:{site._server.sockets[0].getsockname()[1]}")
        runners.append(runner)
    if args.url_file:
        tmp = Path(args.url_file).with_suffix(".tmp")
        tmp.write_text("\n".join(urls))
        tmp.replace(args.url_file)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=1, help="engines in this process, one port each")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="with --engines 1: its port (0 = free); else ignored")
    p.add_argument("--url-file", help="write the engines' URLs here, one a line, once serving")
    p.add_argument("--name", default="standin", help="engine name prefix (model_path standin:<name><i>)")
    p.add_argument("--tokenizer", default=BUILTIN_TINY)
    d = LatencyModel()
    p.add_argument("--ttft-s", type=float, default=d.ttft_s)
    p.add_argument("--prefill-s-per-token", type=float, default=d.prefill_s_per_token)
    p.add_argument("--decode-s-per-token", type=float, default=d.decode_s_per_token)
    p.add_argument("--min-out", type=int, default=d.min_out)
    p.add_argument("--max-out", type=int, default=d.max_out)
    p.add_argument("--block", type=int, default=d.block, help="prefix cache block (tokens)")
    p.add_argument("--cache-tokens", type=int, default=d.cache_tokens, help="prefix cache capacity per engine")
    p.add_argument("--stream-every", type=int, default=d.stream_every, help="tokens per streamed event")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
