"""Rollout-path versus trainer-path log-probs of the same sampled tokens, by context length.

    python bench/logprob_mismatch.py                  # writes bench/results/logprob_mismatch.{json,md}
    python bench/logprob_mismatch.py --seqs 2 --length 512 --no-write   # smoke run

The engine computes a token's log-prob during cached decode (one query, the latent cache); the trainer
recomputes it by a teacher-forced full forward over the packed sequence. Both compute the same function,
but fp32 rounding differs between the two kernel paths (~1e-7 relative). Where a DSA indexer score sits
within that rounding of the k-th largest score (a near tie: unlike an exact tie, no tie-break rule can
settle it), the two paths select different keys and the token's log-prob moves by up to ~1e-2; the
changed hidden state then reaches later tokens that attend to it. This measures how often, and what it
does to the importance ratios of direct double-sided IS (trainer.loss.eps_low / eps_high).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import LossConfig  # noqa: E402
from asyncrl.model.batch import ForwardBatch  # noqa: E402
from asyncrl.model.kv_cache import KVCache  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.model.near_ties import recorded_selection_margins  # noqa: E402
from bench.model_bench import tiny_config  # noqa: E402

TOLERANCE = 1e-5
NEAR_TIE_MARGIN = 3e-5
"""A query whose k-th and (k+1)-th index scores differ by less than this, relatively, is at a near tie."""


@torch.no_grad()
def sample_with_decode_logprobs(model: Glm5ForCausalLM, prompts: torch.Tensor, new_tokens: int, seed: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature-1 sampling through the engine's path (prefill, then one cached decode step per token).
    -> tokens [B, P + new], the decode-path log-prob of every sampled token [B, new], and the experts the
    engine routed each token to [B, P + new, layers, top_k] (-1: dense layers, and the last token)."""
    generator = torch.Generator().manual_seed(seed)
    num_seqs, prompt_len = prompts.shape
    width = prompt_len + new_tokens
    cache = KVCache(model.config, num_seqs * width, record_routing=True)
    slots = torch.arange(num_seqs * width).view(num_seqs, width)  # [B, width]
    lens = torch.full((num_seqs,), prompt_len)
    batch = ForwardBatch(prompts.flatten(), lens.clone(), slots[:, :prompt_len], lens.clone(),
                         logits_indices=lens.cumsum(0) - 1)
    logits = model.forward_batch(batch, cache)  # [B, V]
    tokens, logprobs = [prompts], []
    for step in range(new_tokens):
        logp = logits.float().log_softmax(-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
        tokens.append(token)
        logprobs.append(logp.gather(1, token))
        if step + 1 < new_tokens:
            lens += 1
            logits = model.forward_batch(ForwardBatch(token.flatten(), torch.ones_like(lens),
                                                      slots[:, : int(lens.max())], lens.clone()), cache)
    return torch.cat(tokens, 1), torch.cat(logprobs, 1), cache.routed_experts[slots]


@torch.no_grad()
def teacher_forced(model: Glm5ForCausalLM, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The trainer's view: log p(token_t | tokens_<t) from one packed full forward. -> [B, new]"""
    num_seqs, width = tokens.shape
    flat = tokens.flatten()
    out = model.token_logprobs(flat, torch.arange(num_seqs + 1) * width, flat.roll(-1), with_entropy=False)
    return out.logprobs.view(num_seqs, width)[:, prompt_len - 1:-1]


@torch.no_grad()
def query_margins(model: Glm5ForCausalLM, sequence: torch.Tensor) -> torch.Tensor:
    """Each query's smallest selection margin over the indexer layers in the teacher-forced forward. -> [T]"""
    with recorded_selection_margins(model) as margins:
        model.token_logprobs(sequence, torch.tensor([0, len(sequence)]), sequence.roll(-1), with_entropy=False)
    return torch.stack(margins).flatten(1).amin(0)


def onset_margins(model: Glm5ForCausalLM, tokens: torch.Tensor, first: list) -> dict:
    """Is each divergence a near tie? The margin of the query that predicts a sequence's first divergent
    token, beside how often any query sits that close (what a divergence with no tie would meet by chance)."""
    onsets, near = [], []
    for row, position in zip(tokens, first):
        if position is not None:
            margins = query_margins(model, row)
            onsets.append(float(margins[position - 1]))
            near.append(float((margins < NEAR_TIE_MARGIN).float().mean()))
    return {"onset_margins": onsets, "queries_below_near_tie_margin": sum(near) / len(near) if near else None}


def summarise(diff: torch.Tensor, prompt_len: int, buckets: list[int], eps_low: float, eps_high: float) -> dict:
    """diff [B, new]: trainer minus rollout log-prob per sampled token."""
    positions = torch.arange(diff.shape[1]) + prompt_len  # context position of each sampled token
    ratio = diff.exp()
    outside = (ratio <= 1 - eps_low) | (ratio >= 1 + eps_high)
    rows, lower = [], 0
    for upper in buckets:
        cols = (positions >= lower) & (positions < upper)
        d = diff[:, cols].abs()
        rows.append({"positions": f"{lower}-{upper - 1}", "tokens": d.numel(),
                     "over_tolerance": float((d > TOLERANCE).float().mean()), "max_abs": float(d.max()),
                     "mean_abs": float(d.mean()), "is_masked": float(outside[:, cols].float().mean())})
        lower = upper
    first = [int(positions[(row.abs() > TOLERANCE)][0]) if bool((row.abs() > TOLERANCE).any()) else None
             for row in diff]
    return {"buckets": rows, "first_divergent_position": first,
            "mismatch_kl": float((ratio - diff - 1).mean())}  # k3, as trainer/losses.py reports it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048, help="context length of each sampled sequence")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    torch.set_num_threads(1)
    config = tiny_config()
    model = Glm5ForCausalLM.from_config(config, seed=args.seed).eval()
    prompts = torch.randint(3, config.vocab_size, (args.seqs, args.prompt), generator=torch.Generator().manual_seed(1))
    tokens, rollout, _ = sample_with_decode_logprobs(model, prompts, args.length - args.prompt, args.seed)
    diff = teacher_forced(model, tokens, args.prompt) - rollout
    buckets = [b for b in (config.index_topk + 1, 256, 512, 1024, 1536, 2048, 4096) if b < args.length] + [args.length]
    trainer = LossConfig()
    result = {"command": "python bench/logprob_mismatch.py " + " ".join(sys.argv[1:]), "load_at_start": load_at_start,
              "model": "configs/model/tiny.yaml, seed %d (index_topk %d, %d index heads)" % (
                  args.seed, config.index_topk, config.index_n_heads),
              "seqs": args.seqs, "length": args.length, "prompt": args.prompt, "tolerance": TOLERANCE,
              "eps_low": trainer.eps_low, "eps_high": trainer.eps_high,
              **summarise(diff, args.prompt, buckets, trainer.eps_low, trainer.eps_high)}
    result |= {"near_tie_margin": NEAR_TIE_MARGIN, **onset_margins(model, tokens, result["first_divergent_position"])}
    print(json.dumps(result, indent=1))
    if not args.no_write:
        out = ROOT / "bench" / "results"
        (out / "logprob_mismatch.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "logprob_mismatch.md").write_text(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# Rollout (cached decode) vs trainer (teacher-forced) log-probs of the same tokens", "",
             f"Command: `{r['command']}` (1-minute load at start {r['load_at_start']:.2f})  ", f"Model: {r['model']}; {r['seqs']} sequences of {r['length']} tokens "
             f"(prompt {r['prompt']}), temperature 1, fp32, 1 thread.  ",
             f"A token counts as divergent when |trainer - rollout| > {r['tolerance']:g}; IS-masked: ratio outside "
             f"(1 - {r['eps_low']}, 1 + {r['eps_high']}).", "",
             "| context positions | tokens | divergent | max abs diff | mean abs diff | IS-masked |",
             "|---|---|---|---|---|---|"]
    for b in r["buckets"]:
        lines.append(f"| {b['positions']} | {b['tokens']} | {b['over_tolerance']:.2%} | {b['max_abs']:.1e} | "
                     f"{b['mean_abs']:.1e} | {b['is_masked']:.2%} |")
    first = [p for p in r["first_divergent_position"] if p is not None]
    lines += ["", f"First divergent position per sequence: {r['first_divergent_position']} "
              f"({len(first)} of {r['seqs']} sequences diverge; earliest {min(first) if first else '-'}).  ",
              f"Mismatch KL (k3, as the trainer's `mismatch_kl` metric): {r['mismatch_kl']:.2e}.  "]
    if first:
        onsets = r["onset_margins"]
        below = sum(m < r["near_tie_margin"] for m in onsets)
        lines += [f"Selection margin of the query before each first divergence (teacher-forced): "
                  f"{', '.join(f'{m:.1e}' for m in onsets)}; {below} of {len(onsets)} below {r['near_tie_margin']:g}, "
                  f"where {r['queries_below_near_tie_margin']:.2%} of all queries of those sequences are."]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
