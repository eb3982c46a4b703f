"""Engine benchmark: the built-in CPU engine versus transformers' batched generate, same weights, same run.

    python bench/engine_bench.py [--new-tokens 64] [--out bench/results/engine_bench]

1. Throughput and inter-token latency at concurrency 1, 8, 32, 128. asyncrl: that many concurrent
   streaming /generate requests over HTTP (ITL = gaps between a request's streamed tokens), then the
   same requests without streaming (what the gateway sends; throughput only), then the same requests
   submitted to an Engine in this process, no HTTP (like transformers' side: the engine thread alone).
   transformers: `generate` on a batch of the same prompts (ITL = time between decode steps). All sample
   every token (temperature 1, no early stop), on the same 2 CPU cores with one torch thread each; the
   benchmark's own HTTP client shares those cores.
2. Prefix-cache gain: multi-turn sessions that re-send their growing history, radix cache on vs off.
3. Weight-update latency: update_weights_from_disk / _from_tensor / _from_distributed (gloo).
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
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_model_section  # noqa: E402
from asyncrl.engine_client import EngineClient  # noqa: E402
from asyncrl.model.io import read_tensors, save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.protocols.engine import GenerateItem, SamplingParams  # noqa: E402
from rollout.engine import Engine, EngineArgs  # noqa: E402
from rollout.request import Req  # noqa: E402
from tests.services import ServiceProcess, free_port  # noqa: E402

CONCURRENCY = (1, 8, 32, 128)
PROMPT_LEN = 24


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1006, 1008] + torch.randint(0, 1000, (PROMPT_LEN - 2,), generator=g).tolist() for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# asyncrl engine ---------------------------------------------------------------------------------
async def engine_round(url: str, concurrency: int, new_tokens: int) -> dict:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    gaps: list[float] = []

    async def one(client: EngineClient, prompt: list[int], seed: int) -> int:
        last, n = None, 0
        async for snap in client.generate_stream(prompt, {**params, "sampling_seed": seed}, return_logprob=False):
            now = time.perf_counter()
            got = len(snap.output_ids)
            if last is not None and got > n:
                gaps.extend([(now - last) / (got - n)] * (got - n))
            last, n = now, got
        return n

    async with EngineClient(url, timeout_s=600) as client:
        await one(client, prompts(1)[0], 0)  # warm-up
        gaps.clear()
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p, i) for i, p in enumerate(prompts(concurrency))))
        elapsed = time.perf_counter() - start
    assert counts == [new_tokens] * concurrency
    return {"tokens_per_s": sum(counts) / elapsed, "itl_p50_ms": pct(gaps, 0.5) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3, "elapsed_s": elapsed}


async def engine_batch_round(url: str, concurrency: int, new_tokens: int) -> dict:
    """The same requests without streaming (how the gateway calls engines): throughput only."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url, timeout_s=600) as client:
        await client.generate(prompts(1)[0], params, return_logprob=False)  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.generate(p, {**params, "sampling_seed": i}, return_logprob=False)
                                      for i, p in enumerate(prompts(concurrency))))
        elapsed = time.perf_counter() - start
    assert [len(o.output_ids) for o in outs] == [new_tokens] * concurrency
    return {"tokens_per_s": concurrency * new_tokens / elapsed, "elapsed_s": elapsed}


def engine_inprocess_round(engine: Engine, concurrency: int, new_tokens: int) -> dict:
    """The same requests handed to an Engine in this process (its own engine thread), no HTTP."""
    finished = threading.Semaphore(0)

    def submit(rid: str, prompt: list[int], seed: int) -> Req:
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=seed)
        return engine.submit(engine.request(GenerateItem(rid=rid, input_ids=prompt, sampling=sampling),
                                            lambda req: finished.release() if req.finished else None))

    submit("warm-up", prompts(1)[0], 0)
    finished.acquire()
    start = time.perf_counter()
    reqs = [submit(f"c{concurrency}-{i}", p, i) for i, p in enumerate(prompts(concurrency))]
    for _ in reqs:
        finished.acquire()
    elapsed = time.perf_counter() - start
    assert [len(r.output_ids) for r in reqs] == [new_tokens] * concurrency
    return {"tokens_per_s": concurrency * new_tokens / elapsed, "elapsed_s": elapsed}


# transformers ------------------------------------------------------------------------------------
def transformers_round(model, concurrency: int, new_tokens: int) -> dict:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor(prompts(concurrency))
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=4, do_sample=True, pad_token_id=0)
        clock = StepClock()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                             pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * concurrency
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return {"tokens_per_s": produced / elapsed, "itl_p50_ms": pct(gaps, 0.5) * 1e3,
            "itl_p99_ms": pct(gaps, 0.99) * 1e3, "elapsed_s": elapsed}


# prefix cache ------------------------------------------------------------------------------------
async def multi_turn(url: str, sessions: int = 16, turns: int = 6) -> dict:
    async with EngineClient(url, timeout_s=600) as client:
        histories = [[1006, 1008, 1010] + list(range(100 + s, 300 + s)) for s in range(sessions)]
        cached = total = 0
        start = time.perf_counter()
        for turn in range(turns):
            outs = await asyncio.gather(*(client.generate(h, {"max_new_tokens": 16, "temperature": 1.0,
                                                              "ignore_eos": True, "sampling_seed": turn})
                                          for h in histories))
            for h, o in zip(histories, outs):
                cached += o.meta_info.cached_tokens
                total += o.meta_info.prompt_tokens
                h.extend(o.output_ids + [1013] + list(range(400 + turn * 30, 430 + turn * 30)) + [1012])
        return {"elapsed_s": time.perf_counter() - start, "cached_fraction": cached / total, "prompt_tokens": total}


# weight updates ----------------------------------------------------------------------------------
async def weight_updates(url: str, checkpoint: Path, repeats: int = 5) -> dict:
    tensors = read_tensors(checkpoint)
    timings: dict[str, list[float]] = {"disk": [], "tensor": [], "distributed_gloo": []}
    async with EngineClient(url, timeout_s=600) as client:
        for i in range(repeats):
            t = time.perf_counter()
            await client.update_weights_from_disk(str(checkpoint), weight_version=f"d{i}")
            timings["disk"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await client.update_weights_from_tensor(tensors, weight_version=f"t{i}")
            timings["tensor"].append(time.perf_counter() - t)
        port = free_port()
        joining = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, "bench", "gloo"))
        await asyncio.to_thread(dist.init_process_group, "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2)
        await joining
        for i in range(repeats):
            t = time.perf_counter()
            update = asyncio.create_task(client.update_weights_from_distributed(tensors, f"b{i}", group_name="bench"))
            await asyncio.to_thread(lambda: [dist.broadcast(x.contiguous(), src=0) for x in tensors.values()])
            await update
            timings["distributed_gloo"].append(time.perf_counter() - t)
        await client.destroy_weights_update_group("bench")
        dist.destroy_process_group()
    size_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    return {"model_mb": size_mb, **{k: {"p50_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3}
                                      for k, v in timings.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_bench"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    arch = load_model_section("tiny").arch
    model = Glm5ForCausalLM.from_config(arch, seed=0)
    save_pretrained(model, work / "ckpt")

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "ckpt", dtype=torch.float32).eval()
    results: dict = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "load_avg_start": os.getloadavg(), "params": sum(p.numel() for p in model.parameters()),
                     "new_tokens": args.new_tokens, "throughput": {}}
    engine = ServiceProcess("rollout.server", ["--model", str(work / "ckpt"), "--max-running-requests", "128"], work,
                            name="engine")
    try:
        for c in CONCURRENCY:
            ours = asyncio.run(engine_round(engine.url, c, args.new_tokens))
            batch = asyncio.run(engine_batch_round(engine.url, c, args.new_tokens))
            theirs = transformers_round(hf, c, args.new_tokens)
            results["throughput"][c] = {"asyncrl": ours, "asyncrl_nonstream": batch, "transformers": theirs,
                                        "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
                                        "speedup_nonstream": batch["tokens_per_s"] / theirs["tokens_per_s"]}
            print(f"concurrency {c}: asyncrl {ours['tokens_per_s']:.0f} tok/s streaming, {batch['tokens_per_s']:.0f} "
                  f"without; transformers {theirs['tokens_per_s']:.0f} tok/s", flush=True)
        results["prefix_cache"] = {"on": asyncio.run(multi_turn(engine.url))}
        results["weight_update"] = asyncio.run(weight_updates(engine.url, work / "ckpt"))
    finally:
        engine.stop()
    # Last, and only now: an Engine living in this process made the HTTP client's streams stall (ITL p99
    # at concurrency 128: ~200 ms instead of ~45 ms).
    local = Engine(EngineArgs(model_path=str(work / "ckpt"), max_running_requests=128)).start()
    try:
        for c in CONCURRENCY:
            row = results["throughput"][c]
            row["asyncrl_inprocess"] = engine_inprocess_round(local, c, args.new_tokens)
            row["speedup_inprocess"] = row["asyncrl_inprocess"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
            print(f"concurrency {c}: asyncrl in-process {row['asyncrl_inprocess']['tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        local.stop()
    baseline = ServiceProcess("rollout.server", ["--model", str(work / "ckpt"), "--disable-radix-cache"], work,
                              name="engine-nocache")
    try:
        results["prefix_cache"]["off"] = asyncio.run(multi_turn(baseline.url))
    finally:
        baseline.stop()
    pc = results["prefix_cache"]
    pc["speedup"] = pc["off"]["elapsed_s"] / pc["on"]["elapsed_s"]
    results["load_avg_end"] = os.getloadavg()
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    Path(args.out + ".md").write_text(render_markdown(results))
    print(render_markdown(results))


def render_markdown(r: dict) -> str:
    lines = ["# Engine benchmark", "", f"Command: `{r['command']}`  ", f"Machine: {r['machine']}, load average "
             f"{r['load_avg_start'][0]:.1f} at start; tiny GLM-5 ({r['params'] / 1e6:.2f}M params), "
             f"{r['new_tokens']} sampled tokens per request, one torch thread each.", "",
             "| concurrency | asyncrl tok/s (streaming / not / in-process) | transformers tok/s | "
             "speedup (streaming / not / in-process) | asyncrl ITL p50 / p99 ms | transformers ITL p50 / p99 ms |",
             "|---|---|---|---|---|---|"]
    for c, row in r["throughput"].items():
        a, b, i, t = row["asyncrl"], row["asyncrl_nonstream"], row["asyncrl_inprocess"], row["transformers"]
        lines.append(f"| {c} | {a['tokens_per_s']:.0f} / {b['tokens_per_s']:.0f} / {i['tokens_per_s']:.0f} | "
                     f"{t['tokens_per_s']:.0f} | {row['speedup']:.2f}x / {row['speedup_nonstream']:.2f}x / "
                     f"{row['speedup_inprocess']:.2f}x | "
                     f"{a['itl_p50_ms']:.1f} / {a['itl_p99_ms']:.1f} | {t['itl_p50_ms']:.1f} / {t['itl_p99_ms']:.1f} |")
    lines += ["", "In-process: the same requests submitted to an Engine in the benchmark's process (its engine thread "
              "alone, no HTTP server or client), as transformers runs."]
    pc = r["prefix_cache"]
    lines += ["", f"Prefix cache (16 sessions x 6 turns, growing history): {pc['on']['elapsed_s']:.2f} s with the radix "
              f"cache ({pc['on']['cached_fraction']:.0%} of prompt tokens cached) vs {pc['off']['elapsed_s']:.2f} s "
              f"without: {pc['speedup']:.2f}x.", "",
              f"Weight update ({r['weight_update']['model_mb']:.1f} MB fp32), median / max of 5:", ""]
    for method in ("disk", "tensor", "distributed_gloo"):
        w = r["weight_update"][method]
        lines.append(f"- {method}: {w['p50_ms']:.1f} ms / {w['max_ms']:.1f} ms")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
