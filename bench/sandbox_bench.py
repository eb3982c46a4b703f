"""Cost of the isolating sandbox per command, next to the unsafe local one in the same run.

    python bench/sandbox_bench.py            # needs root + namespaces; writes bench/results/sandbox.json
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend  # noqa: E402

SEQUENTIAL, CONCURRENT, SESSIONS = 30, 32, 20


async def one_episode_command(backend, i: int):
    async with backend.session(f"c{i}") as sandbox:
        return await sandbox.run("true")


async def measure(kind: str) -> dict:
    backend = make_sandbox_backend(SandboxConfig(type=kind))
    await backend.probe()
    try:
        async with backend.session("bench") as sandbox:
            latencies = []
            for _ in range(SEQUENTIAL):
                started = time.perf_counter()
                assert (await sandbox.run("true")).ok
                latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        results = await asyncio.gather(*[one_episode_command(backend, i) for i in range(CONCURRENT)])
        concurrent_s = time.perf_counter() - started
        assert all(r.ok for r in results)
        started = time.perf_counter()
        for i in range(SESSIONS):
            async with backend.session(f"s{i}"):
                pass
        session_ms = (time.perf_counter() - started) / SESSIONS * 1000
    finally:
        await backend.close()
    return {"command_median_ms": round(statistics.median(latencies) * 1000, 1),
            "command_p90_ms": round(sorted(latencies)[int(0.9 * SEQUENTIAL)] * 1000, 1),
            f"{CONCURRENT}_episodes_one_command_each_s": round(concurrent_s, 2), "session_open_close_ms": round(session_ms, 1)}


async def main() -> None:
    results = {kind: await measure(kind) for kind in ("namespace", "local_unsafe")}
    ratio = results["namespace"]["command_median_ms"] / results["local_unsafe"]["command_median_ms"]
    report = {"command": "python bench/sandbox_bench.py", "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}", "results": results, "namespace_over_unsafe_median": round(ratio, 1)}
    out = Path(__file__).with_name("results") / "sandbox.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
