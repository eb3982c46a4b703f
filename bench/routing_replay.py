"""What routing replay (R3) changes once the trainer's weights have moved past the rollout's.

    python bench/routing_replay.py          # writes bench/results/routing_replay.{json,md}

Rollout: the tiny model (seed 0) samples sequences through the engine's path (cached decode, temperature
1), recording each token's log-prob and routed experts. Training: two torch backends from the same
weights take the same GRPO steps (direct double-sided IS, advantages +-1) on those samples, one replaying
the rollout's routing, one routing anew. After each step, against the rollout's log-probs:
  - routing flips: (token, MoE layer) pairs where the trained router now picks other experts;
  - |log ratio| (trainer minus rollout log-prob) over generated tokens, and the share of tokens whose
    ratio leaves (1 - eps_low, 1 + eps_high), which direct double-sided IS masks out of the gradient.
The samples are re-used every step (a stale batch, as k optimizer steps behind the engine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import ModelSection, TrainerConfig  # noqa: E402
from asyncrl.types import Sample  # noqa: E402
from bench.logprob_mismatch import sample_with_decode_logprobs  # noqa: E402
from bench.model_bench import tiny_config  # noqa: E402
from trainer.advantages import ScoredSample  # noqa: E402
from trainer.backends.base import make_backend  # noqa: E402
from trainer.packing import pack  # noqa: E402


def rollout_samples(model, seqs: int, length: int, prompt: int, seed: int) -> list[ScoredSample]:
    prompts = torch.randint(3, model.config.vocab_size, (seqs, prompt), generator=torch.Generator().manual_seed(1))
    tokens, logprobs, routing = sample_with_decode_logprobs(model, prompts, length - prompt, seed)
    mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.uint8)
    out = []
    for i in range(seqs):
        lp = np.r_[np.zeros(prompt), logprobs[i].numpy()].astype(np.float32)
        sample = Sample(sample_id=f"s{i}", session_id=f"s{i}", group_id=f"g{i // 2}", task_id="t", env="bench",
                        status="completed", reward=float(i % 2), tokens=tokens[i].numpy(), loss_mask=mask,
                        rollout_logprobs=lp, weight_versions=np.where(mask, 0, -1),
                        routed_experts=routing[i].flatten(1).numpy())
        out.append(ScoredSample(sample, advantage=1.0 if i % 2 else -1.0))
    return out


def own_routing(model, micro_batch) -> torch.Tensor:
    """The experts `model` routes the micro-batch's positions to: [T, layers, k] (-1 on dense layers)."""
    recorded = []

    def keep(module, args, out):
        recorded.append(out[1])

    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [m.register_forward_hook(keep) for m in moe]
    try:
        with torch.no_grad():
            model.token_logprobs(micro_batch.input_ids, micro_batch.cu_seqlens, micro_batch.targets, with_entropy=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(recorded, 1)  # [T, MoE layers, k]


def measure(backend, micro_batches, replayed: bool, eps_low: float, eps_high: float) -> dict:
    diffs, flips, decisions = [], 0, 0
    for mb in micro_batches:
        lp = backend.logprobs(mb if replayed else replace(mb, routed_experts=None))
        diffs.append((lp - mb.rollout_logprobs)[mb.loss_mask])
        config = backend.model.config
        rollout = mb.routed_experts.long().view(mb.num_tokens, config.num_hidden_layers, -1)
        moe = [i for i, kind in enumerate(config.layer_mlp_types) if kind == "sparse"]
        now = own_routing(backend.model, mb)
        differs = (now.sort(-1).values != rollout[:, moe].sort(-1).values).any(-1)
        flips, decisions = flips + int(differs.sum()), decisions + differs.numel()
    diff = torch.cat(diffs)
    ratio = diff.exp()
    masked = (ratio <= 1 - eps_low) | (ratio >= 1 + eps_high)
    return {"mean_abs_log_ratio": float(diff.abs().mean()), "max_abs_log_ratio": float(diff.abs().max()),
            "is_masked": float(masked.float().mean()), "routing_flips": flips / decisions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    section = ModelSection(arch=tiny_config())
    cfg = TrainerConfig(lr=args.lr, micro_batch_tokens=2048)
    backends = {mode: make_backend(cfg, section, seed=0) for mode in ("routed anew", "replayed")}
    samples = rollout_samples(backends["replayed"].model, args.seqs, args.length, args.prompt, seed=0)
    micro_batches = pack(samples, cfg.micro_batch_tokens)
    normalizer = sum(mb.num_loss_tokens for mb in micro_batches)
    rows = []
    for step in range(args.steps + 1):
        row = {"step": step}
        for mode, backend in backends.items():
            replayed = mode == "replayed"
            if step:
                backend.train_step(micro_batches if replayed else
                                   [replace(mb, routed_experts=None) for mb in micro_batches], normalizer)
            row[mode] = measure(backend, micro_batches, replayed, cfg.loss.eps_low, cfg.loss.eps_high)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"command": "python bench/routing_replay.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "seqs": args.seqs, "length": args.length,
              "prompt": args.prompt, "lr": args.lr, "eps_low": cfg.loss.eps_low, "eps_high": cfg.loss.eps_high,
              "rows": rows}
    if not args.no_write:
        out = ROOT / "bench" / "results"
        (out / "routing_replay.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "routing_replay.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# Routing replay (R3) once the trainer has moved past the rollout", "",
             f"Command: `{r['command']}`  ",
             f"Machine: {r['machine']}; tiny model (seed 0), {r['seqs']} sampled sequences of {r['length']} tokens "
             f"(prompt {r['prompt']}), AdamW lr {r['lr']:g}, the same batch every step; IS-masked: ratio outside "
             f"(1 - {r['eps_low']}, 1 + {r['eps_high']}).", "",
             "| steps behind | routing flips | mean abs log ratio (anew / replayed) | max abs log ratio (anew / replayed) "
             "| IS-masked (anew / replayed) |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        a, b = row["routed anew"], row["replayed"]
        lines.append(f"| {row['step']} | {a['routing_flips']:.2%} | {a['mean_abs_log_ratio']:.4f} / "
                     f"{b['mean_abs_log_ratio']:.4f} | {a['max_abs_log_ratio']:.3f} / {b['max_abs_log_ratio']:.3f} | "
                     f"{a['is_masked']:.2%} / {b['is_masked']:.2%} |")
    lines += ["", "Routing flips: (token, MoE layer) pairs where the model trained without replay now routes "
              "differently from the rollout (the replaying one uses the rollout's experts by construction)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
