"""Speculative decoding with the MTP layer (docs/engine.md): accept length and engine throughput.

    python bench/speculative.py [--rl-steps 20] [--parts warmup,rl,depths,throughput] [--out ...]

1. Accept length on the tiny_demo model after its supervised warm-up with the MTP loss
   (`warmup.mtp_loss_coef 1`, the demo's 100 steps of ArithmeticEnv demonstrations, the layer trained at 3
   depths), without and with the MTP self-distillation (`warmup.mtp_distill_samples 1024`), on arithmetic
   prompts the warm-up did not see, at temperature 1 (what RL samples) and 0, with 1-3 drafts.
2. Along an RL run: two tiny_demo runs of --rl-steps steps with speculation on, from the distilled warm-up
   of part 1, one training the MTP layer online (`trainer.mtp_loss_coef 1`), one not; accept length of
   every checkpoint (every 5 steps) on the same prompts at temperature 1.
3. Throughput at concurrency 1, 8, 32, 128: the engine in this process without speculation and with 1-3
   drafts, and transformers' generate, on the same weights in the same run, 64 tokens a request, every
   column of a row in turns (REPEATS). Two
   models of the tiny widths: the tiny model (4 layers: its MTP layer costs ~40% of a target forward) and a
   24-layer one (~5%, nearer GLM-5's 1 MTP layer to 78). Their MTP layers are fitted (3 depths) to each
   model's own greedy text, the drafter a trained MTP layer approximates; a random one is never accepted.
4. (`depths`) Accept length of the tiny model's MTP layer fitted at depth 1 only and at depths 1-3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.chat_template import GlmChatTemplate  # noqa: E402
from asyncrl.config import WarmupConfig, load_model_section  # noqa: E402
from asyncrl.model.generate import greedy_generate  # noqa: E402
from asyncrl.model.io import save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.protocols.engine import GenerateItem, SamplingParams  # noqa: E402
from asyncrl.tokenizer import load_tokenizer  # noqa: E402
from bench.engine_bench import CONCURRENCY, prompts, transformers_round  # noqa: E402
from envs.tasks import ArithmeticEnv  # noqa: E402
from rollout.engine import Engine, EngineArgs  # noqa: E402
from rollout.request import Req  # noqa: E402
from trainer.mtp_loss import fit_mtp_layer  # noqa: E402
from trainer.sft import tokenize_dialogue, warmup  # noqa: E402

DRAFTS = (1, 2, 3)


def generate_all(engine: Engine, items: list[GenerateItem]) -> tuple[list[Req], float]:
    """Submit every item at once; -> the finished requests and the seconds they took."""
    finished = threading.Semaphore(0)
    start = time.perf_counter()
    reqs = [engine.submit(engine.request(item, lambda req: finished.release() if req.finished else None))
            for item in items]
    for _ in reqs:
        finished.acquire()
    return reqs, time.perf_counter() - start


def accept_length(reqs: list[Req]) -> float:
    """SGLang's: completion tokens / verification forwards."""
    return sum(len(r.output_ids) for r in reqs) / max(sum(r.spec_verify_ct for r in reqs), 1)


def arithmetic_prompts(count: int) -> list[list[int]]:
    """The demo's chat-templated problems, from a demonstration stream the warm-up (seed 0) does not use."""
    template = GlmChatTemplate(load_tokenizer("builtin:tiny"), thinking=False)
    dialogues = ArithmeticEnv().demonstrations(count, seed=1000)
    return [tokens[:mask.index(1)] for tokens, mask in (tokenize_dialogue(template, d) for d in dialogues)]


def measure_accept(checkpoint: Path, drafts: int, temperature: float, count: int = 256) -> dict:
    engine = Engine(EngineArgs(model_path=str(checkpoint), speculative_algorithm="EAGLE",
                               speculative_num_steps=drafts)).start()
    try:
        items = [GenerateItem(rid=f"a{i}", input_ids=p, sampling=SamplingParams(
            max_new_tokens=8, temperature=temperature, sampling_seed=i))
            for i, p in enumerate(arithmetic_prompts(count))]
        reqs, _ = generate_all(engine, items)
    finally:
        engine.stop()
    return {"accept_length": accept_length(reqs), "tokens_per_request": sum(len(r.output_ids) for r in reqs) / count}


def after_warmup(work: Path) -> dict:
    """The demo's warm-up with the MTP loss, then the same with the self-distillation; -> accept lengths."""
    out: dict = {}
    for name, distill in (("sft", 0), ("sft_distilled", 1024)):
        cfg = WarmupConfig(steps=100, env="envs.tasks.ArithmeticEnv", batch_size=32, lr=3e-3, mtp_loss_coef=1.0,
                           mtp_depths=3, mtp_distill_samples=distill)
        start = time.perf_counter()
        checkpoint = Path(warmup(load_model_section("tiny"), cfg, str(work / name)))
        out[name] = {"warmup_s": time.perf_counter() - start}
        for temperature in (1.0, 0.0):
            for k in DRAFTS:
                out[name][f"t{temperature:g}_drafts{k}"] = row = measure_accept(checkpoint, k, temperature)
                print(f"{name}, T={temperature:g}, {k} drafts: {row}", flush=True)
    return out


def rl_run(work: Path, name: str, mtp_coef: float, steps: int) -> dict:
    """One tiny_demo run with speculation on, from part 1's distilled warm-up; -> accept length of each of its
    checkpoints."""
    run_dir = work / name
    shutil.copytree(work / "sft_distilled", run_dir / "warmup")  # the run starts from part 1's warm-up
    argv = [sys.executable, "-m", "asyncrl_run.train", "experiment=tiny_demo", f"name={name}", f"run_dir={run_dir}",
            f"total_steps={steps}", f"trainer.mtp_loss_coef={mtp_coef}",
            "rollout.speculative=true", "trainer.keep_checkpoints=100", "trainer.checkpoint_every=5"]
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {"run_s": time.perf_counter() - start, "steps": {}}
    checkpoints = [("0 (warm-up)", run_dir / "warmup")]
    checkpoints += [(str(int(p.name.split("-")[1])), p / "model")
                    for p in sorted((run_dir / "checkpoints").glob("step-*"))]
    for step, path in checkpoints:
        out["steps"][step] = measure_accept(path, 2, 1.0)["accept_length"]
        print(f"{name}: step {step}: accept length {out['steps'][step]:.2f}", flush=True)
    return out


def distilled_checkpoint(work: Path, layers: int, depths: int = 3) -> Path:
    """The tiny model's widths with `layers` layers (seed 0), its MTP layer fitted for 150 steps at `depths`
    depths to the model's own greedy continuations of the first 64 prompts."""
    arch = load_model_section("tiny").arch
    if layers != arch.num_hidden_layers:
        arch = dataclasses.replace(arch, num_hidden_layers=layers,
                                   indexer_types=(list(arch.indexer_types) * layers)[:layers])
    model = Glm5ForCausalLM.from_config(arch, seed=0).eval()
    seeds = prompts(64)
    fit_mtp_layer(model, [p + o for p, o in zip(seeds, greedy_generate(model, seeds, 64))], steps=150,
                  depths=depths)
    save_pretrained(model, work / f"distilled-{layers}-{depths}")
    return work / f"distilled-{layers}-{depths}"


def depth_gain(work: Path) -> dict:
    """Accept length at T = 0 (32 of the fitted prompts) of the tiny model's MTP layer fitted at depth 1 only
    and at depths 1-3, with 1-3 drafts: what training the depths the later drafts use is worth."""
    out: dict = {}
    for depths in (1, 3):
        checkpoint = distilled_checkpoint(work, 4, depths)
        for k in DRAFTS:
            engine = Engine(EngineArgs(model_path=str(checkpoint), speculative_algorithm="EAGLE",
                                       speculative_num_steps=k)).start()
            try:
                out[f"depths{depths}_drafts{k}"] = engine_round(engine, 32, 0.0)["accept_length"]
            finally:
                engine.stop()
            print(f"fitted at {depths} depths, {k} drafts: accept length {out[f'depths{depths}_drafts{k}']:.2f}",
                  flush=True)
    return out


def engine_round(engine: Engine, concurrency: int, temperature: float, new_tokens: int = 64) -> dict:
    items = [GenerateItem(rid=f"w{i}", input_ids=p, sampling=SamplingParams(
        max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True, sampling_seed=i))
        for i, p in enumerate(prompts(concurrency))]
    reqs, elapsed = generate_all(engine, items)
    return {"tokens_per_s": concurrency * new_tokens / elapsed, "accept_length": accept_length(reqs)}


COLUMNS = [(0, 1.0), (0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (2, 1.0), (3, 1.0)]
"""(drafts, temperature) of the throughput table."""
REPEATS = 2
"""Rounds per cell. This machine's speed drifts by up to ~1.5x over tens of seconds (measured: the same
decode round 32 then 50 ms a step half a minute apart), so the cells of one row are measured in turns, each
round of every column before the next, and a cell is the median of its rounds."""


def throughput(work: Path, layers: int) -> dict:
    import transformers

    checkpoint = distilled_checkpoint(work, layers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engines = {drafts: Engine(EngineArgs(model_path=str(checkpoint), max_running_requests=128, **(
        {"speculative_algorithm": "EAGLE", "speculative_num_steps": drafts} if drafts else {}))).start()
        for drafts in (0, *DRAFTS)}
    out: dict = {c: {} for c in CONCURRENCY}
    try:
        for engine in engines.values():
            engine_round(engine, 1, 1.0)  # warm
        for c in CONCURRENCY:
            rounds: dict = {column: [] for column in COLUMNS}
            hf_rates = []
            for _ in range(REPEATS):
                for drafts, temperature in COLUMNS:
                    rounds[drafts, temperature].append(engine_round(engines[drafts], c, temperature))
                hf_rates.append(transformers_round(hf, c, 64)["tokens_per_s"])
            out[c]["transformers_t1"] = {"tokens_per_s": statistics.median(hf_rates), "rounds_tokens_per_s": hf_rates}
            for (drafts, temperature), rows in rounds.items():
                rates = sorted(r["tokens_per_s"] for r in rows)
                out[c][f"drafts{drafts}_t{temperature:g}"] = row = {
                    "tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
                    "accept_length": rows[0]["accept_length"]}
                print(f"{layers} layers, concurrency {c}, {drafts} drafts, T={temperature:g}: {row}", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--parts", default="warmup,rl,depths,throughput")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculative"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    results: dict = {"command": " ".join(["python", *sys.argv]), "load_avg_start": os.getloadavg(),
                     "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    parts = args.parts.split(",")
    if "warmup" in parts:
        results["after_warmup"] = after_warmup(work)
    if "rl" in parts:
        results["rl"] = {name: rl_run(work, name, coef, args.rl_steps)
                         for name, coef in (("online_mtp", 1.0), ("frozen_mtp", 0.0))}
    if "depths" in parts:
        results["depths"] = depth_gain(work)
    if "throughput" in parts:
        results["throughput"] = {f"{layers}_layers": throughput(work, layers) for layers in (4, 24)}
    results["load_avg_end"] = os.getloadavg()
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
