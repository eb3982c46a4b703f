"""Wire types of the orchestrator's env registry (shared/protocols/orchestrator.md, env-service.md).

Env services send these (self-registration, heartbeats); the orchestrator serves them.
"""

from __future__ import annotations

from pydantic import BaseModel


class RegisterRequest(BaseModel):
    """POST {orchestrator}/v1/envs"""

    name: str
    domain: str
    url: str
    capacity: int
    weight: float = 1.0


class RegisterResponse(BaseModel):
    env_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class HeartbeatRequest(BaseModel):
    """POST {orchestrator}/v1/envs/{env_id}/heartbeat"""

    in_flight: int
    healthy: bool = True
