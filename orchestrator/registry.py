"""The env registry: which services exist, where, how much they take, and whether they are alive.

Services with the same `name` are replicas of one env (same tasks). A service is healthy while its
heartbeats (push) or /health probes (probe) keep arriving within heartbeat_timeout_s; an unhealthy
service gets no new episodes and its running ones are re-dispatched. Registering the same URL again
returns the same env_id (a restarted service, or an operator repeating a command).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Optional

import orjson

from asyncrl.protocols.orchestrator import EnvRecord, HeartbeatMode, RegisterRequest


@dataclass
class Service:
    env_id: str
    name: str
    domain: str
    url: str
    capacity: int
    weight: float
    heartbeat: HeartbeatMode
    last_heartbeat: float = field(default_factory=time.time)
    healthy: bool = True
    removed: bool = False
    """Deregistered: gets nothing new; its running episodes finish (drain)."""
    in_flight: int = 0
    """Episodes this orchestrator has running there."""
    reported_in_flight: int = 0
    """What the service's last heartbeat said (episodes of a dead orchestrator still draining count too)."""
    backoff_until: float = 0.0
    """Monotonic time before which it gets nothing new (it just refused an episode with 429/503)."""

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight

    def available(self, now: float) -> bool:
        return self.healthy and not self.removed and self.in_flight < self.capacity and now >= self.backoff_until

    def to_record(self) -> EnvRecord:
        return EnvRecord(env_id=self.env_id, name=self.name, domain=self.domain, url=self.url,
                         capacity=self.capacity, weight=self.weight, heartbeat=self.heartbeat,
                         in_flight=self.in_flight, healthy=self.healthy and not self.removed,
                         last_heartbeat=self.last_heartbeat)

    def encode(self) -> bytes:
        """What survives a restart: identity and registration, not liveness (that is re-learnt)."""
        return orjson.dumps({k: getattr(self, k) for k in
                             ("env_id", "name", "domain", "url", "capacity", "weight", "heartbeat")})

    @classmethod
    def decode(cls, blob: bytes) -> "Service":
        return cls(**orjson.loads(blob))


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.services: dict[str, Service] = {}

    def __iter__(self) -> Iterator[Service]:
        return iter(list(self.services.values()))

    def get(self, env_id: str) -> Optional[Service]:
        return self.services.get(env_id)

    def register(self, req: RegisterRequest) -> tuple[Service, bool]:
        """(service, created). Same URL -> the existing entry, updated and healthy again."""
        url = req.url.rstrip("/")
        existing = next((s for s in self.services.values() if s.url == url), None)
        if existing is not None and existing.name != req.name:
            raise ValueError(f"url {url} is already registered as env {existing.name!r} ({existing.env_id}); "
                             f"remove it first")
        service = existing or Service(env_id=f"env-{uuid.uuid4().hex[:12]}", name=req.name, domain=req.domain,
                                      url=url, capacity=req.capacity, weight=req.weight, heartbeat=req.heartbeat)
        service.domain, service.capacity, service.weight = req.domain, req.capacity, req.weight
        service.heartbeat, service.removed = req.heartbeat, False
        self.mark_alive(service)
        self.services[service.env_id] = service
        return service, existing is None

    def restore(self, service: Service) -> None:
        """A service known before a restart: presumed alive for one heartbeat timeout."""
        self.mark_alive(service)
        self.services[service.env_id] = service

    def mark_alive(self, service: Service) -> None:
        service.last_heartbeat = time.time()
        service.healthy = True

    def expired(self, now: float) -> list[Service]:
        """Healthy services whose last sign of life is older than the timeout."""
        return [s for s in self.services.values()
                if s.healthy and now - s.last_heartbeat > self.heartbeat_timeout_s]

    def forget(self, service: Service) -> None:
        self.services.pop(service.env_id, None)
