"""Off-policy health of a training step: how far the policy being trained is from the one that sampled its
tokens, what the trust band removed, and what the step consumed, per step and per env (docs/run.md
"Off-policy health" says what a healthy run looks like).

Everything is computed from the step's own forward (`StepResult.samples`: the trainer's log-prob of each
target before the update, which is the log-prob the importance ratio uses) against the rollout log-probs the
gateway recorded, on loss tokens only. With d = log pi_trainer - log pi_rollout (clamped to +-20 as the losses
clamp it) and r = exp(d):

* `mismatch_kl`: mean of exp(d) - d - 1, the k3 estimator of KL(pi_rollout || pi_trainer) (>= 0; unbiased
  on tokens sampled from pi_rollout); `max_abs_log_ratio`: max |d|.
* `masked_low_fraction` / `masked_high_fraction`: loss tokens whose r lies below / above the loss's trust
  band (trainer.losses.TrustBand): no gradient from them.
* `ess_fraction`: effective sample size of the IS weights r, (sum r)^2 / sum r^2, over the number of loss
  tokens: 1 when every weight is equal, near 1/n when one token dominates.
* `staleness/<k>`: trained samples whose oldest token is k weight versions behind the trainer.

The same module turns a step's samples into the `trained` records (asyncrl.types.TrainedTokens) that the
dashboard shows next to the rollout's log-probs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from asyncrl.types import Sample, TrainedTokens, agent_health
from trainer.backends.base import SampleTokens
from trainer.data import StepBatch
from trainer.losses import TrustBand

MAX_ABS_LOG_RATIO = 20.0
"""As trainer/losses.py clamps the log-ratio before exp."""


def effective_sample_size(weights: np.ndarray) -> float:
    """(sum w)^2 / sum w^2 (Kish): n for n equal weights, 1 when one weight carries all the mass; 0 when empty."""
    weights = np.asarray(weights, dtype=np.float64)
    square_sum = float(np.square(weights).sum())
    return float(weights.sum()) ** 2 / square_sum if square_sum > 0 else 0.0


def mismatch_kl(log_ratio: np.ndarray) -> float:
    """Mean k3 estimate of KL(pi_rollout || pi_trainer) over tokens with log-ratio d: exp(d) - d - 1."""
    d = np.asarray(log_ratio, dtype=np.float64)
    return float(np.mean(np.expm1(d) - d)) if d.size else 0.0


def band_sides(ratio: np.ndarray, band: Optional[TrustBand]) -> tuple[np.ndarray, np.ndarray]:
    """(below the band, above it) for each ratio; nothing is outside when the loss has no band."""
    ratio = torch.as_tensor(ratio)
    if band is None:
        none = np.zeros(ratio.shape, dtype=bool)
        return none, none
    below = band.below(ratio)
    return below.numpy(), (~band.kept(ratio) & ~below).numpy()


@dataclass
class TokenSet:
    """The loss tokens of some samples as the IS machinery sees them."""

    log_ratio: np.ndarray
    """float32: log pi_trainer - log pi_rollout, clamped to +-MAX_ABS_LOG_RATIO."""
    entropy: Optional[np.ndarray]

    @classmethod
    def of(cls, pairs: Iterable[tuple[Sample, SampleTokens]]) -> "TokenSet":
        ratios, entropies = [], []
        for sample, tokens in pairs:
            mask = sample.loss_mask[1:].astype(bool)
            ratios.append(_log_ratio(tokens.logprobs, sample.rollout_logprobs[1:])[mask])
            entropies.append(None if tokens.entropy is None else tokens.entropy[mask])
        has_entropy = bool(entropies) and all(e is not None for e in entropies)
        return cls(np.concatenate(ratios) if ratios else np.zeros(0, np.float32),
                   np.concatenate(entropies) if has_entropy else None)

    def health(self, band: Optional[TrustBand]) -> dict[str, float]:
        n = len(self.log_ratio)
        if n == 0:
            return {}
        ratio = _exp(self.log_ratio)
        below, above = band_sides(ratio, band)
        out = {"mismatch_kl": mismatch_kl(self.log_ratio), "max_abs_log_ratio": float(np.abs(self.log_ratio).max()),
               "masked_low_fraction": float(below.mean()), "masked_high_fraction": float(above.mean()),
               "ess_fraction": effective_sample_size(ratio) / n, "loss_tokens": float(n)}
        if self.entropy is not None:
            out["entropy"] = float(self.entropy.mean())
        return out


def outcome_label(sample: Sample) -> str:
    """completed, truncated (the model ran out of turns or tokens), env_failure, infra_failure, failed (no class
    recorded) or aborted."""
    if sample.status == "failed":
        return {"environment": "env_failure", "infrastructure": "infra_failure"}.get(sample.outcome_class, "failed")
    return sample.status


def step_health(batch: StepBatch, trained: dict[str, SampleTokens], band: Optional[TrustBand],
                step_s: float) -> dict[str, float]:
    """The step's off-policy and rollout-shape metrics, whole and per env: keys `off_policy/<name>`,
    `rollout/<name>` and `env/<env>/<same keys without the panel>` (docs/run.md "Off-policy health").

    `trained`: the trained samples' forward values by sample id; every consumed sample (dropped ones too)
    counts towards outcomes and episodes. Rates are per second of the step (waiting for groups included), so
    in a steady run they are what the trainer consumes."""
    consumed = [s for g in batch.groups for s in g.samples]
    by_env: dict[str, list[Sample]] = defaultdict(list)
    for sample in consumed:
        by_env[sample.env].append(sample)
    out = _health(consumed, trained, band, batch, step_s, prefix="")
    for env, samples in sorted(by_env.items()):  # a one-env run has its env panel too: runs read alike
        out.update(_health(samples, trained, band, batch, step_s, prefix=f"env/{env}/"))
    return out


def _health(samples: list[Sample], trained: dict[str, SampleTokens], band: Optional[TrustBand],
            batch: StepBatch, step_s: float, prefix: str) -> dict[str, float]:
    pairs = [(s, trained[s.sample_id]) for s in samples if s.sample_id in trained]
    out = {f"{prefix}off_policy/{k}": v for k, v in TokenSet.of(pairs).health(band).items()}
    staleness = Counter(batch.staleness(s) for s, _ in pairs if s.first_weight_version >= 0)
    out.update({f"{prefix}off_policy/staleness/{k}": float(n) for k, n in sorted(staleness.items())})
    episodes = len({s.session_id for s in samples})
    generated = sum(int(s.loss_mask.sum()) for s in samples)
    rollout = {"episodes": episodes, "episodes_per_s": episodes / max(step_s, 1e-9),
               "generated_tokens_per_s": generated / max(step_s, 1e-9)}
    if pairs:
        trained_samples = [s for s, _ in pairs]
        if prefix:  # the whole step's is the record's `reward_mean` (trainer/loop.py)
            rollout["reward_mean"] = float(np.mean([s.reward for s in trained_samples]))
        rollout |= {"response_len_mean": float(np.mean([int(s.loss_mask.sum()) for s in trained_samples])),
                    "episode_len_mean": float(np.mean([s.num_tokens for s in trained_samples])),
                    **agent_health(trained_samples)}
    rollout |= {f"outcome/{label}": float(n) for label, n in sorted(Counter(map(outcome_label, samples)).items())}
    out.update({f"{prefix}rollout/{k}": float(v) for k, v in rollout.items()})
    return out


def trained_records(batch: StepBatch, trained: dict[str, SampleTokens], band: Optional[TrustBand], step: int,
                    weight_version: int) -> list[TrainedTokens]:
    """A TrainedTokens record for every sample the step trained, keyed by its stream id (its group's ref)."""
    out = []
    for group in batch.groups:
        for ref, sample in zip(group.record.sample_refs, group.samples):
            tokens = trained.get(sample.sample_id)
            if tokens is None:
                continue
            mask = sample.loss_mask[1:].astype(bool)
            logprobs = np.zeros(sample.num_tokens, np.float32)
            logprobs[1:] = np.where(mask, tokens.logprobs, 0.0)
            kept = np.zeros(sample.num_tokens, np.uint8)
            ratio = _exp(_log_ratio(tokens.logprobs, sample.rollout_logprobs[1:]))
            below, above = band_sides(ratio, band)
            kept[1:] = mask & ~below & ~above
            out.append(TrainedTokens(ref, step, weight_version, logprobs, kept))
    return out


def _log_ratio(trainer_logprobs: np.ndarray, rollout_logprobs: np.ndarray) -> np.ndarray:
    """As the losses compute it (float32 torch ops, so the band classifies a token exactly as the loss did)."""
    d = torch.tensor(trainer_logprobs, dtype=torch.float32) - torch.tensor(rollout_logprobs, dtype=torch.float32)
    return d.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO).numpy()


def _exp(log_ratio: np.ndarray) -> np.ndarray:
    return torch.as_tensor(log_ratio).exp().numpy()
