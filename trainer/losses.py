"""Policy-gradient objectives for off-policy (asynchronous) GRPO, picked by `LossConfig.type`.

Both losses take per-token tensors of one shape, either flat `[num_tokens]` (packed sequences,
boundaries in `cu_seqlens`) or padded `[batch, seq]` (one sequence per row), and return
`(loss, LossMetrics)`. Formulas, the normalisation choice and the metric definitions are written
out in docs/trainer.md; the short version:

* direct double-sided IS (GLM-5 eq. 3-5): r = pi_theta / pi_rollout; tokens with r outside
  (1 - eps_low, 1 + eps_high) are masked (weight 0, not clipped); per-token loss
  -sg(r) * A * log pi_theta.
* IcePop + PPO clip (Ring-1T; GLM-5 §3.2): rho = pi_train_old / pi_infer; tokens with rho outside
  [1/beta, beta] are masked, kept tokens are weighted by rho; per-token loss
  -rho * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) with r = pi_theta / pi_train_old.

Normalisation: the sum of per-token terms is divided by the number of loss tokens (loss_mask), *not*
by the number that survive the IS mask: a masked token counts as a zero term (f(r) = 0 in the
paper's expectation), the denominator is known from the data alone (so micro-batches of one step
accumulate exactly, see `normalizer`), and a batch with many masked tokens does not up-weight the
survivors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from asyncrl.config import LossConfig
from asyncrl.plugins import load_plugin

AGGREGATIONS = ("token", "sequence")

_MAX_ABS_LOG_RATIO = 20.0
"""Log-ratios are clamped here before exp: exp(20) ~ 5e8 is far outside any trust band, and one
garbage token cannot turn the step's metrics into inf."""


@dataclass
class LossMetrics:
    """Sums and counts over the loss tokens of one call; add them across micro-batches, then
    `summary()` divides. Values are 0-d tensors so no device sync happens inside the step."""

    loss_tokens: Tensor
    masked_tokens: Tensor
    """Loss tokens the trust-region mask removed (IS band or IcePop band)."""
    clipped_tokens: Tensor
    """Loss tokens whose PPO clip is active (zero gradient); always 0 for the IS loss."""
    ratio_sum: Tensor
    """Sum of the ratio the mask tests: pi_theta/pi_rollout (IS) or pi_train_old/pi_infer (IcePop)."""
    mismatch_kl_sum: Tensor
    """Sum of the k3 estimator of KL(pi_rollout || pi_theta): exp(d) - d - 1, d = logp_theta - logp_rollout."""
    entropy_sum: Optional[Tensor] = None

    def __add__(self, other: "LossMetrics") -> "LossMetrics":
        def add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
            return None if a is None or b is None else a + b

        return LossMetrics(**{f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def summary(self) -> dict[str, float]:
        """Means over loss tokens (floats, for logging)."""
        n = max(float(self.loss_tokens), 1.0)
        out = {
            "loss_tokens": float(self.loss_tokens),
            "masked_fraction": float(self.masked_tokens) / n,
            "clip_fraction": float(self.clipped_tokens) / n,
            "mean_ratio": float(self.ratio_sum) / n,
            "mismatch_kl": float(self.mismatch_kl_sum) / n,
        }
        if self.entropy_sum is not None:
            out["entropy"] = float(self.entropy_sum) / n
        return out


# Aggregation -----------------------------------------------------------------------------------
def sequence_index(like: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, int]:
    """(sequence number of every token, flattened; number of sequences): rows of a [batch, seq]
    tensor, or the spans of `cu_seqlens` (int boundaries, [num_seqs + 1]) of a flat [num_tokens] one."""
    if like.dim() == 2:
        batch, seq = like.shape
        return torch.arange(batch, device=like.device).repeat_interleave(seq), batch
    if cu_seqlens is None:
        raise ValueError("sequence aggregation of flat [num_tokens] tensors needs cu_seqlens")
    if cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != like.numel():  # free on CPU; no sync on GPU
        raise ValueError(f"cu_seqlens covers {int(cu_seqlens[-1])} tokens, tensors have {like.numel()}")
    positions = torch.arange(like.numel(), device=like.device)
    ends = cu_seqlens[1:].to(like.device, torch.long)
    return torch.searchsorted(ends, positions, right=True), len(ends)  # seq of p: number of ends <= p


def aggregate(per_token: Tensor, loss_mask: Tensor, aggregation: str = "token",
              cu_seqlens: Optional[Tensor] = None, normalizer: Optional[float] = None) -> Tensor:
    """Reduce per-token loss terms (already zero where masked) to a scalar.

    token:    sum over loss tokens / number of loss tokens.
    sequence: sum over sequences of (sum over the sequence's loss tokens / its loss tokens)
              / number of sequences that have loss tokens.
    `normalizer` replaces that denominator, e.g. by the count over all micro-batches of the step,
    so that the micro-batch losses add up to the step's loss exactly.
    """
    mask = loss_mask.bool()
    if aggregation == "token":
        total, count = per_token.sum(), mask.sum()
    elif aggregation == "sequence":
        seq, num_seqs = sequence_index(per_token, cu_seqlens)
        seq_sum = per_token.new_zeros(num_seqs).index_add(0, seq, per_token.reshape(-1))
        seq_tokens = per_token.new_zeros(num_seqs).index_add(0, seq, mask.reshape(-1).to(per_token.dtype))
        total, count = (seq_sum / seq_tokens.clamp(min=1)).sum(), (seq_tokens > 0).sum()
    else:
        raise ValueError(f"aggregation {aggregation!r} not in {AGGREGATIONS}")
    denominator = count.clamp(min=1) if normalizer is None else max(normalizer, 1)
    return total / denominator


# Losses ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrustBand:
    """The interval of the tested ratio (pi_trainer / pi_rollout at the step's forward) a loss token must lie
    in to carry gradient; the IS loss's is open, IcePop's closed. The losses mask with it, and the
    trainer's health metrics and trained records (trainer/off_policy.py) classify tokens with the same one."""

    low: float
    high: float
    closed: bool = False

    def kept(self, ratio: Tensor) -> Tensor:
        if self.closed:
            return (ratio >= self.low) & (ratio <= self.high)
        return (ratio > self.low) & (ratio < self.high)

    def below(self, ratio: Tensor) -> Tensor:
        """Masked for being too small (the trainer's policy gives the token much less mass than the rollout's)."""
        return ratio < self.low if self.closed else ratio <= self.low


def _log_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    return (numerator.detach() - denominator.detach()).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, torch.zeros_like(values)).sum()  # no boolean indexing: no device sync


@torch.no_grad()
def _metrics(logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, kept: Tensor, clipped: Tensor,
             tested_ratio: Tensor, entropy: Optional[Tensor]) -> LossMetrics:
    mask = loss_mask.bool()
    d = _log_ratio(logprobs, rollout_logprobs)
    k3 = d.exp() - d - 1  # >= 0; unbiased for KL(pi_rollout || pi_theta) on tokens sampled from pi_rollout
    return LossMetrics(
        loss_tokens=mask.sum(),
        masked_tokens=(mask & ~kept).sum(),
        clipped_tokens=(clipped & kept).sum(),
        ratio_sum=_masked_sum(tested_ratio, mask),
        mismatch_kl_sum=_masked_sum(k3, mask),
        entropy_sum=None if entropy is None else _masked_sum(entropy.detach(), mask),
    )


def direct_double_sided_is_loss(
    logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
    eps_low: float, eps_high: float, *, aggregation: str = "token", cu_seqlens: Optional[Tensor] = None,
    normalizer: Optional[float] = None, entropy: Optional[Tensor] = None,
) -> tuple[Tensor, LossMetrics]:
    """GLM-5 direct double-sided importance sampling: rollout log-probs stand in for pi_old.

    per-token term (loss tokens only): -f(r) * A * logp_theta, f(r) = r if 1-eps_low < r < 1+eps_high
    else 0, r = exp(logp_theta - logp_rollout) held constant (no gradient through r). Gradient per
    kept token: -r * A / N. Masked and non-loss tokens get exactly zero gradient.
    """
    ratio = _log_ratio(logprobs, rollout_logprobs).exp()
    kept = loss_mask.bool() & TrustBand(1 - eps_low, 1 + eps_high).kept(ratio)
    per_token = torch.where(kept, -(ratio * advantages) * logprobs, torch.zeros_like(logprobs))
    loss = aggregate(per_token, loss_mask, aggregation, cu_seqlens, normalizer)
    no_clip = torch.zeros_like(kept)
    return loss, _metrics(logprobs, rollout_logprobs, loss_mask, kept, no_clip, ratio, entropy)


def icepop_ppo_loss(
    logprobs: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
    eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 2.0, *, aggregation: str = "token",
    cu_seqlens: Optional[Tensor] = None, normalizer: Optional[float] = None, entropy: Optional[Tensor] = None,
) -> tuple[Tensor, LossMetrics]:
    """IcePop: mask training/inference mismatch, then PPO-clip against the training engine's pi_old.

    rho = exp(logp_old - logp_rollout) (a constant); M(rho) = rho if 1/beta <= rho <= beta else 0;
    r = exp(logp_theta - logp_old); per-token term -M(rho) * min(r*A, clip(r, 1-eps_low, 1+eps_high)*A).
    Gradient per kept, unclipped token: -rho * r * A / N; clipped and masked tokens: exactly zero.
    """
    rho = _log_ratio(old_logprobs, rollout_logprobs).exp()
    kept = loss_mask.bool() & TrustBand(1 / beta, beta, closed=True).kept(rho)
    log_ratio = torch.where(kept, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = log_ratio.exp()  # masked tokens: exp(0), so an overflowing ratio there cannot make a NaN gradient
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    per_token = torch.where(kept, -rho * torch.minimum(unclipped, clipped), torch.zeros_like(logprobs))
    loss = aggregate(per_token, loss_mask, aggregation, cu_seqlens, normalizer)
    clip_active = (clipped < unclipped).detach()  # min picked the clipped branch: no gradient
    return loss, _metrics(logprobs, rollout_logprobs, loss_mask, kept, clip_active, rho, entropy)


# Registry --------------------------------------------------------------------------------------
@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all the same shape ([num_tokens] or [batch, seq])."""

    logprobs: Tensor
    """log pi_theta of each target, with gradient."""
    rollout_logprobs: Tensor
    """The inference engine's log-prob of each target (recorded at rollout time)."""
    advantages: Tensor
    loss_mask: Tensor
    old_logprobs: Optional[Tensor] = None
    """log pi_train_old (the trainer's weights before this step, no gradient); IcePop only."""
    entropy: Optional[Tensor] = None
    """Per-token policy entropy, for the metric only."""
    cu_seqlens: Optional[Tensor] = None
    normalizer: Optional[float] = None
    """Denominator shared by all micro-batches of the step (`StepBatch.normalizer`); None = this call's own."""


class PolicyLoss(ABC):
    """A configured objective: `loss, metrics = policy_loss(inputs)`."""

    needs_old_logprobs: bool = False
    """True when the backend must compute log pi_train_old (a no-grad forward before the update)."""
    band: Optional[TrustBand] = None
    """The band on pi_trainer / pi_rollout (both at the step's forward) outside which a token is masked;
    None: the loss masks no token by it."""

    def __init__(self, config: LossConfig) -> None:
        if config.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation {config.aggregation!r} not in {AGGREGATIONS}")
        self.config = config

    @abstractmethod
    def __call__(self, inputs: LossInputs) -> tuple[Tensor, LossMetrics]: ...

    def _common(self, inputs: LossInputs) -> dict:
        return dict(aggregation=self.config.aggregation, cu_seqlens=inputs.cu_seqlens,
                    normalizer=inputs.normalizer, entropy=inputs.entropy)


class DirectDoubleSidedIS(PolicyLoss):
    def __init__(self, config: LossConfig) -> None:
        super().__init__(config)
        self.band = TrustBand(1 - config.eps_low, 1 + config.eps_high)

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, LossMetrics]:
        return direct_double_sided_is_loss(inputs.logprobs, inputs.rollout_logprobs, inputs.advantages,
                                           inputs.loss_mask, self.config.eps_low, self.config.eps_high,
                                           **self._common(inputs))


class IcePopPPO(PolicyLoss):
    needs_old_logprobs = True

    def __init__(self, config: LossConfig) -> None:
        super().__init__(config)
        self.band = TrustBand(1 / config.icepop_beta, config.icepop_beta, closed=True)

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, LossMetrics]:
        if inputs.old_logprobs is None:
            raise ValueError("icepop_ppo needs old_logprobs (log pi_train_old)")
        return icepop_ppo_loss(inputs.logprobs, inputs.old_logprobs, inputs.rollout_logprobs, inputs.advantages,
                               inputs.loss_mask, self.config.eps_low, self.config.eps_high,
                               self.config.icepop_beta, **self._common(inputs))


LOSSES: dict[str, str] = {"direct_double_sided_is": "trainer.losses:DirectDoubleSidedIS",
                          "icepop_ppo": "trainer.losses:IcePopPPO"}
"""`loss.type` built-ins -> import path of their PolicyLoss (asyncrl/plugins.py)."""


def build_loss(config: LossConfig) -> PolicyLoss:
    """The objective named by `config.type` (a built-in or the import path of a PolicyLoss)."""
    return load_plugin(LOSSES, config.type, "loss.type")(config)
