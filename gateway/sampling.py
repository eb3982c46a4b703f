"""The gateway's check of a turn's sampling parameters, by the policy of asyncrl/sampling.py: the one place
that refuses what the trainer could not reproduce, for every API (chat, streamed chat, token-native), with a
400 naming the field and why, before the turn touches the session. Truncation is refused unless the session
allows it (SessionSampling.allow_truncation); reshaping or constraining fields always are.

A field at its neutral value (frequency_penalty 0, logit_bias {}, response_format {"type": "text"}) is
honoured trivially and not sent to the engine. Token-native callers send SGLang sampling params verbatim:
a key the gateway does not know is refused too, rather than forwarded to an engine that may ignore it.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from asyncrl.protocols.engine import SamplingParams
from asyncrl.sampling import RESHAPING_SAMPLING, TRUNCATING_SAMPLING, is_truncating


class SamplingPolicyError(ValueError):
    """A turn asks for sampling whose log-probs the trainer would not reproduce (400)."""


ENGINE_SAMPLING = frozenset({
    "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "max_new_tokens", "stop", "stop_token_ids",
    "ignore_eos", "sampling_seed", "n", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens",
}) | set(TRUNCATING_SAMPLING) | set(RESHAPING_SAMPLING)
"""The sampling params a turn may carry (SGLang names): forwarded to the engine, which honours them, or
applied by the gateway to the reply text (skip_special_tokens, no_stop_trim), or refused above."""

_REFUSED = ("the trainer recomputes each token's log-prob under the plain tempered distribution, so these "
            "turns' importance ratios would be wrong; no session policy allows them")


def check_sampling(params: Mapping[str, Any], allow_truncation: bool) -> dict[str, Any]:
    """The engine's sampling params of a turn: `params` less the neutral values of RESHAPING_SAMPLING.
    SamplingPolicyError names every field the gateway refuses: unknown ones, ones of the wrong type or out of
    the engine's range, reshaping ones, truncating ones unless the session allows truncation, n other than 1."""
    params = {name: value for name, value in params.items() if value is not None}  # null means the default
    unknown = sorted(name for name in params if name not in ENGINE_SAMPLING)
    if unknown:
        raise SamplingPolicyError(
            f"sampling_params {', '.join(map(repr, unknown))}: not SGLang sampling parameters the gateway "
            f"honours (known: {', '.join(sorted(ENGINE_SAMPLING))})")
    _check_types(params)
    if params.get("n") not in (None, 1):
        raise SamplingPolicyError(f"n={params['n']}: only n=1 (each sample is its own trajectory: open a "
                                  "session per sample)")
    reshaping = [f"{name}={value!r} ({RESHAPING_SAMPLING[name][1]})" for name, value in params.items()
                 if name in RESHAPING_SAMPLING and not RESHAPING_SAMPLING[name][0](value)]
    if reshaping:
        raise SamplingPolicyError(f"{'; '.join(reshaping)}: {_REFUSED}")
    truncating = [f"{name}={value}" for name, value in params.items() if is_truncating(name, value)]
    if truncating and not allow_truncation:
        raise SamplingPolicyError(
            f"{', '.join(truncating)}: this session's sampling policy refuses truncated sampling (the trainer's "
            "importance ratios use the untruncated distribution); the run allows it with "
            "rollout.sampling.allow_truncation=true")
    return {name: value for name, value in params.items() if name not in RESHAPING_SAMPLING}


def _check_types(params: Mapping[str, Any]) -> None:
    """Types and ranges as the engine's own SamplingParams has them, strictly (no "0.7" for 0.7, no true for 1):
    a value an engine would refuse, or fail on mid-batch, is a 400 here, naming the field."""
    typed = {name: value for name, value in params.items() if name in SamplingParams.model_fields}
    try:
        SamplingParams.model_validate(typed, strict=True)
    except ValidationError as err:
        raise SamplingPolicyError("; ".join(f"sampling_params.{'.'.join(map(str, e['loc']))}: {e['msg']} (got "
                                            f"{repr(e['input'])[:80]})" for e in err.errors())) from None
