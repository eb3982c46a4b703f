"""How often a cancellation is lost by a task in the middle of Redis calls, by client socket timeout.

    python bench/redis_cancellation.py      # writes bench/results/redis_cancellation.{json,md}

A task loops on one Store read (HGETALL); after 0-3 ms it is cancelled and given 0.5 s to stop. One that
is still running has lost its cancellation; it is cancelled again until it stops. redis-py's socket
timeout (5 s by default) bounds each send with asyncio.wait_for, which on Python 3.11 returns normally when
the cancellation lands as the send completes. Three clients: redis-py's connection with its default, the
same without a socket timeout, and Store.connect, whose BoundedConnection bounds the send with
asyncio.timeout instead (docs/store.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.store import Store  # noqa: E402
from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402

CLIENTS = {"redis-py Connection, default socket_timeout 5 s": {},
           "redis-py Connection, no socket timeout": {"socket_timeout": None},
           "Store.connect: BoundedConnection, 30 s command timeout": None}


async def lost_cancellations(store: Store, tries: int) -> dict:
    rng = np.random.default_rng(0)
    lost, start = 0, time.monotonic()

    async def reading_forever():
        while True:
            await store.engines()

    for _ in range(tries):
        task = asyncio.create_task(reading_forever())
        await asyncio.sleep(float(rng.random()) * 0.003)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done:
            lost += 1
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.05)
    return {"tries": tries, "lost": lost, "seconds": time.monotonic() - start}


async def measure(url: str, tries: int) -> dict:
    out = {}
    for name, options in CLIENTS.items():
        if options is None:
            store = Store.connect(url, "bench")
        else:
            pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=60, **options)
            store = Store(aioredis.Redis(connection_pool=pool), "bench")
        try:
            out[name] = await lost_cancellations(store, tries)
        finally:
            await store.close()
        print(name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    with EmbeddedRedis(tempfile.mkdtemp(prefix="redis-cancel-")) as server:
        rows = asyncio.run(measure(server.url, args.tries))
    result = {"command": " ".join(["python", *sys.argv]), "python": platform.python_version(),
              "redis_py": redis.__version__, "rows": rows}
    lines = ["# Lost cancellations in Redis calls", "", f"Command: `{result['command']}`  ",
             f"Python {result['python']}, redis-py {result['redis_py']}; a task looping on a Store read, "
             "cancelled after 0-3 ms, given 0.5 s to stop.", "",
             "| client | cancellations | lost | seconds |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['tries']} | {r['lost']} | {r['seconds']:.1f} |" for name, r in rows.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "redis_cancellation.json").write_text(json.dumps(result, indent=2))
    (args.out / "redis_cancellation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
