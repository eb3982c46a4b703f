"""The orchestrator's side of the outcome taxonomy (asyncrl/protocols/env_service.py OUTCOMES).

An attempt the env service answered has that answer's reason. One it did not answer gets one of
the orchestrator's own reasons below, both infrastructure failures: like every failure, the
attempt is retried and, after max_attempts, given up as a `failed` sample the trainer drops.
"""

from __future__ import annotations

from asyncrl.protocols.env_service import OUTCOMES, EpisodeReason, OutcomeClass

SERVICE_ERROR = "service_error"
"""The env service gave no usable answer: unreachable, an HTTP error or a malformed reply, the episode
aborted there (a draining service), or the service was taken out of the rotation while it ran."""
ORCHESTRATOR_ERROR = "orchestrator_error"
"""The attempt failed here: the gateway refused its session, or a bug."""


def outcome_class(reason: str) -> OutcomeClass:
    """The class of an attempt's reason: the env service's, or one of the orchestrator's own."""
    if reason in (SERVICE_ERROR, ORCHESTRATOR_ERROR):
        return OutcomeClass.infrastructure
    return OUTCOMES[EpisodeReason(reason)][0]


def by_class(reasons: dict[str, int]) -> dict[str, dict[str, int]]:
    """{reason: n} -> {class: {reason: n}}, the shape /v1/status reports outcomes in."""
    nested: dict[str, dict[str, int]] = {}
    for reason, n in sorted(reasons.items()):
        nested.setdefault(outcome_class(reason).value, {})[reason] = n
    return nested
