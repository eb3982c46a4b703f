"""What recording routed experts (--enable-return-routed-experts, routing replay) costs a decode step.

    python bench/routing_overhead.py        # writes bench/results/routing_overhead.{json,md}

The same decode batch (tiny model, context 80: the indexer ranks) against two KV caches holding the same
rows, one of them recording each token's experts (KVCache(record_routing=True)); the two are timed in
alternation, median of 7 rounds of 30 steps, process CPU time, one torch thread.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.model.kv_cache import KVCache  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from bench.decode_step import decode_batch  # noqa: E402
from bench.model_bench import tiny_config  # noqa: E402


def step_ms(model, step, cache, steps: int = 30) -> float:
    for _ in range(3):
        model.forward_batch(step, cache)
    start = time.process_time()
    for _ in range(steps):
        model.forward_batch(step, cache)
    return (time.process_time() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Glm5ForCausalLM.from_config(tiny_config(), seed=0).eval()
    result = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_avg_start": os.getloadavg(), "rows": []}
    with torch.inference_mode():
        for batch in (1, 32, 128):
            step, plain = decode_batch(model, batch, 80)
            recording = KVCache(model.config, plain.max_tokens, record_routing=True)
            recording.latent.copy_(plain.latent)
            recording.index_keys.copy_(plain.index_keys)
            times = {"plain": [], "recording": []}
            for _ in range(7):
                for name, cache in (("plain", plain), ("recording", recording)):
                    times[name].append(step_ms(model, step, cache))
            row = {"batch": batch, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
            row["ratio"] = row["recording_ms"] / row["plain_ms"]
            result["rows"].append(row)
            print(row, flush=True)
    lines = ["# Cost of recording routed experts in a decode step", "", f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}, load average {result['load_avg_start'][0]:.1f} at start; tiny model, "
             "context 80, one torch thread, median of 7 alternating rounds of 30 steps.", "",
             "| batch | plain ms / step | recording ms / step | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['plain_ms']:.2f} | {r['recording_ms']:.2f} | {r['ratio']:.3f} |"
              for r in result["rows"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_overhead.json").write_text(json.dumps(result, indent=2))
    (args.out / "routing_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
