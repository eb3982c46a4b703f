"""Liveness of env services: heartbeat expiry, /health probes, task lists, forgetting the long dead.

Every tick (a fraction of heartbeat_interval_s):
- probe-mode services (registered from the CLI) whose last probe is a heartbeat interval old get a
  GET /health; success counts as a heartbeat;
- a service silent for heartbeat_timeout_s turns unhealthy (its running episodes are re-dispatched);
  it turns healthy again with its next heartbeat or successful probe;
- a service unhealthy for `FORGET_AFTER` heartbeat timeouts is removed from the registry;
- envs whose task list is not known yet fetch it (GET /tasks) from one of their healthy services.
"""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator.core import Orchestrator
from orchestrator.groups import TaskOrder
from orchestrator.http import HTTPFailure
from orchestrator.registry import Service
from orchestrator.scheduler import EnvQueue

log = logging.getLogger("orchestrator.health")

FORGET_AFTER = 20
"""Heartbeat timeouts an unhealthy service stays listed (for `asyncrl env list`) before it is forgotten."""


class HealthMonitor:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.interval_s = orch.cfg.heartbeat_interval_s
        self.tick_s = min(1.0, self.interval_s / 4)
        self._probed: dict[str, float] = {}
        self._loading: set[str] = set()
        self._tasks_failed_at: dict[str, float] = {}

    async def run_forever(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        now = time.time()
        due = [s for s in self.orch.registry if s.heartbeat == "probe" and not s.removed
               and now - self._probed.get(s.env_id, 0.0) >= self.interval_s]
        await asyncio.gather(*(self._probe(s, now) for s in due))
        for service in self.orch.registry.expired(time.time()):
            self.orch.unhealthy(service, f"no heartbeat for {self.orch.cfg.heartbeat_timeout_s:g}s")
        await self._forget_dead(time.time())
        for q in self.orch.scheduler.queues.values():
            retry_at = self._tasks_failed_at.get(q.name, 0.0) + max(1.0, self.interval_s)
            if q.tasks is None and q.name not in self._loading and time.time() >= retry_at:
                self._loading.add(q.name)
                self.orch.spawn(self._load_tasks(q))

    async def _probe(self, service: Service, now: float) -> None:
        self._probed[service.env_id] = now
        if await self.orch.envs.healthy(service.url, timeout_s=min(5.0, self.interval_s)):
            self.orch.alive(service)

    async def _forget_dead(self, now: float) -> None:
        limit = FORGET_AFTER * self.orch.cfg.heartbeat_timeout_s
        for service in self.orch.registry:
            if not service.healthy and now - service.last_heartbeat > limit:
                log.info("forgetting env %s (%s) at %s: unhealthy for %.0fs", service.name, service.env_id,
                         service.url, now - service.last_heartbeat)
                await self.orch.remove(service.env_id)

    async def _load_tasks(self, q: EnvQueue) -> None:
        try:
            for service in [s for s in q.services.values() if s.healthy and not s.removed]:
                try:
                    cfg = self.orch.cfg
                    q.tasks = TaskOrder(q.name, await self.orch.envs.tasks(service.url, cfg.task_split), cfg.seed,
                                        cfg.task_order)
                except (HTTPFailure, ValueError) as err:
                    log.warning("env %s: reading tasks from %s failed: %s", q.name, service.url, err)
                    continue
                log.info("env %s: %d tasks (from %s)", q.name, len(q.tasks.task_ids), service.url)
                self.orch.wake()
                return
            self._tasks_failed_at[q.name] = time.time()
        finally:
            self._loading.discard(q.name)
