"""A turn's sampling parameters, as they bear on the log-probs the trainer compares against.

Engines report each token's log-prob under log_softmax(logits / T) of the untruncated distribution (T
taken as 1 for a greedy request), and the trainer recomputes exactly that from the temperature the
gateway records per token (Sample.temperatures). Two kinds of parameters break that, and `check_sampling`
is the one place that refuses them, for every API (chat, streamed chat, token-native), with a 400 naming
the field and why, before the turn touches the session:

  * truncation (top_p, top_k, min_p, min_new_tokens) changes what is drawn but not what is reported:
    refused unless the session allows it (SessionSampling.allow_truncation);
  * reshaping or constraining the distribution (frequency / presence / repetition penalties, logit_bias,
    structured output: OpenAI's response_format, SGLang's json_schema / regex / ebnf / structural_tag,
    custom logit processors): the tokens would be drawn from a distribution the trainer does not
    recompute (and, with a constraint, mostly cannot), so no session policy allows them.

A field at its neutral value (frequency_penalty 0, logit_bias {}, response_format {"type": "text"}) is
honoured trivially and not sent to the engine. Token-native callers send SGLang sampling params verbatim:
a key the gateway does not know is refused too, rather than forwarded to an engine that may ignore it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from pydantic import ValidationError

from asyncrl.config import TRUNCATING_SAMPLING, is_truncating
from asyncrl.protocols.engine import SamplingParams


class SamplingPolicyError(ValueError):
    """A turn asks for sampling whose log-probs the trainer would not reproduce (400)."""


def _is(neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value == neutral


def _empty(value: Any) -> bool:
    return not value


def _plain_text(value: Any) -> bool:
    return not value or (isinstance(value, Mapping) and value.get("type") == "text" and len(value) == 1)


_PENALTY = "a penalty reshapes the next-token distribution by what was generated before"
_CONSTRAINT = ("structured output needs constrained decoding, which masks the distribution at every step "
               "(honouring the field without the mask would not give its guarantee)")
RESHAPING_SAMPLING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_is(0), _PENALTY),
    "presence_penalty": (_is(0), _PENALTY),
    "repetition_penalty": (_is(1), _PENALTY),
    "logit_bias": (_empty, "a logit bias shifts the next-token distribution"),
    "response_format": (_plain_text, _CONSTRAINT),
    "json_schema": (_empty, _CONSTRAINT),
    "regex": (_empty, _CONSTRAINT),
    "ebnf": (_empty, _CONSTRAINT),
    "structural_tag": (_empty, _CONSTRAINT),
    "custom_params": (_empty, "custom logit processors change the next-token distribution"),
}
"""Fields that change the distribution tokens are drawn from, each with its neutral value (what its absence
means) and why it is refused. Chat requests reach here under OpenAI's names (response_format), token-native
ones under SGLang's."""

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


def logprob_temperature(params: Mapping[str, Any]) -> float:
    """The temperature of the distribution the engine's reported log-probs come from (1 for greedy)."""
    temperature = params.get("temperature")
    if temperature is None:
        return 1.0  # SGLang's default
    return float(temperature) if temperature > 0 else 1.0
