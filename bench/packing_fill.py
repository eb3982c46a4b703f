"""How full are the trainer's micro-batches? First-fit-decreasing packing versus two common peers.

    python bench/packing_fill.py [--out bench/results/packing_fill]

Per step: `samples` sequences with long-tailed (lognormal) lengths, as agentic rollouts have. Compared
on the same lengths:
  ffd        trainer.packing.pack: varlen packing, first-fit-decreasing under a token budget
  next_fit   varlen packing in arrival order, a new micro-batch whenever the next sample does not fit
  padded     [batch, seq] micro-batches of 8 samples in arrival order, padded to the longest
Fill = real tokens / compute slots (budget x micro-batches for the varlen layouts, batch x max_len for
padded). FFD's fill is bounded by the last micro-batch of a step being partly empty; the last column
counts its micro-batches above ceil(tokens / budget), which no packing can beat. Pure CPU
bookkeeping, no model: the figures are exact for the given seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.packing import first_fit_decreasing  # noqa: E402

BUDGET = 4096
CASES = [  # (median length, lognormal sigma, samples per step)
    (300, 0.8, 64), (600, 0.8, 64), (600, 1.2, 256), (1500, 0.6, 64),
]


def next_fit(lengths: np.ndarray, capacity: int) -> int:
    bins, room = 0, 0
    for n in lengths:
        if n > room:
            bins, room = bins + 1, capacity
        room -= n
    return bins


def padded_fill(lengths: np.ndarray, batch: int) -> float:
    slots = sum(len(chunk) * chunk.max() for chunk in np.array_split(lengths, max(1, len(lengths) // batch)))
    return float(lengths.sum() / slots)


def measure(median: int, sigma: float, samples: int, seeds: int = 20) -> dict:
    fills = {"ffd": [], "next_fit": [], "padded": []}
    extra_bins = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(np.log(median), sigma, samples), 32, BUDGET).astype(int)
        total = lengths.sum()
        bins = len(first_fit_decreasing(lengths.tolist(), BUDGET))
        extra_bins.append(bins - int(np.ceil(total / BUDGET)))  # over the lower bound: no packing does better
        fills["ffd"].append(total / (bins * BUDGET))
        fills["next_fit"].append(total / (next_fit(lengths, BUDGET) * BUDGET))
        fills["padded"].append(padded_fill(lengths, batch=8))
    out = {k: round(float(np.mean(v)), 4) for k, v in fills.items()}
    out["ffd_extra_micro_batches"] = round(float(np.mean(extra_bins)), 2)
    out["ffd_vs_next_fit"] = round(out["ffd"] / out["next_fit"], 3)
    out["ffd_vs_padded"] = round(out["ffd"] / out["padded"], 3)
    return {"median_len": median, "sigma": sigma, "samples": samples, "seeds": seeds, **out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/packing_fill")
    args = parser.parse_args()
    rows = [measure(*case) for case in CASES]
    command = "python bench/packing_fill.py"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"command": command, "budget": BUDGET, "rows": rows}, indent=1))
    lines = [f"# Micro-batch fill (budget {BUDGET} tokens)", "", f"Command: `{command}`", "",
             "| median len | sigma | samples | FFD | next-fit | padded x8 | FFD/next-fit | FFD/padded "
             "| FFD micro-batches over the lower bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['median_len']} | {r['sigma']} | {r['samples']} | {r['ffd']:.3f} | {r['next_fit']:.3f} | "
              f"{r['padded']:.3f} | {r['ffd_vs_next_fit']} | {r['ffd_vs_padded']} | {r['ffd_extra_micro_batches']} |"
              for r in rows]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
