"""Backpressure: signals from the trainer's side that stop new groups (accepted ones still finish).

Each signal is read from Redis every `backpressure_interval_s`, not per dispatch:

- `unconsumed_groups`: complete groups the trainer has not acknowledged >= max_unconsumed_groups
  (the trainer lags; more rollouts would only grow stale in the stream).
- `staleness`: group n may start only while n < (weight_version + staleness_limit + 1) * groups_per_step,
  so rollouts never run more than staleness_limit weight versions ahead of the trainer (AReaL's rule).

A new signal is a `Signal` subclass added to `Backpressure.signals`.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Callable, Optional

from asyncrl.config import OrchestratorConfig
from asyncrl.store import Store

log = logging.getLogger("orchestrator.backpressure")


class Signal(ABC):
    name: str

    @abstractmethod
    async def holds(self, store: Store, weight_version: Optional[int]) -> bool:
        """True while new groups must wait."""


class UnconsumedGroups(Signal):
    name = "unconsumed_groups"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def holds(self, store, weight_version):
        return await store.unconsumed_groups() >= self.limit


class Staleness(Signal):
    name = "staleness"

    def __init__(self, limit: int, groups_per_step: int, groups_started: Callable[[], int]) -> None:
        self.limit, self.groups_per_step, self.groups_started = limit, groups_per_step, groups_started

    async def holds(self, store, weight_version):
        return self.groups_started() >= ((weight_version or 0) + self.limit + 1) * self.groups_per_step


class Backpressure:
    def __init__(self, cfg: OrchestratorConfig, store: Store, groups_started: Callable[[], int],
                 on_change: Callable[[], None]) -> None:
        self.store = store
        self.interval_s = cfg.backpressure_interval_s
        self.on_change = on_change
        self.signals: list[Signal] = []
        if cfg.max_unconsumed_groups > 0:
            self.signals.append(UnconsumedGroups(cfg.max_unconsumed_groups))
        if cfg.staleness_limit is not None:
            self.signals.append(Staleness(cfg.staleness_limit, cfg.groups_per_step, groups_started))
        self.reasons: set[str] = set()
        self.weight_version: Optional[int] = None

    async def poll(self) -> None:
        version = (await self.store.get_weights()).get("version")
        self.weight_version = int(version) if version is not None else None
        reasons = {s.name for s in self.signals if await s.holds(self.store, self.weight_version)}
        if reasons != self.reasons:
            log.info("backpressure: %s", ", ".join(sorted(reasons)) or "released")
            self.reasons = reasons
            self.on_change()

    async def poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as err:  # noqa: BLE001 - a Redis hiccup must not stop the poller
                log.warning("backpressure poll failed: %r", err)
            await asyncio.sleep(self.interval_s)
