"""A turn's sampling parameters, as they bear on the log-probs the trainer compares against.

Engines report each token's log-prob under log_softmax(logits / T) of the untruncated distribution (T
taken as 1 for a greedy request), and the trainer recomputes exactly that from the temperature the
gateway records per token (Sample.temperatures). Truncation (top_p, top_k, min_p, min_new_tokens)
changes what is drawn but not what is reported, so in an RL session it is refused with a 400 naming
the field and the session's policy, unless the session allows it (SessionSampling.allow_truncation).
"""

from __future__ import annotations

from typing import Any, Mapping

from asyncrl.config import is_truncating


class SamplingPolicyError(ValueError):
    """A turn asks for truncated sampling in a session whose policy refuses it (400)."""


def check_sampling(params: Mapping[str, Any], allow_truncation: bool) -> None:
    """Raise SamplingPolicyError naming every truncating field of `params` unless the session allows it."""
    truncating = [f"{name}={value}" for name, value in params.items() if is_truncating(name, value)]
    if truncating and not allow_truncation:
        raise SamplingPolicyError(
            f"{', '.join(truncating)}: this session's sampling policy refuses truncated sampling (the trainer's "
            "importance ratios use the untruncated distribution); the run allows it with "
            "rollout.sampling.allow_truncation=true")


def logprob_temperature(params: Mapping[str, Any]) -> float:
    """The temperature of the distribution the engine's reported log-probs come from (1 for greedy)."""
    temperature = params.get("temperature")
    if temperature is None:
        return 1.0  # SGLang's default
    return float(temperature) if temperature > 0 else 1.0
