"""What an fsync before every reply costs the embedded redis-server (redis.appendfsync, asyncrl/config.py).

    python bench/redis_fsync.py            # writes bench/results/redis_fsync.{json,md}

For appendfsync `everysec` and `always`, on the same disk: 2,000 HSETs one after the other (a lone
writer's latency), then 2,000 XADDs of 500 bytes with 32 in flight (concurrent writers, as the gateway's
recorders and the orchestrator are), median of 3 runs of each; then lone writes for 6 s while redis
rewrites the AOF of a 200 MB dataset (p99 and worst latency: does `always` stall when the disk is busy?).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402

WRITES, IN_FLIGHT = 2000, 32


async def round_trip(url: str) -> tuple[float, float]:
    """-> (seconds per sequential write, seconds per write with IN_FLIGHT concurrent writers)."""
    client = aredis.from_url(url)
    try:
        start = time.perf_counter()
        for i in range(WRITES):
            await client.hset("weights", mapping={"version": i, "location": "x" * 200})
        sequential = (time.perf_counter() - start) / WRITES
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one() -> None:
            async with gate:
                await client.xadd("samples", {"data": "y" * 500})
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(WRITES)))
        return sequential, (time.perf_counter() - start) / WRITES
    finally:
        await client.aclose()


async def during_rewrite(url: str, seconds: float = 6.0) -> tuple[float, float]:
    """-> (p99, worst) seconds of lone HSETs while an AOF rewrite of ~200 MB runs."""
    client = aredis.from_url(url)
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(2000):
            pipe.set(f"blob{i}", b"x" * 100_000)
        await pipe.execute()  # this much AOF growth starts redis' automatic rewrite
        info = await client.info("persistence")
        if not info.get("aof_rewrite_in_progress"):
            await client.bgrewriteaof()
        latencies, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            await client.hset("weights", "version", 1)
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        return latencies[int(0.99 * len(latencies))], latencies[-1]
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    result = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_avg_start": os.getloadavg(), "rows": []}
    for mode in ("everysec", "always"):
        runs = []
        for _ in range(3):
            with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp, appendfsync=mode) as server:
                runs.append(asyncio.run(round_trip(server.url)))
        with tempfile.TemporaryDirectory(dir=ROOT) as tmp, EmbeddedRedis(tmp, appendfsync=mode) as server:
            p99, worst = asyncio.run(during_rewrite(server.url))  # on the project's disk, not a tmpfs
        result["rows"].append({"appendfsync": mode, "sequential_ms": statistics.median(r[0] for r in runs) * 1e3,
                               "concurrent_ms": statistics.median(r[1] for r in runs) * 1e3,
                               "rewrite_p99_ms": p99 * 1e3, "rewrite_worst_ms": worst * 1e3})
        print(result["rows"][-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "redis_fsync.json").write_text(json.dumps(result, indent=2))
    lines = ["# Embedded redis-server: appendfsync everysec vs always", "", f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}, load average {result['load_avg_start'][0]:.1f} at start; median of 3 runs.",
             "", f"| appendfsync | ms per write, one writer | ms per write, {IN_FLIGHT} in flight | "
             "during an AOF rewrite: p99 / worst ms |", "|---|---|---|---|"]
    lines += [f"| {r['appendfsync']} | {r['sequential_ms']:.3f} | {r['concurrent_ms']:.3f} | "
              f"{r['rewrite_p99_ms']:.2f} / {r['rewrite_worst_ms']:.0f} |" for r in result["rows"]]
    (args.out / "redis_fsync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
