"""Gateway overhead and throughput against the real CPU engine, side by side with direct engine calls.

Starts a redis-server, one built-in engine (random tiny GLM-5) and the gateway, then:

1. latency: N rounds at concurrency 1; each round sends the same prompt three ways, in rotating
   order: straight to the engine's /generate, through the gateway's token-native
   /sessions/{sid}/generate, and through its OpenAI /sessions/{sid}/v1/chat/completions (fresh
   session each, so each path does the same engine work). Overhead = gateway - direct, per round.
2. load: C concurrent sessions, each an agent loop of chat turns (the conversation grows turn by
   turn) for D seconds, then finished into Redis. Then C/2 gateway sessions and C/2 agents that
   render the prompt themselves and call the engine directly, side by side in the same window.
   Reports requests/s, errors, latency, CPU seconds per process and the engine's token counters.

    python bench/gateway_bench.py --rounds 300 --sessions 1000 --duration 60 --out bench/results/gateway_bench

The machine is shared and has two cores: the load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.chat_template import GlmChatTemplate  # noqa: E402
from asyncrl.config import load_model_section  # noqa: E402
from asyncrl.model.io import save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.tokenizer import load_tokenizer  # noqa: E402
from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402


def start(module: str, args: list[str], workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    url_file = workdir / f"{name}.url"
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port", "0", "--url-file", str(url_file)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    return proc, url_file.read_text().strip()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 0.5) * 1e3, 3), "p99_ms": round(percentile(values, 0.99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(values) * 1e3, 3), "n": len(values)}


class Bench:
    def __init__(self, engine: str, gateway: str, proxy: str, template: GlmChatTemplate, max_tokens: int,
                 pids: dict[str, int]) -> None:
        self.engine, self.gateway, self.proxy, self.template = engine, gateway, proxy, template
        self.max_tokens = max_tokens
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(1200.0, connect=60.0), limits=limits)

    def params(self, seed: int) -> dict:
        return {"max_new_tokens": self.max_tokens, "temperature": 1.0, "sampling_seed": seed,
                "stop_token_ids": list(self.template.stop_token_ids)}

    async def post(self, url: str, body: dict) -> dict:
        r = await self.http.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        r.raise_for_status()
        return orjson.loads(r.content)

    async def session(self) -> str:
        return (await self.post(f"{self.gateway}/sessions", {}))["session_id"]

    async def timed(self, url: str, body: dict) -> tuple[float, float]:
        """-> (latency seen by the client, latency outside the engine: client latency minus the
        engine's own e2e_latency, i.e. HTTP, JSON and gateway time)."""
        started = time.perf_counter()
        r = await self.http.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - started
        r.raise_for_status()
        if "x-engine-latency-s" in r.headers:
            engine = float(r.headers["x-engine-latency-s"])
        else:
            engine = orjson.loads(r.content)["meta_info"]["e2e_latency"]
        return elapsed, elapsed - engine

    # 1. latency ------------------------------------------------------------------------------------
    async def latency(self, rounds: int) -> dict:
        paths = {"direct": [], "null_proxy": [], "gateway_generate": [], "gateway_chat": []}
        outside = {name: [] for name in paths}
        for i in range(rounds + 10):
            messages = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
            ids = self.template.render(messages, add_generation_prompt=True)
            sid_a, sid_b = await self.session(), await self.session()
            calls = {
                "direct": (f"{self.engine}/generate", {"input_ids": ids, "sampling_params": self.params(i),
                                                      "return_logprob": True}),
                "null_proxy": (f"{self.proxy}/generate", {"input_ids": ids, "sampling_params": self.params(i),
                                                         "return_logprob": True}),
                "gateway_generate": (f"{self.gateway}/sessions/{sid_a}/generate",
                                     {"input_ids": ids, "sampling_params": self.params(i)}),
                "gateway_chat": (f"{self.gateway}/sessions/{sid_b}/v1/chat/completions",
                                 {"messages": messages, "max_tokens": self.max_tokens, "temperature": 1.0, "seed": i}),
            }
            order = list(calls)[i % 4:] + list(calls)[:i % 4]
            for name in order:
                elapsed, outside_engine = await self.timed(*calls[name])
                if i >= 10:  # warm-up rounds are dropped
                    paths[name].append(elapsed)
                    outside[name].append(outside_engine)
        result = {name: summary_ms(values) for name, values in paths.items()}
        result["outside_engine"] = {name: summary_ms(values) for name, values in outside.items()}
        for name in ("null_proxy", "gateway_generate", "gateway_chat"):
            diffs = [g - d for g, d in zip(outside[name], outside["direct"])]
            result[f"{name}_overhead"] = {
                "p50_ms": round(percentile(diffs, 0.5) * 1e3, 3), "p99_ms": round(percentile(diffs, 0.99) * 1e3, 3),
                "p50_difference_ms": round(result["outside_engine"][name]["p50_ms"]
                                           - result["outside_engine"]["direct"]["p50_ms"], 3),
                "raw_p50_difference_ms": round(result[name]["p50_ms"] - result["direct"]["p50_ms"], 3)}
        return result

    # 2. load ----------------------------------------------------------------------------------------
    async def agent(self, k: int, sid: str | None, deadline: float, stats: dict) -> None:
        """An agent loop: chat turns on a growing conversation until the deadline (sid None: the
        client renders the prompt and calls the engine itself)."""
        messages = [{"role": "user", "content": f"Task {k}: list the files."}]
        turn = 0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                if sid is not None:
                    reply = await self.post(f"{self.gateway}/sessions/{sid}/v1/chat/completions", {
                        "messages": messages, "max_tokens": self.max_tokens, "temperature": 1.0, "seed": k * 100 + turn})
                    message = reply["choices"][0]["message"]
                else:
                    ids = self.template.render(messages, add_generation_prompt=True)
                    out = await self.post(f"{self.engine}/generate", {"input_ids": ids, "return_logprob": True,
                                                                      "sampling_params": self.params(k * 100 + turn)})
                    message = self.template.parse_assistant(out["output_ids"]).to_openai()
            except (httpx.HTTPError, KeyError) as err:
                stats["errors"].append(f"{type(err).__name__}: {err}")
                await asyncio.sleep(0.5)
                continue
            stats["latency"].append(time.perf_counter() - started)
            stats["done_at"].append(time.monotonic())
            turn += 1
            messages = (messages + [message, {"role": "user", "content": f"Next {turn}."}]) \
                if turn % 4 else messages[:1]  # an episode of 4 turns ends; the agent starts over

    async def engine_counters(self) -> dict[str, float]:
        """Prompt / prefix-cached / generated token totals of the engine (its Prometheus counters)."""
        text = (await self.http.get(f"{self.engine}/metrics")).text
        names = ("sglang_prompt_tokens_total", "sglang_cached_tokens_total", "sglang_generation_tokens_total")
        return {name.split("_")[1]: float(line.split()[-1]) for line in text.splitlines() for name in names
                if line.startswith(name + " ")}

    def cpu_seconds(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}

    async def load(self, duration: float, gateway_sessions: int, direct_agents: int) -> dict:
        """Agents through the gateway and straight to the engine, all at once, for `duration` s;
        requests/s counts turns completed inside the window, per path."""
        stats = {path: {"latency": [], "done_at": [], "errors": []} for path in ("gateway", "direct")}
        cpu_before, tokens_before = self.cpu_seconds(), await self.engine_counters()
        sids = await asyncio.gather(*(self.session() for _ in range(gateway_sessions)))
        started = time.monotonic()
        deadline = started + duration
        await asyncio.gather(*(self.agent(k, sid, deadline, stats["gateway"]) for k, sid in enumerate(sids)),
                             *(self.agent(gateway_sessions + k, None, deadline, stats["direct"])
                               for k in range(direct_agents)))
        drained = time.monotonic() - started
        cpu = {name: round(used - cpu_before[name], 1) for name, used in self.cpu_seconds().items()}
        tokens = {name: int(total - tokens_before[name]) for name, total in (await self.engine_counters()).items()}
        finished = await asyncio.gather(*(self.post(f"{self.gateway}/sessions/{sid}/finish", {"reward": 1.0})
                                          for sid in sids))
        phase = {"gateway_sessions": gateway_sessions, "direct_agents": direct_agents, "window_s": duration,
                 "drained_s": round(drained, 1), "cpu_s": cpu, "engine_tokens": tokens,
                 "finished_sessions": len(finished), "samples_written": sum(len(f["sample_refs"]) for f in finished)}
        for path, st in stats.items():
            in_window = sum(1 for t in st["done_at"] if t <= deadline)
            phase[path] = {"requests": len(st["latency"]), "requests_in_window": in_window,
                           "requests_per_s": round(in_window / duration, 1), "errors": len(st["errors"]),
                           "error_examples": st["errors"][:5],
                           "latency": summary_ms(st["latency"]) if st["latency"] else {}}
        return phase


async def run(args: argparse.Namespace, engine: str, gateway: str, proxy: str, pids: dict[str, int]) -> dict:
    template = GlmChatTemplate(load_tokenizer("builtin:tiny"))
    bench = Bench(engine, gateway, proxy, template, args.max_tokens, pids)
    results: dict = {"latency": await bench.latency(args.rounds)}
    if args.sessions:
        # The gateway alone with N sessions (the target), then gateway and direct side by side at N/2 each:
        # same minute, same engine, same machine load (others share these two cores), so the ratio is fair.
        results["load"] = [await bench.load(args.duration, args.sessions, 0),
                           await bench.load(args.duration, args.sessions // 2, args.sessions // 2)]
    await bench.http.aclose()
    return results


def markdown(report: dict) -> str:
    lat = report["results"]["latency"]
    lines = [f"# Gateway benchmark\n\nCommand: `{report['command']}`\n",
             f"Machine: {report['machine']}. Load average before / after: {report['load_before']} / "
             f"{report['load_after']}. Engine: built-in CPU engine, random tiny GLM-5, "
             f"max_new_tokens={report['max_tokens']}.\n",
             "## Latency at concurrency 1 (same prompt four ways per round, rotating order)\n",
             "`null_proxy` forwards bytes and does nothing else (bench/null_proxy.py): the floor of any HTTP hop here. "
             "Overheads are of the time outside the engine (client latency minus the engine's own e2e_latency).\n",
             "| path | p50 ms | p99 ms | mean ms |", "|---|---|---|---|"]
    for name in ("direct", "null_proxy", "gateway_generate", "gateway_chat"):
        lines.append(f"| {name} | {lat[name]['p50_ms']} | {lat[name]['p99_ms']} | {lat[name]['mean_ms']} |")
    lines += ["", "| added to the direct call | p50 of per-round difference ms | p99 ms | difference of p50s ms |",
              "|---|---|---|---|"]
    for name in ("null_proxy", "gateway_generate", "gateway_chat"):
        o = lat[f"{name}_overhead"]
        lines.append(f"| {name} | {o['p50_ms']} | {o['p99_ms']} | {o['p50_difference_ms']} |")
    if "load" in report["results"]:
        lines += ["", "## Sustained load (agent loops: 4-turn conversations, then a new episode)", "",
                  "| phase | path | agents | requests/s | requests (all) | errors | p50 ms | p99 ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for i, phase in enumerate(report["results"]["load"]):
            for path, agents in (("gateway", phase["gateway_sessions"]), ("direct", phase["direct_agents"])):
                r = phase[path]
                if agents:
                    lines.append(f"| {i} | {path} | {agents} | {r['requests_per_s']} | {r['requests']} | {r['errors']} | "
                                 f"{r['latency'].get('p50_ms')} | {r['latency'].get('p99_ms')} |")
        lines += ["", "| phase | window s | drained s | sessions finished | samples written | CPU s (engine / gateway / "
                  "client) | engine prompt / cached / generated tokens |", "|---|---|---|---|---|---|---|"]
        for i, phase in enumerate(report["results"]["load"]):
            cpu, tok = phase["cpu_s"], phase["engine_tokens"]
            lines.append(f"| {i} | {phase['window_s']} | {phase['drained_s']} | {phase['finished_sessions']} | "
                         f"{phase['samples_written']} | {cpu['engine']} / {cpu['gateway']} / {cpu['bench_client']} | "
                         f"{tok.get('prompt')} / {tok.get('cached')} / {tok.get('generation')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--sessions", type=int, default=1000, help="concurrent sessions of the load phase (0 skips it)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each load phase")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", help="write <out>.json and <out>.md")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    checkpoint = workdir / "tiny"
    save_pretrained(Glm5ForCausalLM.from_config(load_model_section("tiny").arch, seed=0), checkpoint)
    redis = EmbeddedRedis(workdir / "redis").start()
    procs = []
    try:
        engine_proc, engine = start("rollout.server", ["--model", str(checkpoint), "--max-running-requests", "256"],
                                    workdir, "engine")
        procs.append(engine_proc)
        gateway_proc, gateway = start("gateway.server", ["--engine", engine, "--redis-url", redis.url, "--run", "bench"],
                                      workdir, "gateway")
        procs.append(gateway_proc)
        proxy_proc, proxy = start("bench.null_proxy", ["--engine", engine], workdir, "null-proxy")
        procs.append(proxy_proc)
        load_before = os.getloadavg()
        results = asyncio.run(run(args, engine, gateway, proxy, {"engine": engine_proc.pid, "gateway": gateway_proc.pid,
                                                          "bench_client": os.getpid()}))
        report = {"command": "python " + " ".join(sys.argv), "machine": f"{os.cpu_count()} CPUs, shared",
                  "load_before": [round(x, 2) for x in load_before],
                  "load_after": [round(x, 2) for x in os.getloadavg()], "max_tokens": args.max_tokens,
                  "results": results}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
        redis.stop()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
