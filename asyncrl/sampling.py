"""Sampling policy: which sampling parameters keep a rollout's log-probs the ones the trainer recomputes,
and under which temperature the reported log-probs are. One home for what the engine, the gateway and the
run config each decide about sampling (docs/trainer.md "Sampling and the ratios").

Engines report each token's log-prob under log_softmax(logits / T) of the untruncated distribution, T taken
as 1 for a greedy request, and the trainer recomputes exactly that from the temperature the gateway records
per token. Two kinds of parameters break it:

  * truncation (TRUNCATING_SAMPLING: top_p, top_k, min_p, min_new_tokens) changes what is drawn but not what
    is reported: the ratio is off by the kept probability mass, so a run must allow it explicitly;
  * reshaping or constraining the distribution (RESHAPING_SAMPLING: penalties, logit bias, structured
    output, custom logit processors): tokens drawn from a distribution the trainer does not recompute (with
    a constraint, mostly cannot), so nothing allows them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

GREEDY_TEMPERATURE = 1e-6
"""A temperature below this samples greedily (SGLang's _SAMPLING_EPS): dividing logits by it overflows."""

TRUNCATING_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0}
"""SGLang sampling fields that restrict which tokens can be drawn, with the value that restricts nothing
(top_k 0 also disables)."""


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_TEMPERATURE


def logprob_temperature(temperature: Optional[float]) -> float:
    """The temperature of the distribution an engine's reported log-probs come from: the request's, 1 for a
    greedy one, and SGLang's default 1 when none is given."""
    return 1.0 if temperature is None or is_greedy(temperature) else float(temperature)


def is_truncating(name: str, value: Any) -> bool:
    """Whether `value` of sampling field `name` restricts the drawable tokens (TRUNCATING_SAMPLING)."""
    if value is None or name not in TRUNCATING_SAMPLING:
        return False
    if name == "top_k":
        return value > 0
    return value != TRUNCATING_SAMPLING[name]


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
"""Fields that change the distribution tokens are drawn from, each with its neutral value's test (what its
absence means) and why it is refused. Under SGLang's names, and OpenAI's response_format."""
