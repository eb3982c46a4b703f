"""How a run's sampling config reaches an episode: as a gateway session's defaults and policy
(`session_sampling`: every field), or, without a gateway (sessions=endpoint), in the LLM endpoint handed to
the env service, for its agent to send with every model request (`endpoint_sampling`). `asyncrl eval` runs
the same orchestrator, so an evaluation samples exactly as the run's rollouts do."""

from __future__ import annotations

from dataclasses import asdict

from asyncrl.config import SamplingConfig
from asyncrl.protocols.env_service import EndpointSampling
from asyncrl.protocols.gateway import SessionSampling


def endpoint_sampling(s: SamplingConfig) -> EndpointSampling:
    """What an env's agent sends with every model request: each drawing field of the run's sampling config
    (max_new_tokens as OpenAI's max_tokens). SGLang's extensions (top_k, min_p) only when they are set, so
    a plain OpenAI-compatible server (sessions=endpoint) is not sent keys it may refuse."""
    extensions = {"top_k": s.top_k, "min_p": s.min_p}
    extra = {k: v for k, v in extensions.items() if v != getattr(SamplingConfig, k)}
    return EndpointSampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens, **extra)


def session_sampling(s: SamplingConfig, seed: int) -> SessionSampling:
    """A gateway session's defaults and policy from the run's sampling config: every field of it."""
    return SessionSampling(**asdict(s), sampling_seed=seed)
