"""asyncrl's GLM-5 model against transformers 5.24.0 on the same weights (configs/model/tiny.yaml), in one run.

    python bench/model_bench.py                    # writes bench/results/model_bench.{json,md}
    python bench/model_bench.py --quick            # smaller sizes, prints only (smoke test)
    python bench/model_bench.py --memory-probe sparse:4096 dense:4096   # peak bytes of one attention layer

Measures (ours and transformers alternate, medians of several runs, ratios = ours / transformers). Times are
the process's CPU time (one torch thread): equal to wall-clock on an idle machine, and far less disturbed
by the other tenants of a shared 2-core box than wall-clock is.
  train   forward+backward tokens/s of teacher-forced log-probs + entropy over a packed batch
  decode  greedy generation tokens/s (prefill included) at several batch sizes: asyncrl.model.generate
          (latent slot-pool cache) vs transformers' generate (its DynamicCache)
  memory  peak RSS added by one MLA + indexer layer forward at T = 1k..4k, k = 64: sparse gather vs dense
          mask (a child process with big buffers mmapped, VmHWM reset through /proc/self/clear_refs per probe)
  parity  max |logit difference| vs transformers, cached decode vs full forward, batch invariance
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from asyncrl.config import ModelSection  # noqa: E402
from asyncrl.model.batch import ForwardBatch  # noqa: E402
from asyncrl.model.config import ModelConfig  # noqa: E402
from asyncrl.model.generate import greedy_generate  # noqa: E402
from asyncrl.model.io import save_pretrained  # noqa: E402
from asyncrl.model.kv_cache import KVCache  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402


def tiny_config() -> ModelConfig:
    merged = OmegaConf.merge(OmegaConf.structured(ModelSection), OmegaConf.load(ROOT / "configs/model/tiny.yaml"))
    return OmegaConf.to_object(merged).arch


def timed(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def alternate(ours, theirs, reps: int) -> tuple[float, float]:
    """Median seconds of each, run interleaved so both see the same machine load."""
    ours(), theirs()  # warm-up
    times = [(timed(ours), timed(theirs)) for _ in range(reps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


# Train ------------------------------------------------------------------------------------------
def bench_train(model, reference, num_seqs: int, length: int, reps: int) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (num_seqs, length), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, dims=1)
    cu = torch.arange(num_seqs + 1) * length

    def ours():
        out = model.token_logprobs(ids.flatten(), cu, targets.flatten())
        (-out.logprobs.mean() - 0.01 * out.entropy.mean()).backward()

    def theirs():
        logp_all = reference(ids).logits.float().log_softmax(-1)
        logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        (-logp.mean() - 0.01 * entropy.mean()).backward()

    t_ours, t_theirs = alternate(ours, theirs, reps)
    tokens = num_seqs * length
    return {"tokens": tokens, "ours_tok_s": tokens / t_ours, "transformers_tok_s": tokens / t_theirs,
            "ratio": t_theirs / t_ours}


# Decode -----------------------------------------------------------------------------------------
def bench_decode(model, reference, batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=generator)

    def ours(count: int = new_tokens):
        return greedy_generate(model, prompts.tolist(), count)

    def theirs():
        return reference.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False)

    with torch.no_grad():
        same = _agreement(ours(), theirs()[:, prompt_len:].tolist())
        t_ours, t_theirs = alternate(ours, theirs, reps)
        t_prefill = statistics.median(timed(lambda: ours(1)) for _ in range(reps))
    tokens = batch * new_tokens
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "ours_tok_s": tokens / t_ours,
            "transformers_tok_s": tokens / t_theirs, "ratio": t_theirs / t_ours,
            "ours_decode_only_tok_s": batch * (new_tokens - 1) / (t_ours - t_prefill), "same_greedy_tokens": same}


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of greedy tokens equal (a near-tie that flips one token changes the rest of its sequence)."""
    return sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)) / sum(len(x) for x in ours)


# Memory -----------------------------------------------------------------------------------------
def memory_probe(impl: str, length: int) -> int:
    """Peak resident bytes added by one layer-0 attention (MLA + indexer) forward over `length` tokens."""
    from asyncrl.model.attention import AttentionContext
    from asyncrl.model.rope import RotaryEmbedding

    config = tiny_config()
    layer = Glm5ForCausalLM.from_config(config).model.layers[0].self_attn.eval()
    x = torch.randn(length, config.hidden_size)
    batch = ForwardBatch.packed(torch.zeros(length, dtype=torch.long), torch.tensor([0, length]), attention_impl=impl)
    ctx = AttentionContext(batch, RotaryEmbedding(config)(batch.positions))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    with torch.no_grad():
        layer(x, ctx, None)
    return (_status_kb("VmHWM") - before) * 1024


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_bytes(probes: list[tuple[str, int]]) -> list[int]:
    """Run memory probes in a child process whose large buffers are mmapped (RSS follows live memory)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    specs = [f"{impl}:{length}" for impl, length in probes]
    out = subprocess.run([sys.executable, __file__, "--memory-probe", *specs], env=env, capture_output=True,
                         text=True, check=True, timeout=600)
    return [int(line) for line in out.stdout.split()]


def bench_memory(lengths: list[int]) -> list[dict]:
    probes = [(impl, length) for length in lengths for impl in ("sparse", "dense")]
    peaks = iter(peak_bytes(probes))
    return [{"T": length, "k": tiny_config().index_topk, "sparse_peak_mb": next(peaks) / 2**20,
             "dense_peak_mb": next(peaks) / 2**20} for length in lengths]


# Parity -----------------------------------------------------------------------------------------
def measure_parity(model, reference) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, 200), generator=generator)
    with torch.no_grad():
        logit_diff = (model(ids) - reference(ids).logits).abs().max().item()
        lens = [70, 130, 9, 200]
        seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=generator) for n in lens]
        full = [model(s[None])[0] for s in seqs]
        decode_diff = _cached_decode_diff(model, seqs, full, prompt_len=5)
        batched = model.token_logprobs(torch.cat(seqs), torch.tensor([0, *lens]).cumsum(0), torch.cat(seqs)).logprobs
        alone = model.token_logprobs(seqs[1], torch.tensor([0, 130]), seqs[1]).logprobs
    return {"max_abs_logit_diff_vs_transformers": logit_diff, "max_abs_logit_diff_cached_decode_vs_full": decode_diff,
            "max_abs_logprob_diff_batched_vs_alone": (batched[70:200] - alone).abs().max().item()}


def _cached_decode_diff(model, seqs, full, prompt_len: int) -> float:
    """Prefill prompt_len tokens of each sequence, then decode the rest one step at a time (ragged)."""
    cache = KVCache(model.config, sum(len(s) for s in seqs))
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    slots = [list(range(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]
    diff, done = 0.0, [prompt_len] * len(seqs)
    batch = ForwardBatch.from_lists([s[:prompt_len].tolist() for s in seqs], [sl[:prompt_len] for sl in slots])
    model.forward_batch(batch, cache)
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        batch = ForwardBatch.from_lists([[int(seqs[i][done[i]])] for i in live],
                                        [slots[i][: done[i] + 1] for i in live])
        logits = model.forward_batch(batch, cache)
        for row, i in enumerate(live):
            diff = max(diff, (logits[row] - full[i][done[i]]).abs().max().item())
            done[i] += 1
    return diff


# Report -----------------------------------------------------------------------------------------
def run(args) -> dict:
    torch.set_num_threads(args.threads)
    from transformers import GlmMoeDsaForCausalLM

    model = Glm5ForCausalLM.from_config(tiny_config(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        reference = GlmMoeDsaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    quick = args.quick
    result = {
        "command": "python bench/model_bench.py" + (" --quick" if quick else "") + f" --threads {args.threads}",
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version()},
        "model": {"config": "configs/model/tiny.yaml", "parameters": sum(p.numel() for p in model.parameters()),
                  "transformers_attn_implementation": reference.config._attn_implementation},
        "train": [bench_train(model, reference, n, length, reps=2 if quick else 5)
                  for n, length in ([(2, 128)] if quick else [(8, 256), (4, 1024)])],
        "decode": [bench_decode(model.eval(), reference.eval(), b, 64 if quick else 128, 16 if quick else 64,
                                reps=1 if quick else 3) for b in ([1, 8] if quick else [1, 8, 32, 64, 128])],
        "memory": bench_memory([256, 512] if quick else [1024, 2048, 4096]),
        "parity": measure_parity(model, reference),
    }
    return result


def markdown(result: dict) -> str:
    lines = ["# Model benchmark: asyncrl GLM-5 vs transformers 5.24.0 (same safetensors)", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             "Throughput is tokens per CPU-second of the process (1 torch thread), medians of interleaved runs.  ",
             f"Model: {result['model']}", "", "## Train (forward + backward, log-probs + entropy)", "",
             "| tokens | asyncrl tok/s | transformers tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['ours_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x |"
              for r in result["train"]]
    lines += ["", "## Greedy generation (prefill included; last column: asyncrl's decode steps alone)", "",
              "| batch | prompt | new | asyncrl tok/s | transformers tok/s | ratio | same tokens | asyncrl decode tok/s |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | {r['ours_tok_s']:.0f} | "
              f"{r['transformers_tok_s']:.0f} | {r['ratio']:.2f}x | {r['same_greedy_tokens']:.1%} | "
              f"{r['ours_decode_only_tok_s']:.0f} |" for r in result["decode"]]
    lines += ["", "## Peak memory added by one attention + indexer layer forward (T tokens, no grad)", "",
              "| T | k | sparse gather MB | dense mask MB |", "|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['k']} | {r['sparse_peak_mb']:.1f} | {r['dense_peak_mb']:.1f} |"
              for r in result["memory"]]
    lines += ["", "## Parity", ""] + [f"- {k}: {v:.3g}" for k, v in result["parity"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes; print, do not write results")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared 2-core box)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--memory-probe", nargs="+", metavar="IMPL:T", help="print peak bytes per probe, one a line")
    args = parser.parse_args()
    if args.memory_probe:
        torch.set_num_threads(1)
        memory_probe("sparse", 64)  # warm-up: one-time allocations (BLAS buffers, ...) stay out of the probes
        for spec in args.memory_probe:
            impl, length = spec.split(":")
            print(memory_probe(impl, int(length)), flush=True)
        return
    result = run(args)
    print(markdown(result))
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model_bench.json").write_text(json.dumps(result, indent=2))
        (args.out / "model_bench.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
