"""The torch backend: asyncrl's own GLM-5 model, AdamW or Muon (trainer/optimizers.py), data parallelism over
torch.distributed.

CPU by default (`trainer.device`), one process or several under torchrun (gloo; NCCL on GPU; see
data_parallel.py). Master weights and optimizer state are fp32; `model.dtype: bfloat16` runs the
forward and backward under autocast, as the engines compute in bf16. The DSA indexer is frozen by
default (no gradient, not in the optimizer); unfrozen, it learns from its KL alignment loss only.

IcePop's pi_train_old is the log-prob of this step's own forward, detached: one RL step is one
optimizer step, so the weights at the start of the step are the weights of that forward and a
separate no-grad pass would compute the same numbers again.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from asyncrl.config import ModelSection, TrainerConfig
from asyncrl.model.io import (checkpoint_tensors, dtype_from_name, load_pretrained, load_weights, read_tensors,
                              save_pretrained)
from asyncrl.model.model import Glm5ForCausalLM
from trainer.backends.base import SampleTokens, StepResult, TrainerBackend, sample_tokens
from trainer.backends.data_parallel import DataParallel
from trainer.backends.leader import STOP, announce, follow_leader
from trainer.losses import LossInputs, LossMetrics, build_loss
from trainer.mtp_loss import clip_mtp_gradients, mtp_loss_mask, mtp_loss_terms
from trainer.optimizers import build_optimizer
from trainer.packing import MicroBatch

METRIC_FIELDS = ("loss_tokens", "masked_tokens", "clipped_tokens", "ratio_sum", "mismatch_kl_sum", "entropy_sum")
"""LossMetrics sums carried in the step's totals vector, after (loss, indexer_kl, tokens, mtp_loss_sum,
mtp_correct, mtp_count)."""


def select_device(name: str) -> torch.device:
    """`cpu`, `cuda` (this process's LOCAL_RANK GPU) or `auto`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"trainer.device {name!r} not in ['auto', 'cpu', 'cuda']")


def build_model(section: ModelSection, seed: int) -> Glm5ForCausalLM:
    """fp32 master weights: the checkpoint at `section.path`, else a random init from `section.arch`."""
    if section.path:
        return load_pretrained(section.path, dtype=torch.float32)
    return Glm5ForCausalLM.from_config(section.arch, seed=seed)


class TorchBackend(TrainerBackend):
    def __init__(self, cfg: TrainerConfig, model: ModelSection, seed: int = 0) -> None:
        super().__init__(cfg, model, seed)
        self.device = select_device(cfg.device)
        self.dp = DataParallel(self.device)
        self.compute_dtype = dtype_from_name(model.dtype)
        self.model = build_model(model, seed).to(self.device)
        if cfg.freeze_indexer:
            self.model.freeze_indexer()
        if cfg.mtp_loss_coef > 0 and not self.model.model.mtp_layers:
            raise ValueError(f"trainer.mtp_loss_coef {cfg.mtp_loss_coef}: the model has no MTP layer "
                             "(num_nextn_predict_layers 0)")
        if cfg.mtp_depths < 1:
            raise ValueError(f"trainer.mtp_depths must be >= 1, got {cfg.mtp_depths}")
        if cfg.mtp_loss_coef <= 0:
            self.model.freeze_mtp()
        self.model.set_gradient_checkpointing(cfg.grad_checkpointing)
        self.dp.broadcast_parameters(self.model)
        self.mtp_params = [p for p in self.model.model.mtp_layers.parameters() if p.requires_grad]
        mtp = {id(p) for p in self.mtp_params}
        self.policy_params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in mtp]
        self.trainable = self.policy_params + self.mtp_params
        self.optimizer = self._new_optimizer()
        self.loss_fn = build_loss(cfg.loss)

    def _new_optimizer(self):
        trainable = {id(p) for p in self.trainable}
        named = [(name, p) for name, p in self.model.named_parameters() if id(p) in trainable]
        return build_optimizer(self.cfg.optimizer, named, self.cfg.lr, self.cfg.weight_decay)

    # Leader / followers ----------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.dp.is_leader

    def follow(self) -> None:
        follow_leader(lambda method, args: getattr(self, f"_{method}")(*args))

    def close(self) -> None:
        if self.dp.is_leader:
            announce(STOP)
        self.dp.close()

    # Training ----------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], normalizer: int) -> StepResult:
        step_tokens = sum(mb.num_tokens for mb in micro_batches)
        mtp_tokens = sum(int(mtp_loss_mask(mb.loss_mask, mb.cu_seqlens).sum()) for mb in micro_batches)
        announce("train_step", normalizer, step_tokens, mtp_tokens)
        return self._train_step(normalizer, step_tokens, mtp_tokens, micro_batches)

    def _train_step(self, normalizer: int, step_tokens: int, mtp_tokens: int,
                    micro_batches: Optional[list[MicroBatch]] = None) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = torch.zeros(6 + len(METRIC_FIELDS), dtype=torch.float64, device=self.device)
        samples: dict[str, SampleTokens] = {}
        for mb in self.dp.scatter(micro_batches):
            totals += self._forward_backward(mb.to(self.device), normalizer, step_tokens, mtp_tokens, samples)
        totals = self.dp.sum(totals)
        samples = self.dp.merge_on_leader(samples)
        self.dp.sum_gradients(self.trainable)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy_params, clip)  # the MTP layer's apart: see
        mtp_grad_norm = clip_mtp_gradients(self.mtp_params, clip) if self.mtp_params else None  # mtp_loss.py
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # a NaN/inf gradient would poison the weights and the Adam moments: skip the update
            self.optimizer.step()
        result = self._result(totals, float(grad_norm), skipped=not finite, mtp_grad_norm=mtp_grad_norm)
        result.samples = samples
        return result

    def _forward_backward(self, mb: MicroBatch, normalizer: int, step_tokens: int, mtp_tokens: int,
                          samples: dict[str, SampleTokens]) -> Tensor:
        """One micro-batch: backward its share of the step loss, its samples' forward values into `samples`;
        -> its totals vector (no grad)."""
        train_indexer = not self.cfg.freeze_indexer
        options = {"attention_impl": self._attention_impl(mb)}
        with self._autocast():
            out = self.model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets, temperature=mb.temperatures,
                                            indexer_kl=train_indexer, routed_experts=self._routing(mb), **options)
            mtp = mtp_loss_terms(self.model, out.hidden, mb.targets, mb.cu_seqlens, mb.loss_mask,
                                 depths=self.cfg.mtp_depths, **options) \
                if self.mtp_params else None
        old = out.logprobs.detach() if self.loss_fn.needs_old_logprobs else None
        loss, metrics = self.loss_fn(LossInputs(out.logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                                old_logprobs=old, entropy=out.entropy, cu_seqlens=mb.cu_seqlens,
                                                normalizer=normalizer))
        indexer_kl = loss.new_zeros(()) if out.indexer_kl is None else out.indexer_kl * (mb.num_tokens / step_tokens)
        total = loss + self.cfg.indexer_kl_coef * indexer_kl
        zero = loss.new_zeros(())
        if mtp is not None and mtp.count:
            total = total + self.cfg.mtp_loss_coef * mtp.loss_sum / mtp_tokens
        total.backward()
        samples.update(sample_tokens(mb, out.logprobs, out.entropy))
        mtp_values = (mtp.loss_sum.detach(), mtp.correct.to(zero), zero + mtp.count) if mtp else (zero, zero, zero)
        return torch.stack([loss.detach(), indexer_kl.detach(), loss.new_tensor(float(mb.num_tokens)), *mtp_values,
                            *(getattr(metrics, name) for name in METRIC_FIELDS)]).double()

    def _routing(self, mb: MicroBatch) -> Optional[Tensor]:
        """The engine's routing of the micro-batch as [T, layers, top_k] (routing replay), or None."""
        if mb.routed_experts is None:
            return None
        config = self.model.config
        shape = (mb.num_tokens, config.num_hidden_layers, config.num_experts_per_tok)
        if mb.routed_experts.shape[1] != shape[1] * shape[2]:
            raise ValueError(f"routed_experts rows have {mb.routed_experts.shape[1]} entries; this model routes "
                             f"{shape[1]} layers x {shape[2]} experts")
        return mb.routed_experts.view(shape)

    def _attention_impl(self, mb: MicroBatch) -> str:
        dense = self.cfg.freeze_indexer and mb.max_seqlen <= self.cfg.dense_attention_up_to
        return "dense" if dense else "sparse"

    def _result(self, totals: Tensor, grad_norm: float, skipped: bool, mtp_grad_norm: Optional[float]) -> StepResult:
        loss, indexer_kl, tokens, mtp_loss_sum, mtp_correct, mtp_count, *sums = totals.tolist()
        metrics = LossMetrics(**{name: torch.tensor(v) for name, v in zip(METRIC_FIELDS, sums)}).summary()
        metrics["skipped_step"] = float(skipped)
        if not self.cfg.freeze_indexer:
            metrics["indexer_kl"] = indexer_kl
        if mtp_grad_norm is not None:
            metrics.update(mtp_loss=mtp_loss_sum / max(mtp_count, 1), mtp_accuracy=mtp_correct / max(mtp_count, 1),
                           mtp_grad_norm=mtp_grad_norm)
        return StepResult(loss=loss, grad_norm=grad_norm, num_tokens=int(tokens), metrics=metrics)

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @torch.no_grad()
    def logprobs(self, micro_batch: MicroBatch) -> Tensor:
        self.model.eval()
        mb = micro_batch.to(self.device)
        with self._autocast():
            out = self.model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets, temperature=mb.temperatures,
                                            with_entropy=False, routed_experts=self._routing(mb), attention_impl=self._attention_impl(mb))
        return out.logprobs.float().cpu()

    def _reset_optimizer(self) -> None:
        self.optimizer = self._new_optimizer()

    # Weights and checkpoints -------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """HF-named weights in the compute dtype (what engines serve; the router stays fp32), on the
        training device. fp32 tensors are views of the live weights: use them before the next step."""
        return checkpoint_tensors(self.model, dtype=self.compute_dtype)

    def save_checkpoint(self, path: Path) -> None:
        """<path>/model: the fp32 master weights as an HF checkpoint; <path>/optimizer.pt. Leader only:
        every rank holds the same state."""
        save_pretrained(self.model, Path(path) / "model")
        torch.save(self.optimizer.state_dict(), Path(path) / "optimizer.pt")

    def load_checkpoint(self, path: Path) -> None:
        announce("load_checkpoint", str(path))
        self._load_checkpoint(str(path))

    def _load_checkpoint(self, path: str) -> None:
        load_weights(self.model, read_tensors(Path(path) / "model"))
        state = torch.load(Path(path) / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)
