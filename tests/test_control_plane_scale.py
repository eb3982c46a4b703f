"""bench/control_plane_scale.py at toy scale, and the stand-in engine it runs on.

1. The stand-in speaks what the gateway and the trainer call (asyncrl's own EngineClient against it):
   generate and its stream, a prefix cache hit on a repeated prompt, pause in_place holding a request whose
   later tokens then carry the pushed version, pause abort ending one, a tensor push read back by name.
2. The benchmark end to end with real processes (redis-server, gateway, orchestrator, env services,
   stand-in engines, the null-hop probe): 4 engines, 32 episodes, an engine killed mid-window: no group lost,
   every figure there.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from asyncrl.engine_client import EngineClient
from bench.procs import fifo_permitted
from tests.services import ROOT, ServiceProcess
from trainer.weight_push import verify_weights

pytestmark = pytest.mark.timeout(180)

PARAMS = {"max_new_tokens": 40, "stop_token_ids": [1011], "sampling_seed": 7}


async def test_standin_speaks_the_engine_protocol(tmp_path):
    engine = ServiceProcess("bench.standin_engine", ["--ttft-s", "0.05", "--decode-s-per-token", "0.01",
                                                     "--min-out", "30", "--max-out", "30"], tmp_path, name="standin")
    prompt = list(range(100, 164))
    try:
        async with EngineClient(engine.url, timeout_s=30) as client:
            assert await client.health() and await client.health_generate()
            first = await client.generate(prompt, PARAMS)
            assert len(first.output_ids) == 30 and first.meta_info.finish_reason == {"type": "stop", "matched": 1011}
            assert len(first.meta_info.output_token_logprobs) == 30 and first.meta_info.cached_tokens == 0
            again = await client.generate(prompt, PARAMS)
            assert again.output_ids == first.output_ids and again.meta_info.cached_tokens == 64
            snapshots = [s async for s in client.generate_stream(prompt, PARAMS)]
            assert len(snapshots) > 2 and snapshots[-1].output_ids == first.output_ids

            held = asyncio.create_task(client.generate(prompt + [1], PARAMS))
            await asyncio.sleep(0.15)
            await client.pause("in_place")
            await asyncio.sleep(0.3)
            assert not held.done()  # held while paused
            tensors = {"model.embed_tokens.weight": torch.randn(8, 4)}
            await client.update_weights_from_tensor(tensors, weight_version="1")
            await verify_weights(client, tensors)
            await client.resume()
            spans = [(s.version, s.start, s.end) for s in (await held).meta_info.weight_versions]
            assert [v for v, _, _ in spans] == ["0", "1"] and spans[-1][2] == 30, spans

            cut = asyncio.create_task(client.generate(prompt + [2], PARAMS))
            await asyncio.sleep(0.15)
            await client.pause("abort")
            assert (await cut).meta_info.finish_reason["type"] == "abort"
            await client.resume()
            assert await client.weight_version() == "1" and (await client.loads()).loads[0].num_running_reqs == 0
    finally:
        engine.stop()


@pytest.mark.slow
def test_bench_end_to_end_at_toy_scale(tmp_path):
    out = tmp_path / "cps"
    probe_priority = "fifo" if fifo_permitted() else "0"  # the bench's default needs root with real-time runtime
    subprocess.run([sys.executable, "bench/control_plane_scale.py", "--engines", "4", "--engines-per-process", "2",
                    "--episodes", "32", "--env-services", "2", "--tool-s", "1", "--ttft-s", "0.05",
                    "--decode-s-per-token", "0.005", "--window-s", "10", "--down-s", "2", "--out", str(out),
                    "--hop-probe-priority", probe_priority],
                   cwd=ROOT, check=True, timeout=170)
    report = json.loads(out.with_suffix(".json").read_text())
    f = report["figures"]
    assert f["groups"]["groups_lost"] == 0 and f["groups"]["samples_missing"] == 0 and f["groups"]["groups_short"] == 0
    assert f["groups"]["groups_recorded"] > 0 and f["groups"]["episodes_failed"] == 0
    assert [e["event"] for e in f["events"]] == ["push v1", "push v2", "victim engine SIGKILL", "victim engine restarted"]
    assert all(p["engines"] == 4 and not p["failed"] for p in f["pushes"])
    assert f["engine_errors"] >= 0 and f["episodes"] > 0 and f["requests"] > 0
    assert f["gateway_own_latency"]["n"] == f["gateway_added_latency"]["n"] == f["requests"]
    assert f["gateway_own_latency"]["p50_ms"] <= f["gateway_added_latency"]["p50_ms"] and f["engine_hop"]["n"] > 0
    numbers = [f["gateway_added_latency"]["p99_ms"], f["gateway_own_latency"]["p99_ms"], f["engine_hop"]["p99_ms"],
               f["dispatch_overhead"]["p99_ms"],
               f["client_minus_engine_latency"]["p99_ms"], f["routing_balance"]["cv"], f["prefix_cache"]["cached_ratio"],
               f["affinity"]["turn_same_engine_fraction"], f["redis"]["mb_per_1000_samples"], f["tokens_per_sample"],
               *f["cpu_ms_per_episode"].values(), *f["peak_rss_mb"].values()]
    assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers), numbers
    assert f["gateway_gc_pauses"]["0"]["count"] > 0  # the bench reads the gateway's GC pauses
    # passive health: engines answering turns are not probed (every 2 s each, 0.5 a second, without it)
    assert f["engine_health_checks"]["per_engine_per_s"] < 0.25, f["engine_health_checks"]
    # the null hop (bench/hop_probe.py) ran through the window, a round trip every 20 ms
    assert f["null_hop"]["n"] >= 0.5 * 10 / 0.02 and 0 < f["null_hop"]["p50_ms"] <= f["null_hop"]["p99_ms"], f["null_hop"]
    assert f["null_hop"]["policy"] == ("SCHED_FIFO" if probe_priority == "fifo" else "SCHED_OTHER"), f["null_hop"]
    assert "the floor: a null HTTP round trip" in out.with_suffix(".md").read_text()
    assert set(f["cpu_ms_per_episode"]) == {"gateway", "orchestrator", "redis", "env_services", "engines"}
    assert "Control plane at cluster scale" in out.with_suffix(".md").read_text()
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) > 1:  # the default layout reached the processes: the gateway has the first CPU to itself
        gateway, others = [usable[0]], usable[1:]
        assert f["cpu_affinity"] == {"gateway": gateway, "env_services": usable, "orchestrator": others,
                                     "redis": others, "engines": others}, f["cpu_affinity"]
