"""Wire types of the orchestrator's HTTP API (docs/protocols/orchestrator.md, env-service.md).

Env services send the registry types (self-registration, heartbeats); operators send them through
`asyncrl env register|list|remove`; dashboards and the trainer read `StatusResponse`. No logic here.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

from asyncrl.protocols.fields import HttpUrl, Name, OptionalName

HeartbeatMode = Literal["push", "probe"]
MAX_CAPACITY = 1_000_000
"""Most episodes one service may say it runs at once."""
MAX_WEIGHT = 1e6


# Env registry ------------------------------------------------------------------------------------
class RegisterRequest(BaseModel):
    """POST {orchestrator}/v1/envs"""

    name: Name
    """Env name: services with the same name are replicas serving the same tasks."""
    domain: OptionalName = ""
    url: HttpUrl
    """Where the orchestrator reaches the service (http or https, with a host)."""
    capacity: int = Field(ge=1, le=MAX_CAPACITY, strict=True)
    """Episodes the service runs concurrently; the orchestrator never sends more."""
    weight: float = Field(1.0, gt=0, le=MAX_WEIGHT, allow_inf_nan=False, strict=True)
    """Dispatch weight of the env when the orchestrator's config names neither it nor its domain."""
    heartbeat: HeartbeatMode = "push"
    """push: the service POSTs heartbeats itself (SDK self-registration). probe: it cannot (operator
    registration from the CLI), so the orchestrator GETs its /health as the heartbeat."""


class RegisterResponse(BaseModel):
    env_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class HeartbeatRequest(BaseModel):
    """POST {orchestrator}/v1/envs/{env_id}/heartbeat"""

    in_flight: int = Field(0, ge=0, le=MAX_CAPACITY, strict=True)
    healthy: bool = Field(True, strict=True)
    """False takes the service out of the rotation at once (its in-flight episodes are re-dispatched)."""


class HeartbeatResponse(BaseModel):
    env_id: str
    healthy: bool


class EnvRecord(BaseModel):
    """One entry of GET /v1/envs."""

    env_id: str
    name: str
    domain: str
    url: str
    capacity: int
    weight: float
    heartbeat: HeartbeatMode
    in_flight: int
    """Episodes this orchestrator has running on the service now."""
    healthy: bool
    last_heartbeat: float
    """Unix time of the last heartbeat (push) or successful /health probe."""


class RemoveResponse(BaseModel):
    env_id: str
    removed: bool
    draining: int
    """Episodes still running there: they finish and count; nothing new is sent."""


# Status ------------------------------------------------------------------------------------------
class EnvStatus(BaseModel):
    in_flight: int
    queued: int
    completed: int
    """Episodes finished with a model outcome (completed, or truncated by max_turns / max_tokens): trained."""
    failed: int
    """Episodes given up after max_attempts."""
    groups_completed: int
    """Groups appended to the `groups` stream (passed and unusable ones included, filtered ones not)."""
    groups_filtered: int = 0
    """Complete groups dynamic sampling filtered (equal rewards): not appended, their samples deleted."""
    groups_passed: int = 0
    """Groups with equal rewards appended anyway by dynamic sampling's guard (max_filtered_batches)."""
    groups_unusable: int = 0
    """Appended groups with half or fewer members done: the trainer's group rule drops them."""
    healthy_services: int
    weight: float
    """Effective dispatch weight (config by name, else by domain, else the registered weight)."""
    groups_open: int = 0
    held: list[str] = Field(default_factory=list)
    """Backpressure signals holding this env's new groups (the run's `pause_reasons` are those holding every
    env): an env whose episodes hang is held by its own open groups, alone."""
    deadline_s: Optional[float] = None
    """deadline_s of the env's next episodes: its own episode_timeout_s, else sized from its episode durations
    (orchestrator/deadlines.py), else the run's episode_timeout_s."""
    max_turns: Optional[int] = None
    """max_turns of the env's episodes (its own setting, else the run's)."""
    outcomes: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Attempts that ended, by outcome class then reason (model: trained, once per member; environment,
    infrastructure: one per failed attempt, retried or given up), e.g. {"infrastructure": {"deadline_exceeded": 2}}."""


class OverheadSummary(BaseModel):
    """Scheduling overhead of the dispatches of the last `rate_window_s` (or after `?overhead_since=`, within
    the last 100k): from the episode being dispatchable (ready, and the event that freed its slot seen)
    to its POST on the wire."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float


class StatusResponse(BaseModel):
    """GET /v1/status"""

    in_flight: int
    """Episodes running at env services."""
    settling: int
    """Episodes the env service has answered whose result is being recorded (gateway finish, ledger)."""
    queued: int
    """Episodes of accepted groups waiting for a slot (retries, episodes restored after a restart)."""
    completed: int
    failed: int
    retried: int
    """Re-dispatches of an episode (after a service failure, a refusal or an orchestrator restart)."""
    groups_completed: int
    """Groups whose every member finished (in memory; their records reach Redis within ~50 ms)."""
    groups_recorded: int
    """Complete groups whose GroupRecord is durable in the `groups` stream (what the trainer can read)."""
    groups_lost_to_redis: int = 0
    """Group records Redis acknowledged and then lost in a restart from its AOF (appendfsync everysec, a
    host crash): never trained (orchestrator/ledger.py)."""
    groups_open: int
    groups_filtered: int = 0
    groups_passed: int = 0
    groups_unusable: int = 0
    """EnvStatus's, summed over the envs."""
    filtered_fraction: float = 0.0
    """Of the latest complete groups (64, or 4 x groups_per_step), the fraction dynamic sampling filtered."""
    filter_streak: int = 0
    """Groups filtered since the last informative group was appended (its guard passes groups at
    max_filtered_batches x groups_per_step)."""
    episodes_per_s: float
    """Finished episodes per second over the last `rate_window_s`."""
    weight_version: Optional[int]
    """The weight version the engines serve (`weights` hash `served_version`), which the staleness rule
    follows; None before the first read of it."""
    paused: bool
    pause_reasons: list[str]
    """Why no new groups start: "operator" (POST /v1/pause), "unconsumed_groups", "staleness"."""
    dispatch_overhead: OverheadSummary
    outcomes: dict[str, dict[str, int]] = Field(default_factory=dict)
    """EnvStatus.outcomes summed over the envs."""
    by_env: dict[str, EnvStatus]


class PauseResponse(BaseModel):
    """POST /v1/pause and /v1/resume"""

    paused: bool
    pause_reasons: list[str]
