"""The megatron backend for real on one CUDA GPU: parity with asyncrl's torch model, steps, tokens/s.

Run through scripts/gpu_check_megatron.sh (installs the carried megatron-core wheel). Prints a report
and writes it as JSON to $OUT/megatron_gpu.json (or ./megatron_gpu.json).

  tiny   configs/model/tiny.yaml, fp32: log-prob max |diff| vs the torch model on CUDA, first-step
         loss and grad norm vs the torch reference step, frozen indexer bit-identical after 3 steps.
  large  a ~0.5B-parameter GLM-5 shape (8 layers, hidden 1024, 32 experts top-4, index_topk 512) on
         2 x 4096-token packed micro-batches with 1024-token sequences (DSA selects): fp32 parity,
         then bf16 train steps; tokens/s of megatron vs the torch model doing the same step.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from asyncrl.config import TrainerConfig, load_model_section
from asyncrl.model.config import ModelConfig
from asyncrl.model.model import Glm5ForCausalLM
from trainer.backends.megatron.backend import MegatronBackend
from trainer.losses import LossInputs, build_loss
from trainer.packing import MicroBatch

SEED = 0
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Without CUDA the script dry-runs on CPU with a shrunken `large` config (to test the script itself)."""
LARGE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
             num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
             q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             index_n_heads=32, index_head_dim=64, index_topk=512,
             indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"],
             n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1)
LARGE_SEQ_LEN = 1024
if DEVICE.type == "cpu":
    LARGE.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
                 index_topk=64, vocab_size=1024)
    LARGE_SEQ_LEN = 96


def sync() -> None:
    if DEVICE.type == "cuda":
        sync()


def micro_batches(arch: ModelConfig, model: Glm5ForCausalLM, count: int, seq_len: int, seqs: int) -> list[MicroBatch]:
    """Random packed micro-batches; rollout log-probs = the model's own + noise (IS ratios near 1)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        n = seq_len * seqs
        ids = torch.randint(1, arch.vocab_size, (n + 1,), generator=gen)
        cu = torch.arange(seqs + 1, dtype=torch.int32) * seq_len
        mask = (torch.arange(n) % seq_len) >= seq_len // 4  # the first quarter of each sequence is prompt
        mb = MicroBatch(ids[:-1], cu, ids[1:], mask, torch.zeros(n), torch.where(mask, 0.5, 0.0), torch.ones(n),
                        [f"s{i}" for i in range(seqs)], seq_len, int(mask.sum()), seqs)
        with torch.no_grad():
            own = model.token_logprobs(mb.input_ids.to(DEVICE), cu.to(DEVICE), mb.targets.to(DEVICE)).logprobs.cpu()
        mb.rollout_logprobs = torch.where(mask, own + 0.1 * torch.randn(n, generator=gen), 0.0)
        out.append(mb)
    return out


def reference_step(model: Glm5ForCausalLM, cfg: TrainerConfig, mbs: list[MicroBatch], dtype: torch.dtype) -> dict:
    """What the torch backend does in one step (fp32 masters; bf16 via autocast), timed."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn, normalizer = build_loss(cfg.loss), sum(mb.num_loss_tokens for mb in mbs)
    sync()
    start, total = time.perf_counter(), 0.0
    for mb in mbs:
        mb = mb.to(DEVICE)
        with torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets)
        loss, _ = loss_fn(LossInputs(out.logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                     entropy=out.entropy, cu_seqlens=mb.cu_seqlens, normalizer=normalizer))
        loss.backward()
        total += float(loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return {"loss": total, "grad_norm": grad_norm, "seconds": time.perf_counter() - start}


@torch.no_grad()
def reference_logprobs(model: Glm5ForCausalLM, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    mbs = [mb.to(DEVICE) for mb in mbs]
    return [model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets).logprobs.cpu() for mb in mbs]


def max_diff(backend: MegatronBackend, mbs: list[MicroBatch], expected: list[torch.Tensor]) -> float:
    return max(float((backend.logprobs(mb) - ref).abs().max()) for mb, ref in zip(mbs, expected))


def timed_steps(backend: MegatronBackend, mbs: list[MicroBatch], steps: int) -> tuple[list[float], float]:
    normalizer, losses = sum(mb.num_loss_tokens for mb in mbs), []
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(backend.train_step(mbs, normalizer).loss)
    sync()
    return losses, (time.perf_counter() - start) / steps


def check_tiny(report: dict) -> None:
    section, cfg = load_model_section("tiny"), TrainerConfig(backend="megatron", lr=1e-3)
    model = Glm5ForCausalLM.from_config(section.arch, seed=SEED).to(DEVICE)
    model.freeze_indexer()
    mbs = micro_batches(section.arch, model, count=2, seq_len=128, seqs=2)
    backend = MegatronBackend(cfg, section, seed=SEED)
    diff = max_diff(backend, mbs, reference_logprobs(model, mbs))
    indexer_before = {k: v.clone() for k, v in backend.hf_state_dict().items() if ".indexer." in k}
    first = backend.train_step(mbs, sum(mb.num_loss_tokens for mb in mbs))
    ref = reference_step(model, cfg, mbs, torch.float32)
    after = max_diff(backend, mbs, reference_logprobs(model, mbs))
    for _ in range(2):
        backend.train_step(mbs, sum(mb.num_loss_tokens for mb in mbs))
    weights = backend.hf_state_dict()
    frozen = all(torch.equal(weights[k], v) for k, v in indexer_before.items())
    report["tiny"] = {"logprob_max_abs_diff": diff, "first_step_loss": first.loss, "torch_first_step_loss": ref["loss"],
                      "grad_norm": first.grad_norm, "torch_grad_norm": ref["grad_norm"],
                      "logprob_max_abs_diff_after_step": after, "indexer_bit_identical_after_3_steps": frozen}


def check_large(report: dict) -> None:
    tiny = load_model_section("tiny")
    section = replace(tiny, arch=ModelConfig(**{**vars(tiny.arch), **LARGE}))
    cfg = TrainerConfig(backend="megatron", lr=1e-5, micro_batch_tokens=4096)
    model = Glm5ForCausalLM.from_config(section.arch, seed=SEED).to(DEVICE)
    model.freeze_indexer()
    mbs = micro_batches(section.arch, model, count=2, seq_len=LARGE_SEQ_LEN, seqs=4)
    tokens, initial = sum(mb.num_tokens for mb in mbs), reference_logprobs(model, mbs)
    result = {"parameters": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens}
    normalizer = sum(mb.num_loss_tokens for mb in mbs)
    fp32 = MegatronBackend(cfg, section, seed=SEED)
    result["fp32_logprob_max_abs_diff"] = max_diff(fp32, mbs, initial)
    result["fp32_first_step_loss"] = fp32.train_step(mbs, normalizer).loss
    result["torch_fp32_first_step_loss"] = reference_step(model, cfg, mbs, torch.float32)["loss"]
    losses, seconds = timed_steps(fp32, mbs, 2)
    result.update(fp32_later_losses=losses, megatron_fp32_tokens_per_s=tokens / seconds)
    del fp32
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    result["torch_fp32_tokens_per_s"] = tokens / min(reference_step(model, cfg, mbs, torch.float32)["seconds"]
                                                     for _ in range(2))
    bf16 = MegatronBackend(cfg, replace(section, dtype="bfloat16"), seed=SEED)
    result["bf16_vs_fp32_logprob_max_abs_diff"] = max_diff(bf16, mbs, initial)
    timed_steps(bf16, mbs, 1)  # warm-up
    losses, seconds = timed_steps(bf16, mbs, 3)
    bf16_ref = min(reference_step(model, cfg, mbs, torch.bfloat16)["seconds"] for _ in range(3))
    result.update(bf16_losses=losses, megatron_bf16_tokens_per_s=tokens / seconds,
                  torch_autocast_bf16_tokens_per_s=tokens / bf16_ref,
                  peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else None)
    report["large"] = result


def main() -> None:
    from trainer.backends.megatron import cpu_shims

    cpu_shims.install()
    import megatron.core
    import transformers

    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    report = {"device": device, "torch": torch.__version__, "megatron_core": megatron.core.__version__, "transformers": transformers.__version__}
    for check in (check_tiny, check_large):
        start = time.perf_counter()
        try:
            check(report)
        except Exception as error:  # report what ran; a later check may still run
            where = traceback.extract_tb(error.__traceback__)[-3:]
            report[check.__name__] = f"FAILED: {type(error).__name__}: {error} at " + " <- ".join(
                f"{Path(frame.filename).name}:{frame.lineno}" for frame in reversed(where))
        report[f"{check.__name__}_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(report, indent=2), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "megatron_gpu.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"report written to {out}")


if __name__ == "__main__":
    main()
