"""The control plane at cluster scale: 64 stand-in engines behind the real gateway, orchestrator and Redis,
4,096 multi-turn episodes in flight, one weight push to every engine, one engine killed and restarted.

    python bench/control_plane_scale.py                  # writes bench/results/control_plane_scale.{json,md}
    python bench/control_plane_scale.py --engines 8 --episodes 256 --window-s 30 --tool-s 4 --out /tmp/cps

Processes: an embedded redis-server (AOF on, as the launcher runs it); stand-in engines
(bench/standin_engine.py, `--engines-per-process` to a process, the victim engine alone in one) registered
in the run's `engines` hash; the gateway following that registry; the orchestrator (`sessions: gateway`,
group_size 8, max_in_flight = episodes, no backpressure); env services running ToolLoopEnv
(bench/tool_loop_env.py: `turns` chat calls through the episode's gateway session, `tool_s` +-50% of tool
time between them, the conversation growing each turn). The first wave of episodes starts spread over one
episode length (ToolLoopEnv's ramp); after in-flight reaches 95% and a warm-up of 1.3 episode lengths (the
completion rate is steady by then), a window of `window_s`:

- at 20% and 35% of it, a weight push with the trainer's own code (trainer.weight_push.WeightSync, method
  tensor, pause_mode in_place, verify_weights on, a 4 KB payload): pause / update / continue fan-out times;
- at 50%, the victim engine is SIGKILLed and restarted on its port `down_s` later;
- measured: gateway added latency (its asyncrl_gateway_added_latency_seconds histogram: turn time minus the
  engines' own seconds; split into its own time, asyncrl_gateway_own_latency_seconds, and the engine hop,
  asyncrl_gateway_engine_hop_seconds, which a client calling the engine directly pays too; and the env
  clients' wall time minus the engines' own seconds), orchestrator dispatch overhead (/v1/status?overhead_since),
  requests per engine (gateway /engines), cached-token ratio (the engines' counters), CPU seconds and peak
  RSS per component (psutil), Redis used_memory against recorded samples every 2 s; and the machine's floor
  under the hop, a null HTTP round trip from the gateway's CPU to the engines' every 20 ms (bench/hop_probe.py,
  at SCHED_FIFO: nothing of the run delays it, so what does is the machine's).
Then the orchestrator is paused and the groups in flight drain: every group started must be in the
`groups` stream with all its samples (zero lost), and sessions' engine sequences (GET /sessions/{sid} of up
to 1,000 recorded sessions) give the prefix affinity: turns after the first on the previous turn's engine.
The machine is shared: load averages are recorded. On a cluster the gateway, the engines and the env
services run on nodes of their own; here they share 2 cores. By default (`--gateway-cpus 0`) the gateway
has CPU 0 and the engines, the orchestrator, Redis and the weight push the other CPUs; the env services run
on every CPU as SCHED_IDLE (`--load-priority idle`: they take only CPU time the others leave, and do not
starve when a push takes the other CPU, which made their turns come in bursts) and the engines at nice 0
(`--engine-priority 0`: they answer as promptly as engines on nodes of their own). `--env-cpus 1` keeps the
env services off the gateway's CPU (bench/results/control_plane_scale_env_cpu1.md); `--gateway-cpus ''`
shares every CPU among all processes (control_plane_scale_engines_nice0.md, and with `--engine-priority idle`
control_plane_scale_engines_idle.md); `--load-priority 10` runs the env services at nice 10,
`--load-priority 0` at equal priority (control_plane_scale_nice{10,0}.md, before the GC fixes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402
from bench.procs import (Measured, Priority, Proc, fifo_permitted, parse_cpus, parse_priority,  # noqa: E402
                         policy_name)

RUN = "scale"
GROUP_SIZE = 8
MAX_NEW_TOKENS = 48
ENV = "bench.tool_loop_env.ToolLoopEnv"
AFFINITY_SESSIONS = 1000
USABLE_CPUS = frozenset(os.sched_getaffinity(0))


def key(name: str) -> str:
    return f"asyncrl:{RUN}:{name}"


# Processes ------------------------------------------------------------------------------------------------
class Fleet:
    """The stand-in engines: the victim alone in a process (killed and restarted on its port), the rest packed."""

    def __init__(self, workdir: Path, count: int, per_process: int, model_args: list[str], priority: Priority) -> None:
        self.workdir, self.model_args, self.priority = workdir, model_args, priority
        cmd = [sys.executable, "-m", "bench.standin_engine", *model_args]
        self.victim = Proc(workdir, "engine-victim", [*cmd, "--engines", "1", "--name", "victim"], priority=priority)
        sizes = [per_process] * ((count - 1) // per_process) + ([(count - 1) % per_process] if (count - 1) % per_process else [])
        self.packed = [Proc(workdir, f"engines{i}", [*cmd, "--engines", str(n), "--name", f"p{i}-"], priority=priority)
                       for i, n in enumerate(sizes)]
        self.victim_url = self.victim.wait_url()
        self.urls = [self.victim_url] + [u for p in self.packed for u in p.wait_url().splitlines()]
        self.dead_cpu_s = 0.0
        """CPU seconds of victim processes killed so far."""

    @property
    def procs(self) -> list[Proc]:
        return [self.victim, *self.packed]

    def kill_victim(self) -> None:
        self.dead_cpu_s += self.victim.cpu_s()
        self.victim.kill()

    def restart_victim(self) -> None:
        port = int(self.victim_url.rsplit(":", 1)[1])
        self.victim = Proc(self.workdir, "engine-victim", [sys.executable, "-m", "bench.standin_engine",
                                                           *self.model_args, "--engines", "1", "--name", "victim"],
                           priority=self.priority, port=port)
        self.victim.wait_url()

    def cpu_s(self) -> float:
        return self.dead_cpu_s + sum(p.cpu_s() for p in self.procs)


def start_stack(args: argparse.Namespace, workdir: Path) -> dict:
    model = ["--ttft-s", str(args.ttft_s), "--decode-s-per-token", str(args.decode_s_per_token),
             "--prefill-s-per-token", str(args.prefill_s_per_token), "--min-out", "16", "--max-out", str(MAX_NEW_TOKENS)]
    redis_server = EmbeddedRedis(workdir / "redis").start()
    stack = {"redis": redis_server}
    fleet = stack["fleet"] = Fleet(workdir, args.engines, args.engines_per_process, model, args.engine_priority)
    r = redis.Redis.from_url(redis_server.url)
    r.hset(key("engines"), mapping={f"engine-{i:03d}": url for i, url in enumerate(fleet.urls)})
    # the first gateway on --gateway-cpus, a second (--gateways 2) on the other CPUs, beside the rest
    gateway_cpus = [args.gateway_cpus, frozenset(USABLE_CPUS - args.gateway_cpus)][:args.gateways]
    gateways = stack["gateways"] = [Proc(workdir, "gateway" if i == 0 else f"gateway-{i}", [
        sys.executable, "-m", "gateway.server", "--redis-url", redis_server.url, "--run", RUN, "--engines-from-redis",
        "--finished-session-ttl-s", "3600", "--engine-wait-s", "120"], priority=args.gateway_priority,
        cpus=cpus) for i, cpus in enumerate(gateway_cpus)]
    stack["gateway"] = gateways[0]
    stack["gateway_urls"] = [g.wait_url() for g in gateways]
    gateway_url = stack["gateway_url"] = stack["gateway_urls"][0]
    if args.hop_probe_interval_s > 0:  # the null hop: its server where the engines run, its client where the gateway
        server = stack["hop_server"] = Proc(workdir, "hop-server", [sys.executable, "-m", "bench.hop_probe", "serve"],
                                            priority=args.hop_probe_priority)
        stack["hop_probe"] = Proc(workdir, "hop-probe", [sys.executable, "-m", "bench.hop_probe", "probe", "--target",
                                                         server.wait_url(), "--interval-s", str(args.hop_probe_interval_s)],
                                  priority=args.hop_probe_priority, cpus=args.gateway_cpus)
        stack["hop_probe_url"] = stack["hop_probe"].wait_url()
        stack["hop_probe_priority"] = args.hop_probe_priority
    orch = stack["orchestrator"] = Proc(workdir, "orchestrator", [
        sys.executable, "-m", "orchestrator.server", "--redis-url", redis_server.url, "--run", RUN, "--gateway",
        ",".join(stack["gateway_urls"]), "--max-in-flight", str(args.episodes), "--group-size", str(GROUP_SIZE),
        "--max-unconsumed-groups", "0", "--heartbeat-interval-s", "5", "--heartbeat-timeout-s", "60",
        "--episode-timeout-s", str(20 * episode_s(args)), "--sampling", json.dumps({"max_new_tokens": MAX_NEW_TOKENS}),
        "--log-level", "WARNING"])
    stack["orchestrator_url"] = orch.wait_url()
    stats = workdir / "client_stats"
    stats.mkdir(exist_ok=True)
    capacity = math.ceil(args.episodes / args.env_services) + GROUP_SIZE
    options = {"turns": args.turns, "tool_s": args.tool_s, "jitter": 0.5, "ramp_s": episode_s(args),
               "ramp_episodes": capacity, "stats_dir": str(stats)}
    stack["envs"] = [Proc(workdir, f"env{i}", [sys.executable, "-m", "envs.serve", "--env", ENV, "--capacity",
                                               str(capacity), "--log-level", "WARNING",
                                               *[a for k, v in options.items() for a in ("--option", f"{k}={v}")]],
                          priority=args.load_priority, cpus=args.env_cpus)
                     for i in range(args.env_services)]
    http = httpx.Client(base_url=stack["orchestrator_url"], timeout=60)
    for env in stack["envs"]:
        http.post("/v1/envs", json={"name": "tool_loop", "domain": "bench", "url": env.wait_url(),
                                    "heartbeat": "probe", "capacity": capacity}).raise_for_status()
    stack["stats_dir"] = stats
    return stack


def stop_stack(stack: dict) -> None:
    """SIGTERM to every child at once (env services drain for up to 30 s each), then wait for each."""
    procs = [*stack.get("envs", []), stack.get("orchestrator"), *stack.get("gateways", []), stack.get("hop_probe"),
             stack.get("hop_server"),
             *(stack["fleet"].procs if "fleet" in stack else [])]
    procs = [p for p in procs if p is not None and p.popen.poll() is None]
    for proc in procs:
        proc.popen.terminate()
    for proc in procs:
        proc.stop()
    if "redis" in stack:
        stack["redis"].stop()


def cpu_layout(args: argparse.Namespace) -> str:
    if not args.gateway_cpus:
        return "every process on every CPU"
    rest = sorted(USABLE_CPUS - args.gateway_cpus)
    second = f" (a second gateway on CPU {rest})" if args.gateways == 2 else ""
    return (f"the gateway on CPU {sorted(args.gateway_cpus)}{second}, the env services on CPU {sorted(args.env_cpus)}, "
            f"every other process on CPU {rest}")


def priority_words(priority: Priority) -> str:
    return {"idle": "SCHED_IDLE", "fifo": "SCHED_FIFO"}.get(str(priority), f"nice {priority}")


def episode_s(args: argparse.Namespace) -> float:
    """Mean episode length after the ramp: tool time and model time."""
    turn = args.ttft_s + (16 + MAX_NEW_TOKENS) / 2 * args.decode_s_per_token
    return (args.turns - 1) * args.tool_s + args.turns * turn


# Measurements ---------------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Every `every_s`: Redis used_memory and samples recorded, each component's RSS."""

    def __init__(self, stack: dict, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.stack, self.every_s = stack, every_s
        self.redis = redis.Redis.from_url(stack["redis"].url)
        self.rows: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                self.rows.append({"t": time.time(), "used_memory": self.redis.info("memory")["used_memory"],
                                  "samples": self.redis.xlen(key("samples")),
                                  "rss": {name: sum(p.rss() for p in procs) for name, procs in groups(self.stack).items()}})
            except Exception:  # noqa: BLE001 - a process restarting (the victim) between listing and reading
                continue


def groups(stack: dict) -> dict[str, list[Measured]]:
    return {"gateway": stack["gateways"], "orchestrator": [stack["orchestrator"]],
            "redis": [Measured(stack["redis"].process.pid)], "env_services": stack["envs"],
            "engines": stack["fleet"].procs}


def cpu_snapshot(stack: dict) -> dict[str, float]:
    snap = {name: sum(p.cpu_s() for p in procs) for name, procs in groups(stack).items() if name != "engines"}
    snap["engines"] = stack["fleet"].cpu_s()
    return snap


def histogram(text: str, name: str, label: str = "") -> dict[float, float]:
    """Cumulative bucket counts (le -> count) of a histogram, summed over its label sets (those with `label`,
    e.g. 'generation="2"', when given)."""
    buckets: dict[float, float] = {}
    for labels, le, value in re.findall(rf'^{name}_bucket{{(.*?le="([^"]+)".*?)}} (\S+)$', text, re.M):
        if label in labels:
            buckets[float(le)] = buckets.get(float(le), 0.0) + float(value)
    return buckets


def window_quantiles(before: str, after: str, name: str) -> dict[str, float]:
    """p50 / p99 (ms) and count of one gateway histogram's observations inside the window."""
    b0, b1 = histogram(before, name), histogram(after, name)
    window = {le: b1[le] - b0.get(le, 0.0) for le in b1}
    return {"p50_ms": round(1e3 * quantile(window, 0.5), 3), "p99_ms": round(1e3 * quantile(window, 0.99), 3),
            "n": int(window[math.inf])}


def gc_pauses(before: str, after: str) -> dict[str, dict]:
    """The gateway's GC collections in the window, per generation: how many, their seconds, how many > 10 ms."""
    out = {}
    for generation in range(3):
        label = f'generation="{generation}"'
        b0, b1 = histogram(before, "asyncrl_gateway_gc_pause_seconds", label), histogram(after, "asyncrl_gateway_gc_pause_seconds", label)
        delta = {le: b1[le] - b0.get(le, 0.0) for le in b1}
        sums = [sum(float(v) for v in re.findall(rf'^asyncrl_gateway_gc_pause_seconds_sum{{{label}}} (\S+)$', t, re.M))
                for t in (before, after)]
        out[str(generation)] = {"count": int(delta.get(math.inf, 0)), "seconds": round(sums[1] - sums[0], 3),
                                "over_10ms": int(delta.get(math.inf, 0) - delta.get(0.01, 0))}
    return out


def quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus histogram_quantile: linear interpolation inside the bucket holding the quantile."""
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    rank, lower, below = q * total, 0.0, 0.0
    for edge in edges:
        if buckets[edge] >= rank:
            if math.isinf(edge):
                return lower
            return lower + (edge - lower) * (rank - below) / max(buckets[edge] - below, 1e-12)
        lower, below = edge, buckets[edge]
    return lower


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def engine_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    with httpx.Client(timeout=30) as http:
        for url in urls:
            try:
                text = http.get(f"{url}/metrics").text
            except httpx.HTTPError:
                out[url] = {"prompt": 0.0, "cached": 0.0, "requests": 0.0, "health_checks": 0.0}
                continue
            out[url] = {"prompt": counter(text, "sglang_prompt_tokens_total"),
                        "cached": counter(text, "sglang_cached_tokens_total"),
                        "requests": counter(text, "sglang_num_requests_total"),
                        "health_checks": counter(text, "standin_health_checks_total")}
    return out


def snapshot(stack: dict) -> dict:
    with httpx.Client(timeout=60) as http:
        metrics = "\n".join(http.get(f"{url}/metrics").text for url in stack["gateway_urls"])  # summed below
        engines: dict[str, int] = {}
        for url in stack["gateway_urls"]:
            for e in http.get(f"{url}/engines").json()["engines"]:
                engines[e["url"]] = engines.get(e["url"], 0) + e["requests"]
        status = http.get(f"{stack['orchestrator_url']}/v1/status").json()
    return {"t": time.time(), "mono": time.monotonic(), "cpu": cpu_snapshot(stack), "metrics": metrics,
            "engine_requests": engines, "status": status, "engine_counters": engine_counters(stack["fleet"].urls)}


# The weight push ------------------------------------------------------------------------------------------
class TinyBackend:
    """What WeightSync needs of a trainer backend: a 4 KB state dict (the transfer is not what is measured)."""

    def __init__(self) -> None:
        import torch

        self.tensors = {"model.embed_tokens.weight": torch.randn(16, 64), "model.norm.weight": torch.randn(64)}

    def hf_state_dict(self):
        return self.tensors

    def hf_config(self):
        raise RuntimeError("no snapshot in this benchmark: a push that failed an engine asks for one")


def push(redis_url: str, version: int, workdir: Path) -> dict:
    """One WeightSync.push (imported before the window: torch takes seconds to import)."""
    from asyncrl.config import WeightPushConfig
    from asyncrl.store import Store
    from trainer.weight_push import WeightSync

    async def run() -> dict:
        store = Store.connect(redis_url, RUN)
        sync = WeightSync(WeightPushConfig(method="tensor", pause_mode="in_place", snapshot_every_pushes=10 ** 6,
                                           timeout_s=60), store, workdir / "weights")
        try:
            report = await sync.push(TinyBackend(), version)
        finally:
            await sync.close()
            await store.close()
        return {"version": version, "engines": report.engines, "bytes": report.bytes,
                "pause_s": round(report.pause_s, 4), "update_s": round(report.update_s, 4),
                "resume_s": round(report.resume_s, 4), "total_s": round(report.total_s, 4),
                "fan_out_s": round(report.pause_s + report.update_s + report.resume_s, 4),
                "failed": report.failed}
    return asyncio.run(run())


# Drain and check ------------------------------------------------------------------------------------------
def drain(stack: dict, timeout_s: float) -> dict:
    """Pause the orchestrator and wait until no group is open; -> final status."""
    with httpx.Client(base_url=stack["orchestrator_url"], timeout=60) as http:
        http.post("/v1/pause").raise_for_status()
        deadline = time.monotonic() + timeout_s
        while True:
            status = http.get("/v1/status").json()
            if (status["groups_open"] == 0 and status["in_flight"] == 0 and status["settling"] == 0
                    and status["groups_recorded"] >= status["groups_completed"]) or time.monotonic() > deadline:
                return status
            time.sleep(1.0)


def check_groups(stack: dict, status: dict) -> dict:
    """Every group the orchestrator started is recorded, each with a sample per member, every sample present."""
    from asyncrl.types import GroupRecord

    r = redis.Redis.from_url(stack["redis"].url)
    records = [GroupRecord.decode(fields) for _, fields in r.xrange(key("groups"))]
    refs = [ref for g in records for ref in g.sample_refs]
    present = 0
    for i in range(0, len(refs), 500):
        pipe = r.pipeline(transaction=False)
        for ref in refs[i:i + 500]:
            pipe.xrange(key("samples"), ref, ref, count=1)
        present += sum(bool(entry) for entry in pipe.execute())
    started = status["groups_completed"] + status["groups_open"]
    return {"groups_started": started, "groups_recorded": len(records), "groups_open_after_drain": status["groups_open"],
            "groups_lost": started - len(records),
            "groups_short": sum(len(g.sample_refs) < GROUP_SIZE for g in records),
            "samples_missing": len(refs) - present, "episodes_failed": status["failed"],
            "episodes_retried": status["retried"], "samples_recorded": r.xlen(key("samples"))}


def affinity(stack: dict, since: float) -> dict:
    """Of sessions recorded after `since` (up to AFFINITY_SESSIONS, evenly spread): turns after the first on the
    previous turn's engine, and sessions whose turns all ran on one engine."""
    r = redis.Redis.from_url(stack["redis"].url)
    start_id = f"{int(since * 1000)}-0"
    entries = r.xrange(key("samples"), min=start_id)
    from asyncrl.types import Sample

    picked = entries[::max(1, len(entries) // AFFINITY_SESSIONS)][:AFFINITY_SESSIONS]
    same = later = single = 0
    with httpx.Client(base_url=stack["gateway_url"], timeout=60) as http:
        for _, fields in picked:
            sample = Sample.decode(fields[b"data"])
            record = http.get(f"/sessions/{sample.session_id}")
            if record.status_code != 200:
                continue
            engines = [t["engine"] for seg in record.json()["segments"] for t in seg["turns"]]
            same += sum(a == b for a, b in zip(engines, engines[1:]))
            later += max(len(engines) - 1, 0)
            single += len(set(engines)) == 1
    return {"sessions_read": len(picked), "turn_same_engine_fraction": round(same / max(later, 1), 4),
            "single_engine_session_fraction": round(single / max(len(picked), 1), 4)}


def redis_growth(rows: list[dict], since: float, until: float) -> dict:
    """Least-squares bytes per recorded sample over the window, and growth per minute."""
    window = [r for r in rows if since <= r["t"] <= until]
    if len(window) < 3:
        return {}
    xs, ys, ts = [r["samples"] for r in window], [r["used_memory"] for r in window], [r["t"] for r in window]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return {"bytes_per_1000_samples": round(1000 * slope), "mb_per_1000_samples": round(slope * 1000 / 2**20, 2),
            "growth_mb_per_min": round((ys[-1] - ys[0]) / 2**20 / ((ts[-1] - ts[0]) / 60), 2),
            "used_memory_mb_start": round(ys[0] / 2**20, 1), "used_memory_mb_end": round(ys[-1] / 2**20, 1),
            "samples_start": xs[0], "samples_end": xs[-1],
            "series": [{"t": round(r["t"] - rows[0]["t"], 1), "used_memory_mb": round(r["used_memory"] / 2**20, 2),
                        "samples": r["samples"]} for r in rows]}


def client_overhead(stats_dir: Path, since: float, until: float) -> dict:
    """Env clients' chat wall time minus the engines' own seconds, for turns finished in the window."""
    diffs = []
    for path in stats_dir.glob("*.tsv"):
        for line in path.read_text().splitlines():
            t, wall, engine = map(float, line.split("\t"))
            if since <= t <= until and not math.isnan(engine):
                diffs.append(wall - engine)
    return {"n": len(diffs), "p50_ms": round(1e3 * percentile(diffs, 0.5), 2),
            "p99_ms": round(1e3 * percentile(diffs, 0.99), 2)}


def null_hop(stack: dict, since: float, until: float) -> dict:
    """bench/hop_probe.py's round trips in the window (a request and reply of a turn's sizes, no work at either
    end) and its timer's lateness: the machine's floor under the gateway's engine hop."""
    if "hop_probe_url" not in stack:
        return {}
    samples = httpx.get(f"{stack['hop_probe_url']}/samples", params={"since": since, "until": until}, timeout=60).json()
    if not samples:
        return {}
    rtt, late = [s[1] for s in samples], [s[2] for s in samples]
    return {"priority": stack["hop_probe_priority"], "policy": policy_name(stack["hop_probe"].popen.pid),
            "n": len(samples), "p50_ms": round(1e3 * percentile(rtt, 0.5), 3),
            "p99_ms": round(1e3 * percentile(rtt, 0.99), 3), "max_ms": round(1e3 * max(rtt), 3),
            "timer_late_p99_ms": round(1e3 * percentile(late, 0.99), 3),
            "timer_late_over_2ms_per_s": round(sum(x > 0.002 for x in late) / (until - since), 3),
            "timer_late_max_ms": round(1e3 * max(late), 3)}


def balance(before: dict[str, float], after: dict[str, float], exclude: str = "") -> dict:
    counts = [after[u] - before.get(u, 0) for u in after if u != exclude]
    mean = statistics.fmean(counts)
    return {"engines": len(counts), "mean": round(mean, 1), "max_over_mean": round(max(counts) / mean, 3),
            "min_over_mean": round(min(counts) / mean, 3), "cv": round(statistics.pstdev(counts) / mean, 3)}


def health_checks(before: dict, after: dict, victim: str, wall_s: float) -> dict:
    """The gateway's /health probes the engines answered in the window, the victim left out (it is probed while
    it is down, and its counter restarts): with passive health an engine that answers turns is not probed."""
    probes = sum(end["health_checks"] - before[url]["health_checks"] for url, end in after.items() if url != victim)
    engines = len(after) - (victim in after)
    return {"probes": int(probes), "per_engine_per_s": round(probes / max(engines, 1) / wall_s, 4)}


def cached_ratio(before: dict, after: dict, victim: str, victim_at_kill: dict) -> dict:
    """Σ cached / Σ prompt tokens over the window; the victim's counters restart at zero with its process."""
    prompt = cached = 0.0
    for url, end in after.items():
        start = before.get(url, {"prompt": 0.0, "cached": 0.0})
        if url == victim and victim_at_kill:
            prompt += victim_at_kill["prompt"] - start["prompt"] + end["prompt"]
            cached += victim_at_kill["cached"] - start["cached"] + end["cached"]
        else:
            prompt += end["prompt"] - start["prompt"]
            cached += end["cached"] - start["cached"]
    return {"prompt_tokens": int(prompt), "cached_tokens": int(cached), "cached_ratio": round(cached / max(prompt, 1), 4)}


# The run --------------------------------------------------------------------------------------------------
def wait_in_flight(stack: dict, target: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=stack["orchestrator_url"], timeout=60) as http:
        while (status := http.get("/v1/status").json())["in_flight"] < 0.95 * target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"in flight never reached {target}: {status}")
            time.sleep(1.0)


def run_window(args: argparse.Namespace, stack: dict, workdir: Path) -> dict:
    """The measured window with its events (pushes, engine kill and restart)."""
    fleet = stack["fleet"]
    events, pushes, victim_at_kill = [], [], {}
    before = snapshot(stack)
    plan = [(0.2, "push"), (0.35, "push"), (0.5, "kill")]
    for fraction, what in plan:
        time.sleep(max(0.0, before["mono"] + fraction * args.window_s - time.monotonic()))
        if what == "push":
            pushes.append(push(stack["redis"].url, len(pushes) + 1, workdir))
            events.append({"at_s": round(time.monotonic() - before["mono"], 1), "event": f"push v{len(pushes)}"})
        else:
            victim_at_kill = engine_counters([fleet.victim_url])[fleet.victim_url]
            fleet.kill_victim()
            events.append({"at_s": round(time.monotonic() - before["mono"], 1), "event": "victim engine SIGKILL"})
            time.sleep(args.down_s)
            fleet.restart_victim()
            events.append({"at_s": round(time.monotonic() - before["mono"], 1), "event": "victim engine restarted"})
    time.sleep(max(0.0, before["mono"] + args.window_s - time.monotonic()))
    after = snapshot(stack)
    return {"before": before, "after": after, "events": events, "pushes": pushes, "victim_at_kill": victim_at_kill}


def figures(args: argparse.Namespace, stack: dict, w: dict, sampler: Sampler) -> dict:
    before, after = w["before"], w["after"]
    wall = after["mono"] - before["mono"]
    episodes = after["status"]["completed"] - before["status"]["completed"]
    turns = counter(after["metrics"], "asyncrl_gateway_turns_total") - counter(before["metrics"], "asyncrl_gateway_turns_total")
    metrics = before["metrics"], after["metrics"]
    latency = lambda name: window_quantiles(*metrics, f"asyncrl_gateway_{name}_seconds")  # noqa: E731
    overhead = httpx.get(f"{stack['orchestrator_url']}/v1/status", params={"overhead_since": before["t"]},
                         timeout=60).json()["dispatch_overhead"]
    cpu = {k: after["cpu"][k] - before["cpu"][k] for k in after["cpu"]}
    rss = {k: max(r["rss"][k] for r in sampler.rows if before["t"] <= r["t"] <= after["t"]) / 2**20 for k in cpu}
    victim = stack["fleet"].victim_url
    return {
        "window_s": round(wall, 1), "episodes": episodes, "episodes_per_s": round(episodes / wall, 1),
        "requests": int(turns), "requests_per_s": round(turns / wall, 1),
        "in_flight_at_start": before["status"]["in_flight"], "in_flight_at_end": after["status"]["in_flight"],
        "gateway_added_latency": latency("added_latency"), "gateway_own_latency": latency("own_latency"),
        "engine_hop": latency("engine_hop"), "null_hop": null_hop(stack, before["t"], after["t"]),
        "gateway_gc_pauses": gc_pauses(before["metrics"], after["metrics"]),
        "client_minus_engine_latency": client_overhead(stack["stats_dir"], before["t"], after["t"]),
        "dispatch_overhead": {"p50_ms": round(overhead["p50_ms"], 2), "p99_ms": round(overhead["p99_ms"], 2),
                              "max_ms": round(overhead["max_ms"], 2), "n": overhead["count"]},
        "pushes": w["pushes"], "events": w["events"],
        "routing_balance": balance(before["engine_requests"], after["engine_requests"]),
        "routing_balance_without_victim": balance(before["engine_requests"], after["engine_requests"], exclude=victim),
        "prefix_cache": cached_ratio(before["engine_counters"], after["engine_counters"], victim, w["victim_at_kill"]),
        "engine_health_checks": health_checks(before["engine_counters"], after["engine_counters"], victim, wall),
        "engine_errors": int(counter(after["metrics"], "asyncrl_gateway_engine_errors_total")
                             - counter(before["metrics"], "asyncrl_gateway_engine_errors_total")),
        "new_segments": int(counter(after["metrics"], "asyncrl_gateway_new_segments_total")),
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "cpu_cores": {k: round(v / wall, 3) for k, v in cpu.items()},
        "cpu_ms_per_episode": {k: round(1e3 * v / max(episodes, 1), 2) for k, v in cpu.items()},
        "cpu_ms_per_request": {k: round(1e3 * v / max(turns, 1), 2) for k, v in cpu.items()},
        "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "cpu_affinity": {name: sorted(set().union(*(p.ps.cpu_affinity() for p in procs)))
                         for name, procs in groups(stack).items()},
        "redis": redis_growth(sampler.rows, before["t"], after["t"]),
    }


def targets(f: dict) -> dict:
    fan_out = max((p["fan_out_s"] for p in f["pushes"]), default=float("inf"))
    checks = {
        "gateway_p99_added_latency_le_5ms": f["gateway_added_latency"]["p99_ms"] <= 5.0,
        "gateway_p99_own_latency_le_5ms": f["gateway_own_latency"]["p99_ms"] <= 5.0,
        "orchestrator_p99_dispatch_overhead_le_50ms": f["dispatch_overhead"]["p99_ms"] <= 50.0,
        "push_fan_out_le_1s": fan_out <= 1.0 and all(not p["failed"] for p in f["pushes"]),
        "no_group_lost": f["groups"]["groups_lost"] == 0 and f["groups"]["groups_short"] == 0
        and f["groups"]["samples_missing"] == 0 and f["groups"]["groups_open_after_drain"] == 0,
    }
    return {**checks, "all_met": all(checks.values())}


def to_markdown(report: dict) -> str:
    f, t = report["figures"], report["targets"]
    ok = lambda b: "met" if b else "**NOT met**"  # noqa: E731
    lines = [
        "# Control plane at cluster scale", "",
        f"Command: `{report['command']}` (commit {report['commit']})", "",
        f"Machine: {report['machine']}. Load average (1 min) at start / end: {report['load_start']} / "
        f"{report['load_end']}.", "", report["method"], "",
        f"Window {f['window_s']} s: {f['episodes']} episodes ({f['episodes_per_s']}/s), {f['requests']} chat requests "
        f"({f['requests_per_s']}/s), in flight {f['in_flight_at_start']} at its start and {f['in_flight_at_end']} at its end.", "",
        "## Targets", "", "| target | figure | |", "|---|---|---|",
        f"| gateway p99 added latency <= 5 ms | p50 {f['gateway_added_latency']['p50_ms']} ms, p99 "
        f"{f['gateway_added_latency']['p99_ms']} ms ({f['gateway_added_latency']['n']} turns) | "
        f"{ok(t['gateway_p99_added_latency_le_5ms'])} |",
        f"| (the same less the engine hop: gateway p99 own latency <= 5 ms) | p50 {f['gateway_own_latency']['p50_ms']} "
        f"ms, p99 {f['gateway_own_latency']['p99_ms']} ms; the hop (engine call wall time minus the engine's own): p50 "
        f"{f['engine_hop']['p50_ms']} ms, p99 {f['engine_hop']['p99_ms']} ms | {ok(t['gateway_p99_own_latency_le_5ms'])} |",
        *null_hop_row(f),
        f"| orchestrator p99 dispatch overhead <= 50 ms | p50 {f['dispatch_overhead']['p50_ms']} ms, p99 "
        f"{f['dispatch_overhead']['p99_ms']} ms, max {f['dispatch_overhead']['max_ms']} ms ({f['dispatch_overhead']['n']} "
        f"dispatches) | {ok(t['orchestrator_p99_dispatch_overhead_le_50ms'])} |",
        "| push fan-out to every engine <= 1 s (pause + update + continue, 4 KB payload) | " +
        "; ".join(f"v{p['version']}: {p['fan_out_s']} s (pause {p['pause_s']}, update+verify {p['update_s']}, "
                  f"continue {p['resume_s']}) to {p['engines']} engines" for p in f["pushes"]) +
        f" | {ok(t['push_fan_out_le_1s'])} |",
        f"| no group lost when an engine dies | {f['groups']['groups_started']} groups started, "
        f"{f['groups']['groups_recorded']} recorded, {f['groups']['groups_lost']} lost, {f['groups']['groups_short']} "
        f"short, {f['groups']['samples_missing']} samples missing, {f['groups']['episodes_failed']} episodes failed | "
        f"{ok(t['no_group_lost'])} |", "",
        "## Routing", "",
        f"- requests per engine in the window: max/mean {f['routing_balance']['max_over_mean']}, min/mean "
        f"{f['routing_balance']['min_over_mean']}, CV {f['routing_balance']['cv']} (without the victim: max/mean "
        f"{f['routing_balance_without_victim']['max_over_mean']}, CV {f['routing_balance_without_victim']['cv']})",
        f"- prefix affinity: {f['affinity']['turn_same_engine_fraction']} of turns after the first ran on the session's "
        f"previous engine; {f['affinity']['single_engine_session_fraction']} of sessions ran on one engine "
        f"({f['affinity']['sessions_read']} sessions read)",
        f"- engines' cached-token ratio: {f['prefix_cache']['cached_ratio']} ({f['prefix_cache']['cached_tokens']} of "
        f"{f['prefix_cache']['prompt_tokens']} prompt tokens)",
        f"- client-observed chat latency minus the engines' own: p50 {f['client_minus_engine_latency']['p50_ms']} ms, "
        f"p99 {f['client_minus_engine_latency']['p99_ms']} ms ({f['client_minus_engine_latency']['n']} turns; env client, "
        "both HTTP hops and the gateway, on the same loaded cores)",
        "- gateway GC collections in the window (generation: count, seconds, over 10 ms): " +
        "; ".join(f"{g}: {p['count']}, {p['seconds']} s, {p['over_10ms']}" for g, p in f["gateway_gc_pauses"].items()),
        f"- gateway engine errors (failed over) {f['engine_errors']}; /health probes {f['engine_health_checks']['probes']} "
        f"({f['engine_health_checks']['per_engine_per_s']}/s an engine, the victim left out); events: " +
        ", ".join(f"{e['event']} at {e['at_s']} s" for e in f["events"]), "",
        "## Cost per component", "",
        "| component | CPU cores | CPU ms / episode | CPU ms / request | peak RSS MB |", "|---|---|---|---|---|"]
    for k in f["cpu_s"]:
        lines.append(f"| {k} | {f['cpu_cores'][k]} | {f['cpu_ms_per_episode'][k]} | {f['cpu_ms_per_request'][k]} | "
                     f"{f['peak_rss_mb'][k]} |")
    rd = f["redis"]
    lines += ["", f"Redis: {rd.get('mb_per_1000_samples')} MB per 1,000 recorded samples (least squares of used_memory "
              f"on samples, mean {f['tokens_per_sample']} tokens a sample; the samples stream itself holds "
              f"{f['stream_bytes_per_sample']} bytes a sample by MEMORY USAGE), growth {rd.get('growth_mb_per_min')} MB/min, "
              f"used_memory {rd.get('used_memory_mb_start')} -> {rd.get('used_memory_mb_end')} MB over the window "
              f"({rd.get('samples_start')} -> {rd.get('samples_end')} samples). Nothing consumed the samples (no trainer), "
              "so this is the growth a run sees between trims.", "",
              f"All targets: {ok(t['all_met'])}. Every figure, the Redis series and the push reports are in the JSON."]
    return "\n".join(lines) + "\n"


def null_hop_row(f: dict) -> list[str]:
    """The machine's floor next to the targets it bounds (no row when the probe was off)."""
    n = f.get("null_hop")
    if not n:
        return []
    return [f"| (the floor: a null HTTP round trip from the gateway's CPU to the engines', bench/hop_probe.py at "
            f"{priority_words(n['priority'])}) | p50 "
            f"{n['p50_ms']} ms, p99 {n['p99_ms']} ms, max {n['max_ms']} ms ({n['n']} round trips); its timer fired > 2 "
            f"ms late {n['timer_late_over_2ms_per_s']} times a second (p99 {n['timer_late_p99_ms']} ms, max "
            f"{n['timer_late_max_ms']} ms); gateway hop p99 / null p99 = "
            f"{round(f['engine_hop']['p99_ms'] / max(n['p99_ms'], 1e-9), 2)} | |"]


def sample_sizes(stack: dict) -> dict:
    """Mean tokens of the last 200 samples, and the samples stream's own bytes per sample (MEMORY USAGE)."""
    from asyncrl.types import Sample

    r = redis.Redis.from_url(stack["redis"].url)
    entries = r.xrevrange(key("samples"), count=200)
    stream_bytes = r.memory_usage(key("samples"), samples=0) or 0
    return {"tokens_per_sample": round(statistics.fmean(len(Sample.decode(f[b"data"]).tokens) for _, f in entries), 1),
            "stream_bytes_per_sample": round(stream_bytes / max(r.xlen(key("samples")), 1))}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--engines-per-process", type=int, default=16)
    p.add_argument("--episodes", type=int, default=4096, help="episodes in flight (orchestrator max_in_flight)")
    p.add_argument("--env-services", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="chat calls per episode")
    p.add_argument("--tool-s", type=float, default=105.0, help="mean tool time between turns (+-50%%)")
    p.add_argument("--ttft-s", type=float, default=0.3)
    p.add_argument("--prefill-s-per-token", type=float, default=0.0002)
    p.add_argument("--decode-s-per-token", type=float, default=0.03)
    p.add_argument("--window-s", type=float, default=90.0)
    p.add_argument("--down-s", type=float, default=15.0, help="seconds the victim engine stays dead")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "control_plane_scale"))
    p.add_argument("--hop-probe-interval-s", type=float, default=0.02,
                   help="between the null hop's round trips (bench/hop_probe.py; 0: no probe)")
    p.add_argument("--hop-probe-priority", type=parse_priority, default="fifo",
                   help="the null hop's processes' (default fifo: SCHED_FIFO, ahead of every process of the run, so "
                        "what delays it is the machine's; 0: a neighbour of the gateway at its priority)")
    p.add_argument("--keep-logs", help="keep the processes' logs under this directory")
    p.add_argument("--load-priority", type=parse_priority, default="idle",
                   help="CPU priority of the env services: idle (SCHED_IDLE) or a nice increment (0: equal)")
    p.add_argument("--engine-priority", type=parse_priority, default=0,
                   help="the stand-in engines' (default 0: they answer as promptly as engines on nodes of their own)")
    p.add_argument("--gateway-priority", type=parse_priority, default=0,
                   help="the gateway's (fifo: SCHED_FIFO, it never waits for its CPU)")
    p.add_argument("--gateway-cpus", type=parse_cpus, default=str(min(USABLE_CPUS)) if len(USABLE_CPUS) > 1 else "",
                   help="CPUs the gateway runs on alone, every other process on the rest ('': all share every CPU)")
    p.add_argument("--gateways", type=int, choices=(1, 2), default=1,
                   help="gateway processes (the run's gateway.replicas); the second runs on the CPUs --gateway-cpus "
                        "leaves, beside the engines")
    p.add_argument("--env-cpus", type=parse_cpus, default=",".join(map(str, sorted(USABLE_CPUS))),
                   help="CPUs the env services run on (default: every CPU; at SCHED_IDLE they use the gateway's only "
                        "while it waits)")
    args = p.parse_args()
    for name in ("gateway_cpus", "env_cpus"):
        if not getattr(args, name) <= USABLE_CPUS:
            p.error(f"--{name.replace('_', '-')} {sorted(getattr(args, name))}: this process may use CPUs "
                    f"{sorted(USABLE_CPUS)} only")
    for name in ("hop_probe_priority", "gateway_priority", "engine_priority", "load_priority"):
        if getattr(args, name) == "fifo" and not fifo_permitted():
            p.error(f"--{name.replace('_', '-')} fifo: SCHED_FIFO is not permitted here (it takes root with CAP_SYS_NICE "
                    "and real-time runtime in this cgroup); give a nice increment")
    if args.gateway_cpus and not USABLE_CPUS - args.gateway_cpus:
        p.error(f"--gateway-cpus {sorted(args.gateway_cpus)} leaves no CPU for the other processes")
    return args


def main() -> None:
    args = parse_args()
    if args.gateway_cpus:  # the children but the gateway inherit this
        os.sched_setaffinity(0, USABLE_CPUS - args.gateway_cpus)
    workdir = Path(args.keep_logs or tempfile.mkdtemp(prefix="cps-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = round(os.getloadavg()[0], 2)
    stack: dict = {}
    try:
        import trainer.weight_push  # noqa: F401 - torch, imported now rather than inside the window

        stack.update(start_stack(args, workdir))
        sampler = Sampler(stack)
        sampler.start()
        wait_in_flight(stack, args.episodes, timeout_s=120 + args.episodes / 20)
        time.sleep(1.3 * episode_s(args))
        window = run_window(args, stack, workdir)
        f = figures(args, stack, window, sampler)
        status = drain(stack, timeout_s=3 * episode_s(args) + 60)
        f["groups"] = check_groups(stack, status)
        f["affinity"] = affinity(stack, window["before"]["t"])
        f.update(sample_sizes(stack))
        sampler.done.set()
    finally:
        stop_stack(stack)
    report = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                         else sys.argv[0], *sys.argv[1:]]),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs), Python "
                   f"{platform.python_version()}",
        "method": (f"{args.engines} stand-in engines ({args.engines_per_process} to a process; ttft {args.ttft_s} s + "
                   f"{args.prefill_s_per_token} s per uncached prompt token, {args.decode_s_per_token} s per output "
                   f"token, 16-{MAX_NEW_TOKENS} output tokens), {args.episodes} episodes in flight over "
                   f"{args.env_services} env services (ToolLoopEnv: {args.turns} chat turns, {args.tool_s} s +-50% tool "
                   f"time between them, mean episode ~{episode_s(args):.0f} s), group_size {GROUP_SIZE}, real gateway, "
                   f"orchestrator and redis-server (AOF). Two weight pushes (trainer.weight_push.WeightSync, tensor, "
                   f"in_place) and one engine SIGKILLed for {args.down_s} s inside the window. Engines at "
                   f"{priority_words(args.engine_priority)}, env services at {priority_words(args.load_priority)}, the "
                   f"gateway at {priority_words(args.gateway_priority)} (the orchestrator at nice 0); {cpu_layout(args)}."),
        "load_start": load_start, "load_end": round(os.getloadavg()[0], 2),
        "args": vars(args), "figures": f, "targets": targets(f),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1, default=sorted) + "\n")  # CPU sets
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
