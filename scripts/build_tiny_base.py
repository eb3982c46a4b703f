"""Build asyncrl/assets/tiny_base/, the tiny GLM-5 pretrained on copying digits: the main job's base model.

A real RL run starts from a pretrained LM, which copies text already; the tiny model would start from random
weights. This script trains it on the copy task (envs.tasks.CopyEnv over digits, the warm-up stage the main
job used to run first) until the task's loss is far past its learning jump, and saves the weights (bf16, as
a released base is) with the main job's architecture. The jump comes at a step that depends on the sample
stream and on the CPU's floating point (measured: ~1,000 steps on an Intel host, ~1,250 and not by 1,840 on an
AMD EPYC one for two sample streams), so the main job starts from these committed bits instead of training
them at every run, on every host differently (docs/envs.md "File lookup").

    python scripts/build_tiny_base.py                     # rewrites the committed asset (~7 min on 2 cores)
    python scripts/build_tiny_base.py --out /tmp/base
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.config import WarmupConfig, WarmupStage  # noqa: E402  (import after the repo is on sys.path)
from asyncrl.model.io import load_pretrained, save_pretrained  # noqa: E402
from asyncrl_run.evaluate import compose  # noqa: E402
from trainer.sft import warmup  # noqa: E402

COPY = WarmupStage(env="envs.tasks.CopyEnv", env_options={"alphabet": "0123456789", "min_len": 2, "max_len": 8},
                   steps=2400, batch_size=64, until_loss=0.005)
"""Batch 64 at lr 3e-3 (the warm-up's); stops once 20 steps average below 0.005 (past the jump, which ends
near 0.03), else after 2,400 steps."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "asyncrl" / "assets" / "tiny_base"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = compose(["experiment=file_lookup", "model.path=null"]).model
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work:  # the warm-up saves fp32 master weights; the asset is bf16
        warmup(model, WarmupConfig(stages=[COPY], steps=0, lr=3e-3), work, args.seed)
        save_pretrained(load_pretrained(work), args.out, dtype=torch.bfloat16)
    (Path(args.out) / "BUILD.json").write_text(json.dumps({
        "command": "python scripts/build_tiny_base.py", "seed": args.seed, "stage": dataclasses.asdict(COPY),
        "seconds": round(time.monotonic() - started), "host": _cpu()}, indent=2) + "\n")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
