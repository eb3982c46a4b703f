"""The cost of one decode step of the tiny model, per batch size: the floor under the engine's throughput.

    python bench/decode_step.py            # writes bench/results/decode_step.{json,md}

One `forward_batch` of B sequences with one new token each against a filled KV cache, at a context
within index_topk (dense attention, no indexer ranking) and one beyond it (the indexer selects 64 keys).
Times are process CPU seconds per step (one torch thread), median of 5 runs of 30 steps. `ops` counts the
kernels a step dispatches (TorchDispatchMode): at small B the step costs about ops x dispatch overhead,
whatever the arithmetic, which is why the engine cannot reach 5x transformers there (docs/engine.md).
The breakdown splits a step beyond index_topk into the model's parts (timers around their calls). The
last table is what recording routed experts (--enable-return-routed-experts, routing replay) costs: the
same batch against two caches holding the same rows, one recording, timed in alternation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.model.batch import ForwardBatch  # noqa: E402
from asyncrl.model.kv_cache import KVCache  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.model.moe import MoE  # noqa: E402
from bench.model_bench import tiny_config  # noqa: E402

BATCHES = (1, 8, 32, 128)
CONTEXTS = (60, 80)  # below and above index_topk = 64
PARTS = {"indexer": "the indexer (keys, queries, scores, top-k)", "attention": "MLA without the indexer",
         "experts": "router and routed experts", "mlp": "dense MLP and shared experts",
         "rest": "embedding, norms, residuals, lm_head"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def decode_batch(model: Glm5ForCausalLM, batch: int, context: int) -> tuple[ForwardBatch, KVCache]:
    """A cache holding `context - 1` prefilled tokens per sequence and the decode batch of the next one."""
    cache = KVCache(model.config, batch * context)
    slots = torch.arange(batch * context).view(batch, context)
    prompt = torch.full((batch,), context - 1)
    generator = torch.Generator().manual_seed(0)
    model.forward_batch(ForwardBatch(torch.randint(0, 1000, (batch * (context - 1),), generator=generator), prompt,
                                     slots[:, : context - 1], prompt), cache)
    step = ForwardBatch(torch.randint(0, 1000, (batch,), generator=generator), torch.ones(batch, dtype=torch.long),
                        slots, prompt + 1)
    return step, cache


def measure(model: Glm5ForCausalLM, batch: int, context: int, steps: int = 30, reps: int = 5) -> dict:
    step, cache = decode_batch(model, batch, context)
    for _ in range(3):
        model.forward_batch(step, cache)
    times = []
    for _ in range(reps):
        start = time.process_time()
        for _ in range(steps):
            model.forward_batch(step, cache)
        times.append((time.process_time() - start) / steps)
    with OpCounter() as counter:
        model.forward_batch(step, cache)
    ms = statistics.median(times) * 1e3
    return {"batch": batch, "context": context, "step_ms": ms, "tokens_per_s": batch / ms * 1e3, "ops": counter.count}


def routing_overhead(model: Glm5ForCausalLM, batch: int, context: int, steps: int = 30, reps: int = 7) -> dict:
    """ms per step with a plain cache and with one recording routed experts (median of alternating rounds)."""
    step, plain = decode_batch(model, batch, context)
    recording = KVCache(model.config, plain.max_tokens, record_routing=True)
    recording.latent.copy_(plain.latent)
    recording.index_keys.copy_(plain.index_keys)
    times: dict[str, list[float]] = {"plain": [], "recording": []}
    for _ in range(reps):
        for name, cache in (("plain", plain), ("recording", recording)):
            for _ in range(3):
                model.forward_batch(step, cache)
            start = time.process_time()
            for _ in range(steps):
                model.forward_batch(step, cache)
            times[name].append((time.process_time() - start) / steps * 1e3)
    plain_ms, recording_ms = statistics.median(times["plain"]), statistics.median(times["recording"])
    return {"batch": batch, "context": context, "plain_ms": plain_ms, "recording_ms": recording_ms,
            "ratio": recording_ms / plain_ms}


def breakdown(model: Glm5ForCausalLM, batch: int, context: int, steps: int = 30) -> dict:
    """ms per step spent in each of PARTS, by timers wrapped around the instances' methods."""
    spent: dict[str, float] = dict.fromkeys(["indexer", "mla", "moe", "dense", "shared"], 0.0)

    def timed(key: str, fn):
        def call(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.process_time() - start
        return call

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.forward, attn._select = timed("mla", attn.forward), timed("indexer", attn._select)
        if isinstance(mlp, MoE):
            mlp.forward = timed("moe", mlp.forward)
            if mlp.shared_experts is not None:
                mlp.shared_experts.forward = timed("shared", mlp.shared_experts.forward)
        else:
            mlp.forward = timed("dense", mlp.forward)
    try:
        step, cache = decode_batch(model, batch, context)
        for _ in range(3):
            model.forward_batch(step, cache)
        spent.update(dict.fromkeys(spent, 0.0))
        start = time.process_time()
        for _ in range(steps):
            model.forward_batch(step, cache)
        total = time.process_time() - start
    finally:
        for module in model.modules():  # drop the instance-level wrappers
            for name in ("forward", "_select"):
                module.__dict__.pop(name, None)
    parts = {"indexer": spent["indexer"], "attention": spent["mla"] - spent["indexer"],
             "experts": spent["moe"] - spent["shared"], "mlp": spent["dense"] + spent["shared"]}
    parts["rest"] = total - sum(parts.values())
    return {"batch": batch, "context": context, "step_ms": total / steps * 1e3,
            "parts_ms": {k: v / steps * 1e3 for k, v in parts.items()}}


def markdown(result: dict) -> str:
    lines = ["# Decode step of the tiny model", "", f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}, load average {result['load_avg_start'][0]:.1f} at start; one torch "
             "thread; process CPU time, median of 5 x 30 steps.", "",
             "| batch | context | ms / step | tokens/s | kernels dispatched |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['ops']} |"
              for r in result["steps"]]
    lines += ["", "Where a step beyond index_topk goes (ms per step; the timers add a little):", "",
              "| batch | context | step | " + " | ".join(PARTS) + " |", "|---|---|---|" + "---|" * len(PARTS)]
    lines += [f"| {b['batch']} | {b['context']} | {b['step_ms']:.2f} | "
              + " | ".join(f"{b['parts_ms'][k]:.2f}" for k in PARTS) + " |" for b in result["breakdown"]]
    lines += [""] + [f"- {name}: {what}" for name, what in PARTS.items()]
    lines += ["", "Recording routed experts (KVCache(record_routing=True), routing replay), median of 7 alternating "
              "rounds:", "", "| batch | context | plain ms / step | recording ms / step | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['plain_ms']:.2f} | {r['recording_ms']:.2f} | {r['ratio']:.3f} |"
              for r in result["routing"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Glm5ForCausalLM.from_config(tiny_config(), seed=0).eval()
    result = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_avg_start": os.getloadavg(), "steps": []}
    with torch.inference_mode():
        for context in CONTEXTS:
            for batch in BATCHES:
                result["steps"].append(measure(model, batch, context))
                print(result["steps"][-1], flush=True)
        result["breakdown"] = [breakdown(model, batch, CONTEXTS[-1]) for batch in (32, 128)]
        print(result["breakdown"], flush=True)
        result["routing"] = [routing_overhead(model, batch, CONTEXTS[-1]) for batch in (1, 32, 128)]
        print(result["routing"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(result, indent=2))
    (args.out / "decode_step.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
