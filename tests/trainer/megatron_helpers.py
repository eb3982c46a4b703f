"""Shared by the megatron backend tests and their torchrun worker: one step's micro-batches and the
reference step on asyncrl's own torch model (what the torch backend computes: token_logprobs, the
configured loss with the step normalizer, grad clipping, AdamW), with or without routing replay."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from asyncrl.config import TrainerConfig
from asyncrl.model.config import ModelConfig
from asyncrl.model.model import Glm5ForCausalLM
from tests.rollout.conftest import recorded_routing
from tests.trainer.helpers import make_sample
from trainer.advantages import ScoredSample
from trainer.losses import LossInputs, build_loss
from trainer.packing import MicroBatch, pack

SEED = 0


def make_micro_batches(arch: ModelConfig, budget: int = 256) -> list[MicroBatch]:
    """Two packed micro-batches of four samples (80-119 tokens: longer than the tiny config's
    index_topk of 64, so DSA really selects; 223 and 171 positions, odd, so tensor parallelism pads).
    Rollout log-probs are the model's own plus noise, so the IS ratios sit near 1 and the loss has
    gradient."""
    samples = [ScoredSample(make_sample(f"s{i}", prompt_len=20 + 7 * i, gen_len=60 + 6 * i, seed=i),
                            advantage=0.5 * (-1) ** i) for i in range(4)]
    micro_batches = pack(samples, budget)
    model = Glm5ForCausalLM.from_config(arch, seed=SEED)
    noise = torch.Generator().manual_seed(5)
    for mb in micro_batches:
        with torch.no_grad():
            own = model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets).logprobs
        mb.rollout_logprobs = torch.where(mb.loss_mask, own + 0.1 * torch.randn(own.shape, generator=noise), 0.0)
    return micro_batches


def with_replayed_routing(micro_batches: list[MicroBatch], arch: ModelConfig) -> list[MicroBatch]:
    """The micro-batches carrying routing for replay: the model's own experts shifted by one (so a replay
    shows in the log-probs), except a stretch of -1 rows (no recorded routing: the router decides)."""
    model = Glm5ForCausalLM.from_config(arch, seed=SEED)
    routed = []
    for mb in micro_batches:
        own = torch.cat([recorded_routing(model, mb.input_ids[lo:hi].tolist())
                         for lo, hi in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())])
        rows = torch.where(own >= 0, (own + 1) % arch.n_routed_experts, own)
        rows[10:30] = -1
        routed.append(replace(mb, routed_experts=rows.flatten(1).to(torch.int16)))
    return routed


def at_temperatures(micro_batches: list[MicroBatch], temperatures: tuple[float, ...]) -> list[MicroBatch]:
    """The micro-batches sampled at other temperatures: micro-batch i's positions cycle through
    `temperatures` sequence by sequence (an agent that changed T between turns)."""
    out = []
    for i, mb in enumerate(micro_batches):
        lengths = mb.cu_seqlens.diff().tolist()
        per_seq = [temperatures[(i + j) % len(temperatures)] for j in range(len(lengths))]
        out.append(replace(mb, temperatures=torch.repeat_interleave(torch.tensor(per_seq), torch.tensor(lengths))))
    return out


def _replay(mb: MicroBatch, arch: ModelConfig):
    if mb.routed_experts is None:
        return None
    return mb.routed_experts.view(mb.num_tokens, arch.num_hidden_layers, arch.num_experts_per_tok)


def normalizer_of(micro_batches: list[MicroBatch]) -> int:
    return sum(mb.num_loss_tokens for mb in micro_batches)


@dataclass
class ReferenceStep:
    logprobs_before: list[torch.Tensor]
    loss: float
    grad_norm: float
    logprobs_after: list[torch.Tensor]
    model: Glm5ForCausalLM


def reference_step(arch: ModelConfig, cfg: TrainerConfig, micro_batches: list[MicroBatch]) -> ReferenceStep:
    model = Glm5ForCausalLM.from_config(arch, seed=SEED)
    model.freeze_indexer()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn, normalizer = build_loss(cfg.loss), normalizer_of(micro_batches)
    before = _logprobs(model, micro_batches)
    total = 0.0
    for mb in micro_batches:
        out = model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets, temperature=mb.temperatures,
                                   routed_experts=_replay(mb, arch))
        loss, _ = loss_fn(LossInputs(out.logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                     entropy=out.entropy, cu_seqlens=mb.cu_seqlens, normalizer=normalizer))
        loss.backward()
        total += float(loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    optimizer.step()
    return ReferenceStep(before, total, grad_norm, _logprobs(model, micro_batches), model)


@torch.no_grad()
def _logprobs(model: Glm5ForCausalLM, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
    return [model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets, temperature=mb.temperatures,
                                 routed_experts=_replay(mb, model.config)).logprobs for mb in micro_batches]
