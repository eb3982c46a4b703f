"""Trainer benchmark: the torch backend versus transformers fwd+bwd, and weight-push latency by method.

    python bench/trainer_bench.py [--steps 5] [--device cpu] [--sections train,push] [--train-models tiny]
                                  [--out bench/results/trainer_bench]

1. Training throughput, same weights, same samples, same micro-batch composition, same objective
   (direct double-sided IS, entropy metric included), same optimizer (AdamW, clip, indexer frozen):
   - asyncrl: TorchBackend.train_step on FFD-packed micro-batches (no padding, cu_seqlens);
   - transformers: GlmMoeDsaForCausalLM on each micro-batch's samples padded to its longest one
     (transformers has no packed-sequence path for this model on CPU), loss on the padded [B, S] tensors.
   Reported: useful (real) tokens/s for both, transformers' padded positions/s, the padding fraction.
   Two data shapes: RL-like lognormal lengths, and equal lengths (no padding: kernels alone). The two
   implementations step alternately; medians.
2. Weight push, trainer -> a real engine process (tiny model, and a larger one): the whole
   WeightSync.push (gather, snapshot for disk, pause, transfer, continue) by method, engine idle.
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
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import ModelSection, TrainerConfig, WeightPushConfig, load_model_section  # noqa: E402
from asyncrl.model.io import save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.types import Sample  # noqa: E402
from trainer.advantages import ScoredSample  # noqa: E402
from trainer.backends.base import make_backend  # noqa: E402
from trainer.losses import direct_double_sided_is_loss  # noqa: E402
from trainer.packing import MicroBatch, pack  # noqa: E402

SHAPES = {"lognormal lengths (median 192, sigma 0.6)": ("lognormal", 192, 0.6),
          "equal lengths (192)": ("equal", 192, 0.0)}
SAMPLES, BUDGET, PROMPT_FRACTION = 24, 2048, 0.25
LARGER = {"hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 256, "num_hidden_layers": 8,
          "q_lora_rank": 256, "kv_lora_rank": 128, "n_routed_experts": 16, "num_attention_heads": 8,
          "num_key_value_heads": 8, "indexer_types": ["full", "full", "shared", "full"] * 2}


# Data ----------------------------------------------------------------------------------------------
def samples(model: Glm5ForCausalLM, kind: str, median: int, sigma: float, seed: int = 0) -> list[ScoredSample]:
    """On-policy samples (rollout log-probs = the model's), a quarter prompt, advantages +-1."""
    rng = np.random.default_rng(seed)
    lengths = [median] * SAMPLES if kind == "equal" else np.clip(rng.lognormal(np.log(median), sigma, SAMPLES), 16,
                                                                 BUDGET).astype(int)
    out = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(1, 1000, n)
        mask = (np.arange(n) >= int(n * PROMPT_FRACTION)).astype(np.uint8)
        ids = torch.as_tensor(tokens)
        with torch.no_grad():
            lp = model.token_logprobs(ids[:-1], torch.tensor([0, n - 1]), ids[1:], with_entropy=False).logprobs
        sample = Sample(f"s{i}", f"sess{i}", "g", "t", "bench", "completed", float(i % 2), tokens, mask,
                        np.where(mask, np.r_[0.0, lp.numpy()], 0.0), np.where(mask, 0, -1))
        out.append(ScoredSample(sample, 1.0 if i % 2 else -1.0))
    return out


def padded(mb: MicroBatch) -> dict[str, torch.Tensor]:
    """The micro-batch's sequences as right-padded [B, S] tensors (+ attention mask)."""
    spans = list(zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()))
    width = max(e - s for s, e in spans)

    def pad(t: torch.Tensor, value=0) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(t[s:e], (0, width - (e - s)), value=value) for s, e in spans])
    return {"input_ids": pad(mb.input_ids), "attention_mask": pad(torch.ones_like(mb.input_ids)),
            "targets": pad(mb.targets), "loss_mask": pad(mb.loss_mask, False),
            "rollout_logprobs": pad(mb.rollout_logprobs), "advantages": pad(mb.advantages)}


# Training ------------------------------------------------------------------------------------------
def timed_pair(first, second, steps: int) -> tuple[float, float]:
    """Median step times of two step functions, run alternately (load drifts on a shared machine hit
    both alike), after one warm-up step each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for step, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def transformers_step(hf, optimizer, batches: list[dict[str, torch.Tensor]], normalizer: int, device) -> None:
    optimizer.zero_grad(set_to_none=True)
    for b in batches:
        b = {k: v.to(device) for k, v in b.items()}
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, b["targets"][..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss, _ = direct_double_sided_is_loss(logp, b["rollout_logprobs"], b["advantages"], b["loss_mask"], 0.2, 0.28,
                                              normalizer=normalizer, entropy=entropy)
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in hf.parameters() if p.requires_grad], 1.0)
    optimizer.step()


def bench_training(section: ModelSection, device: str, steps: int, work: Path) -> dict:
    from transformers import GlmMoeDsaForCausalLM

    model = Glm5ForCausalLM.from_config(section.arch, seed=0)
    out = {"params": sum(p.numel() for p in model.parameters())}
    save_pretrained(model, work / "train-ckpt")
    ours = make_backend(TrainerConfig(lr=1e-6, micro_batch_tokens=BUDGET, device=device),
                        replace(section, path=str(work / "train-ckpt")))
    hf = GlmMoeDsaForCausalLM.from_pretrained(work / "train-ckpt", dtype=torch.float32).to(ours.device).train()
    for name, p in hf.named_parameters():
        p.requires_grad_(".indexer." not in name)  # frozen, as in ours
    optimizer = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=1e-6)
    for label, (kind, median, sigma) in SHAPES.items():
        mbs = [mb.to(ours.device) for mb in pack(samples(model, kind, median, sigma), BUDGET)]
        normalizer = sum(mb.num_loss_tokens for mb in mbs)
        batches = [padded(mb) for mb in mbs]
        real = sum(mb.num_tokens for mb in mbs)
        positions = sum(b["input_ids"].numel() for b in batches)
        t_ours, t_hf = timed_pair(lambda: ours.train_step(mbs, normalizer),
                                  lambda: transformers_step(hf, optimizer, batches, normalizer, ours.device), steps)
        out[label] = {"micro_batches": len(mbs), "tokens": real, "padded_positions": positions,
                      "padding_fraction": 1 - real / positions, "asyncrl_step_s": t_ours, "transformers_step_s": t_hf,
                      "asyncrl_tokens_per_s": real / t_ours, "transformers_useful_tokens_per_s": real / t_hf,
                      "transformers_positions_per_s": positions / t_hf, "speedup": t_hf / t_ours}
        print(f"train [{label}]: asyncrl {real / t_ours:.0f} tok/s, transformers {real / t_hf:.0f} useful tok/s "
              f"({positions / t_hf:.0f} positions/s) -> {t_hf / t_ours:.2f}x", flush=True)
    return out


# Weight push ---------------------------------------------------------------------------------------
async def push_round(section: ModelSection, work: Path, repeats: int) -> dict:
    from asyncrl_run.redis_server import EmbeddedRedis
    from asyncrl.store import Store
    from tests.services import ServiceProcess
    from trainer.weight_push import WeightSync

    model = Glm5ForCausalLM.from_config(section.arch, seed=0)
    save_pretrained(model, work / "engine-ckpt")
    backend = make_backend(TrainerConfig(), replace(section, path=str(work / "engine-ckpt")), seed=0)
    redis = EmbeddedRedis(work / "redis").start()
    engine = ServiceProcess("rollout.server", ["--model", str(work / "engine-ckpt")], work, name="engine")
    store = Store.connect(redis.url, "bench")
    out = {"params": sum(p.numel() for p in model.parameters())}
    try:
        await store.register_engine("engine-0", engine.url)
        version = 0
        for method in ("disk", "tensor", "distributed"):
            sync = WeightSync(WeightPushConfig(method=method), store, work / f"weights-{method}")
            reports = []
            for _ in range(repeats + 1):  # the first one builds the broadcast group / warms up
                version += 1
                reports.append(await sync.push(backend, version))
                assert not reports[-1].failed, reports[-1].failed
            await sync.close()
            timed_reports = reports[1:]
            out[method] = {"mb": reports[0].bytes / 2**20, "first_push_s": reports[0].total_s,
                           **{f"{k}_p50_s": statistics.median(getattr(r, k) for r in timed_reports)
                              for k in ("total_s", "prepare_s", "pause_s", "update_s", "resume_s")}}
            w = out[method]
            print(f"push {method} ({w['mb']:.1f} MB): total {w['total_s_p50_s'] * 1e3:.1f} ms, engines paused "
                  f"{(w['pause_s_p50_s'] + w['update_s_p50_s'] + w['resume_s_p50_s']) * 1e3:.1f} ms", flush=True)
    finally:
        await store.close()
        engine.stop()
        redis.stop()
    return out


# Report --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sections", default="train,push")
    parser.add_argument("--train-models", default="tiny", help="comma-separated: tiny, larger")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "trainer_bench"))
    args = parser.parse_args()
    torch.set_num_threads(1 if args.device == "cpu" else os.cpu_count())
    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as tmp:  # checkpoints and snapshots: ~1 GB
        results = run_sections(args, Path(tmp))
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    Path(args.out + ".md").write_text(render_markdown(results))
    print(render_markdown(results))


def run_sections(args: argparse.Namespace, work: Path) -> dict:
    import transformers

    tiny = load_model_section("tiny")
    larger = replace(tiny, arch=replace(tiny.arch, **LARGER))
    results: dict = {"command": " ".join(["python", *sys.argv]), "device": args.device,
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores"
                                + (f", {torch.cuda.get_device_name()}" if args.device != "cpu" else ""),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "load_avg_start": os.getloadavg(), "samples": SAMPLES, "budget": BUDGET, "steps": args.steps}
    models = {"tiny": tiny, "larger": larger}
    if "train" in args.sections:
        results["train"] = {name: bench_training(models[name], args.device, args.steps, work / name)
                            for name in args.train_models.split(",")}
    if "push" in args.sections:
        results["push"] = {"tiny": asyncio.run(push_round(tiny, work / "tiny", args.pushes)),
                           "larger": asyncio.run(push_round(larger, work / "larger", args.pushes))}
    results["load_avg_end"] = os.getloadavg()
    return results


def render_markdown(r: dict) -> str:
    lines = ["# Trainer benchmark", "", f"Command: `{r['command']}`  ",
             f"Machine: {r['machine']}; torch {r['torch']}, transformers {r['transformers']}; load average "
             f"{r['load_avg_start'][0]:.1f} at start, {r['load_avg_end'][0]:.1f} at end."]
    if "train" in r:
        lines += ["", f"## Training step ({r['samples']} samples, micro-batch budget {r['budget']} tokens, median "
                  f"of {r['steps']} steps, device {r['device']})", "",
                  "| model | data | micro-batches | tokens | transformers padding | asyncrl tok/s | transformers "
                  "useful tok/s | transformers positions/s | asyncrl speedup |", "|---" * 9 + "|"]
        for model, rows in r["train"].items():
            for label, row in ((k, v) for k, v in rows.items() if k != "params"):
                lines.append(f"| {model} ({rows['params'] / 1e6:.1f}M) | {label} | {row['micro_batches']} | "
                             f"{row['tokens']} | {row['padding_fraction']:.0%} | {row['asyncrl_tokens_per_s']:.0f} | "
                             f"{row['transformers_useful_tokens_per_s']:.0f} | "
                             f"{row['transformers_positions_per_s']:.0f} | {row['speedup']:.2f}x |")
        lines += ["", "A step = forward + IS loss (with the entropy metric) + backward over every micro-batch, "
                  "clip, AdamW. transformers runs each micro-batch's samples padded to its longest (no packed "
                  "path): 'useful' counts real tokens, 'positions' counts padded ones too."]
    if "push" in r:
        lines += ["", "## Weight push, trainer -> one engine process (median of the timed pushes)", "",
                  "| model | method | MB | total ms | gather+snapshot ms | engines paused ms (pause / update / "
                  "continue) | first push ms |", "|---|---|---|---|---|---|---|"]
        for size, row in r["push"].items():
            for method in ("disk", "tensor", "distributed"):
                w = row[method]
                paused = w["pause_s_p50_s"] + w["update_s_p50_s"] + w["resume_s_p50_s"]
                lines.append(f"| {size} ({row['params'] / 1e6:.1f}M) | {method} | {w['mb']:.1f} | "
                             f"{w['total_s_p50_s'] * 1e3:.1f} | {w['prepare_s_p50_s'] * 1e3:.1f} | {paused * 1e3:.1f} "
                             f"({w['pause_s_p50_s'] * 1e3:.1f} / {w['update_s_p50_s'] * 1e3:.1f} / "
                             f"{w['resume_s_p50_s'] * 1e3:.1f}) | {w['first_push_s'] * 1e3:.1f} |")
        lines += ["", "total = gather weights + (disk: write the snapshot, atomic + fsync) + pause + transfer + "
                  "continue + record in Redis. tensor/distributed also write a snapshot every 10th push (not "
                  "in these medians). The first distributed push includes building the broadcast group."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
