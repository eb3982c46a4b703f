"""Orchestrator at 1,024 and 4,096 episodes in flight against fast env services, next to a bare
dispatcher on the same services in the same run.

    python bench/orchestrator_bench.py                 # writes bench/results/orchestrator_bench.{json,md}
    python bench/orchestrator_bench.py --concurrency 1024 --window-s 20

Per concurrency C: an embedded redis-server, `services` env services (TimedEnv: an SDK env whose
episode sleeps C / rate seconds, +-50% by its seed, and calls no LLM; capacity C / services each),
and `asyncrl orchestrator serve` (endpoint sessions, group_size 8, max_in_flight C). After a warm-up
of one episode length, a window of `window_s` measures:

- episodes/s finished, episodes in flight (min / mean, sampled every second);
- scheduling overhead p50/p99/max: from an episode being dispatchable (ready, and the event that
  freed its slot seen by the orchestrator) to its POST written to the socket (/v1/status?overhead_since);
- orchestrator CPU (cores, and ms per episode) and peak RSS (psutil); env services' CPU for context.

The peer: `bare`, a loop of aiohttp POSTs keeping C episodes in flight on the same services with no
registry, groups, Redis or metrics: the floor of dispatch cost. Their CPU-per-episode ratio is what
the orchestrator's bookkeeping costs. The machine is shared and noisy: load averages are recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402
from bench.procs import Proc  # noqa: E402

ENV = "tests.orchestrator.timed_env.TimedEnv"
GROUP_SIZE = 8


def start_services(workdir: Path, count: int, capacity: int, sleep_s: float) -> tuple[list[Proc], list[str]]:
    procs = [Proc(workdir, f"env{i}", [sys.executable, "-m", "envs.serve", "--env", ENV, "--capacity", str(capacity),
                                       "--option", f"sleep_s={sleep_s}", "--option", "jitter=0.5",
                                       "--option", "num_tasks=1000", "--log-level", "WARNING"])
             for i in range(count)]
    return procs, [p.wait_url() for p in procs]


def measure_window(cpu_procs: dict[str, list[Proc]], window_s: float, sample) -> dict:
    """CPU seconds per group of processes, peak RSS of the first, and `sample()` every second."""
    cpu0 = {k: sum(p.cpu_s() for p in ps) for k, ps in cpu_procs.items()}
    started, samples, rss = time.monotonic(), [], []
    while time.monotonic() - started < window_s:
        time.sleep(1.0)
        samples.append(sample())
        rss.append(next(iter(cpu_procs.values()))[0].ps.memory_info().rss)
    wall = time.monotonic() - started
    cpu = {k: sum(p.cpu_s() for p in ps) - cpu0[k] for k, ps in cpu_procs.items()}
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": max(rss) / 2**20, "samples": samples}


def bench_orchestrator(workdir: Path, concurrency: int, services: list[str], env_procs: list[Proc],
                       sleep_s: float, window_s: float, nice: int) -> dict:
    redis = EmbeddedRedis(workdir / "redis").start()
    orch = Proc(workdir, "orchestrator", [
        sys.executable, "-m", "orchestrator.server", "--redis-url", redis.url, "--run", f"bench{concurrency}",
        "--llm-url", "http://127.0.0.1:9/v1", "--max-in-flight", str(concurrency), "--group-size", str(GROUP_SIZE),
        "--max-unconsumed-groups", "0", "--heartbeat-interval-s", "5", "--heartbeat-timeout-s", "60",
        "--episode-timeout-s", str(10 * sleep_s), "--log-level", "WARNING"], priority=nice)
    try:
        http = httpx.Client(base_url=orch.wait_url(), timeout=60)
        for url in services:
            http.post("/v1/envs", json={"name": "timed", "domain": "bench", "url": url, "heartbeat": "probe",
                                        "capacity": concurrency // len(services)}).raise_for_status()
        deadline = time.monotonic() + 120
        while http.get("/v1/status").json()["in_flight"] < 0.95 * concurrency:
            if time.monotonic() > deadline:
                raise RuntimeError(f"in flight never reached {concurrency}: {http.get('/v1/status').json()}")
            time.sleep(0.5)
        time.sleep(1.5 * sleep_s)  # one episode length more: completions are spread out by the jitter
        before, since = http.get("/v1/status").json(), time.time()
        window = measure_window({"orchestrator": [orch], "env_services": env_procs}, window_s,
                                lambda: http.get("/v1/status").json()["in_flight"])
        after = http.get("/v1/status", params={"overhead_since": since}).json()
    finally:
        orch.stop()
        redis.stop()
    episodes = after["completed"] - before["completed"]
    overhead = after["dispatch_overhead"]
    return {
        "episodes_per_s": round(episodes / window["wall_s"], 1),
        "in_flight_min": min(window["samples"]), "in_flight_mean": round(sum(window["samples"]) / len(window["samples"])),
        "overhead_p50_ms": round(overhead["p50_ms"], 2), "overhead_p99_ms": round(overhead["p99_ms"], 2),
        "overhead_max_ms": round(overhead["max_ms"], 2), "dispatches_in_window": overhead["count"],
        "orchestrator_cpu_cores": round(window["cpu_s"]["orchestrator"] / window["wall_s"], 3),
        "orchestrator_cpu_ms_per_episode": round(1000 * window["cpu_s"]["orchestrator"] / max(episodes, 1), 3),
        "orchestrator_peak_rss_mb": round(window["peak_rss_mb"], 1),
        "env_services_cpu_cores": round(window["cpu_s"]["env_services"] / window["wall_s"], 3),
        "retried": after["retried"] - before["retried"], "failed": after["failed"] - before["failed"],
    }


def bench_bare(workdir: Path, concurrency: int, services: list[str], env_procs: list[Proc], sleep_s: float,
               window_s: float) -> dict:
    counter = workdir / "bare.count"
    bare = Proc(workdir, "bare", [sys.executable, str(Path(__file__).resolve()), "bare", "--concurrency",
                                  str(concurrency), "--count-file", str(counter), *itertools.chain.from_iterable(
                                      ("--service", url) for url in services)])
    try:
        bare.wait_url()
        time.sleep(2.5 * sleep_s)
        before = int(counter.read_text())
        window = measure_window({"bare": [bare], "env_services": env_procs}, window_s, lambda: int(counter.read_text()))
        episodes = int(counter.read_text()) - before
    finally:
        bare.stop()
    return {"episodes_per_s": round(episodes / window["wall_s"], 1),
            "cpu_cores": round(window["cpu_s"]["bare"] / window["wall_s"], 3),
            "cpu_ms_per_episode": round(1000 * window["cpu_s"]["bare"] / max(episodes, 1), 3),
            "peak_rss_mb": round(window["peak_rss_mb"], 1)}


async def bare_dispatcher(args: argparse.Namespace) -> None:
    """The peer: keep `concurrency` episodes in flight with plain aiohttp, nothing else."""
    import aiohttp
    import orjson

    done, ids = 0, itertools.count()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def worker(url: str) -> None:
            nonlocal done
            while True:
                i = next(ids)
                body = {"episode_id": f"bare-{i}", "task_id": f"t-{i % 1000:04d}", "seed": i,
                        "llm": {"base_url": "http://127.0.0.1:9/v1"}, "max_turns": 1, "deadline_s": 600}
                async with http.post(f"{url}/episodes", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                if resp.status == 200:
                    done += 1
                else:  # 429 while the service still winds down the orchestrator's episodes
                    await asyncio.sleep(0.1)

        workers = [asyncio.create_task(worker(args.service[i % len(args.service)])) for i in range(args.concurrency)]
        Path(args.url_file).write_text("bare://running")
        while True:
            await asyncio.sleep(0.5)
            tmp = Path(args.count_file).with_suffix(".tmp")
            tmp.write_text(str(done))
            tmp.replace(args.count_file)
            if any(w.done() for w in workers):
                raise RuntimeError(next(w for w in workers if w.done()).exception())


def to_markdown(report: dict) -> str:
    lines = [f"# Orchestrator benchmark\n\nCommand: `{report['command']}`\n\nMachine: {report['machine']}. "
             f"{report['method']}\n",
             "| in flight | orch nice | episode s | episodes/s | in flight min/mean | overhead p50 / p99 / max ms | "
             "orch CPU cores | orch CPU ms/episode | orch peak RSS MB | bare CPU ms/episode | orch/bare CPU | "
             "env services CPU cores | load before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        o, b = r["orchestrator"], r["bare"]
        lines.append(f"| {r['concurrency']} | {r['orchestrator_nice']:+d} | {r['episode_s']} | {o['episodes_per_s']} | {o['in_flight_min']} / "
                     f"{o['in_flight_mean']} | {o['overhead_p50_ms']} / {o['overhead_p99_ms']} / {o['overhead_max_ms']} | "
                     f"{o['orchestrator_cpu_cores']} | {o['orchestrator_cpu_ms_per_episode']} | "
                     f"{o['orchestrator_peak_rss_mb']} | {b['cpu_ms_per_episode']} | {r['orch_over_bare_cpu']} | "
                     f"{o['env_services_cpu_cores']} | {r['load_before']} / {r['load_after']} |")
    lines.append(f"\nTarget: >= 1,024 in flight with p99 overhead <= 50 ms: "
                 f"{'met' if report['target_met'] else 'NOT met'} (see JSON for every figure).")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="bench", choices=["bench", "bare"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rate", type=float, default=200.0, help="target episodes/s: episode length = concurrency / rate")
    p.add_argument("--services", type=int, default=4)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "orchestrator_bench"))
    p.add_argument("--orchestrator-nice", type=int, nargs="+", default=[0],
                   help="niceness increments of the orchestrator process to run (negative = priority over the env "
                        "services and everything else on the machine)")
    p.add_argument("--keep-logs", help="write the processes' logs under this directory (default: a temporary one)")
    p.add_argument("--service", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--count-file", help=argparse.SUPPRESS)
    p.add_argument("--url-file", help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "bare":
        args.concurrency = args.concurrency[0]
        asyncio.run(bare_dispatcher(args))
        return
    runs = []
    for concurrency, nice in itertools.product(args.concurrency, args.orchestrator_nice):
        sleep_s = round(concurrency / args.rate, 2)
        with tempfile.TemporaryDirectory(prefix="orch-bench-") as tmp:
            workdir = Path(args.keep_logs or tmp) / str(concurrency)
            workdir.mkdir(parents=True, exist_ok=True)
            load_before = round(os.getloadavg()[0], 1)
            env_procs, urls = start_services(workdir, args.services, math.ceil(concurrency / args.services), sleep_s)
            try:
                orchestrator = bench_orchestrator(workdir, concurrency, urls, env_procs, sleep_s, args.window_s, nice)
                bare = bench_bare(workdir, concurrency, urls, env_procs, sleep_s, args.window_s)
            finally:
                for proc in env_procs:
                    proc.stop()
        ratio = orchestrator["orchestrator_cpu_ms_per_episode"] / max(bare["cpu_ms_per_episode"], 1e-9)
        runs.append({"concurrency": concurrency, "orchestrator_nice": nice, "episode_s": sleep_s,
                     "orchestrator": orchestrator, "bare": bare,
                     "orch_over_bare_cpu": round(ratio, 2), "load_before": load_before,
                     "load_after": round(os.getloadavg()[0], 1)})
        print(json.dumps(runs[-1]), flush=True)
    report = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                         else sys.argv[0], *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs), Python "
                   f"{platform.python_version()}",
        "method": f"{args.services} TimedEnv services, group_size {GROUP_SIZE}, episodes of concurrency/{args.rate:g} s "
                  f"+-50%, window {args.window_s:g} s after warm-up; peer = bare aiohttp dispatcher on the same services.",
        "runs": runs,
        "target_met": any(r["concurrency"] >= 1024 and r["orchestrator"]["in_flight_min"] >= 1024 * 0.95
                          and r["orchestrator"]["overhead_p99_ms"] <= 50 for r in runs),
    }
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
