"""Which env gets the next episode: weighted fair dispatch with capacities and rate limits.

Pure bookkeeping, no I/O; the orchestrator asks `next(now)` after every event that can free work.

- Weights: stride scheduling. Each env has a `pass_`; the eligible env with the smallest pass is
  served and its pass advances by episodes / weight, so over time envs get episodes in the ratio of
  their weights (swe:terminal:search = 2:1:1). An env that comes back from a stall may catch up by
  at most one group, not by everything it missed.
- Eligible: has a healthy service with a free slot (a new group needs group_size free slots in the
  env), room under max_in_flight, and tokens in its rate bucket. Room counts the env's own episodes and
  the others' only up to their share of max_in_flight (their weight's share), so an env whose episodes
  hang cannot take the others' room: max_in_flight holds exactly while every env stays within its
  share, and the run can exceed it by what one env holds beyond its share.
- Work of an env: its pending members first (retries, episodes restored after a restart), then a
  new group (only while new groups are allowed: backpressure stops them, not accepted work).

Cost per decision: O(envs + services of the chosen env); envs are few.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from orchestrator.groups import Group, Member, TaskOrder
from orchestrator.registry import Service


class TokenBucket:
    """`rate` tokens per second, holding at most `burst` (>= one group, so a group can ever start)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.updated = burst, now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, n: int, now: float) -> float:
        """Seconds until n tokens are there (0 = now)."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)

    def take(self, n: int, now: float) -> None:
        self._refill(now)
        self.tokens -= n


@dataclass
class EnvQueue:
    """One env name: its replicas, its waiting members, its place in the rotation."""

    name: str
    domain: str
    weight: float = 1.0
    services: dict[str, Service] = field(default_factory=dict)
    pending: deque = field(default_factory=deque)
    """(group, member) ready to dispatch, oldest first."""
    tasks: Optional[TaskOrder] = None
    """None until the env's task list was fetched; no new groups before."""
    bucket: Optional[TokenBucket] = None
    pass_: float = 0.0
    in_flight: int = 0
    """Episodes of this env dispatched and not settled, at its removed services that still drain included
    (the queue outlives them: a sum over its services said 0 while the total said 9)."""

    def free_slots(self, now: float) -> int:
        return sum(s.free for s in self.services.values() if s.available(now))

    def pick_service(self, now: float, avoid: Optional[str] = None) -> Optional[Service]:
        """The available service with the most free slots. `avoid` (where the episode just failed)
        is skipped while the env has another healthy service, even a full one: better wait for it."""
        if avoid is not None and not any(s.healthy and not s.removed for s in self.services.values()
                                         if s.env_id != avoid):
            avoid = None
        best = None
        for s in self.services.values():
            if s.available(now) and s.env_id != avoid and (best is None or s.free > best.free):
                best = s
        return best

    def healthy_services(self) -> int:
        return sum(1 for s in self.services.values() if s.healthy and not s.removed)


@dataclass
class Decision:
    queue: EnvQueue
    member: Optional[tuple[Group, Member]]
    """A pending member to dispatch, or None: start a new group of this env."""


class Scheduler:
    def __init__(self, group_size: int, max_in_flight: int, domain_weights: dict[str, float],
                 rate_limits: dict[str, float]) -> None:
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.domain_weights = dict(domain_weights)
        self.rate_limits = dict(rate_limits)
        self.queues: dict[str, EnvQueue] = {}
        self._vtime = 0.0

    # Membership ----------------------------------------------------------------------------------
    def queue(self, name: str, domain: str = "", now: float = 0.0) -> EnvQueue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = EnvQueue(name, domain, pass_=self._vtime)
            rate = self.rate_limits.get(name)
            if rate:
                q.bucket = TokenBucket(rate, max(float(self.group_size), rate), now)
        return q

    def add_service(self, service: Service, now: float = 0.0) -> EnvQueue:
        q = self.queue(service.name, service.domain, now)
        q.domain = service.domain or q.domain
        q.services[service.env_id] = service
        self.reweigh()
        return q

    def remove_service(self, service: Service) -> None:
        q = self.queues.get(service.name)
        if q is not None:
            q.services.pop(service.env_id, None)

    def reweigh(self) -> None:
        """Effective weights: config by env name, else the domain's config weight shared by its envs
        in proportion to their registered weights, else the registered weight."""
        registered = {q.name: max((s.weight for s in q.services.values()), default=1.0) for q in self.queues.values()}
        by_domain: dict[str, float] = {}
        for q in self.queues.values():
            if q.name not in self.domain_weights:
                by_domain[q.domain] = by_domain.get(q.domain, 0.0) + registered[q.name]
        for q in self.queues.values():
            if q.name in self.domain_weights:
                q.weight = self.domain_weights[q.name]
            elif q.domain in self.domain_weights:
                q.weight = self.domain_weights[q.domain] * registered[q.name] / by_domain[q.domain]
            else:
                q.weight = registered[q.name]

    @property
    def in_flight(self) -> int:
        return sum(q.in_flight for q in self.queues.values())

    # Decisions -----------------------------------------------------------------------------------
    def shares(self) -> dict[str, float]:
        """Each env's share of dispatch (its effective weight over all of them)."""
        total = sum(q.weight for q in self.queues.values()) or 1.0
        return {name: q.weight / total for name, q in self.queues.items()}

    def next(self, now: float, new_groups: Callable[[str], bool]) -> Optional[Decision]:
        """The next dispatch, or None when nothing is eligible now (see `wake_in`); `new_groups(env)`: whether
        that env may start a new group (backpressure)."""
        best: Optional[Decision] = None
        for q in self.queues.values():
            decision = self._eligible(q, now, new_groups)
            if decision is None:
                continue
            q.pass_ = max(q.pass_, self._vtime - self.group_size / q.weight)  # bounded catch-up after a stall
            if best is None or q.pass_ < best.queue.pass_:
                best = decision
        if best is not None:
            self._vtime = max(self._vtime, best.queue.pass_)
        return best

    def _room(self, q: EnvQueue) -> int:
        """max_in_flight less q's episodes and the other envs' up to their share of it."""
        shares = self.shares()
        others = sum(min(o.in_flight, math.ceil(self.max_in_flight * shares[o.name]))
                     for o in self.queues.values() if o is not q)
        return self.max_in_flight - q.in_flight - others

    def _eligible(self, q: EnvQueue, now: float, new_groups: Callable[[str], bool]) -> Optional[Decision]:
        room = self._room(q)
        if q.pending:
            _, member = q.pending[0]
            ok = room >= 1 and q.pick_service(now, avoid=member.service) is not None and \
                (q.bucket is None or q.bucket.wait_s(1, now) == 0)
            return Decision(q, q.pending[0]) if ok else None
        n = self.group_size
        if q.tasks is None or room < n:
            return None
        capacity = self._capacity(q)  # an env smaller than a group starts one when it is empty
        if capacity == 0 or q.free_slots(now) < min(n, capacity):
            return None
        if q.bucket is not None and q.bucket.wait_s(n, now) > 0:
            return None
        return Decision(q, None) if new_groups(q.name) else None

    @staticmethod
    def _capacity(q: EnvQueue) -> int:
        return sum(s.capacity for s in q.services.values() if s.healthy and not s.removed)

    def charge(self, q: EnvQueue, episodes: int, now: float) -> None:
        """Account a dispatch of `episodes` from q (rate tokens, rotation)."""
        q.pass_ += episodes / q.weight
        if q.bucket is not None:
            q.bucket.take(episodes, now)

    def wake_in(self, now: float) -> Optional[float]:
        """Seconds until a rate bucket or a service backoff could make something eligible."""
        waits = []
        for q in self.queues.values():
            if q.bucket is not None and (q.pending or q.tasks is not None):
                waits.append(q.bucket.wait_s(1 if q.pending else self.group_size, now))
            waits += [s.backoff_until - now for s in q.services.values() if s.backoff_until > now]
        positive = [w for w in waits if w > 0]
        return min(positive) if positive else None

    @property
    def queued(self) -> int:
        return sum(len(q.pending) for q in self.queues.values())
