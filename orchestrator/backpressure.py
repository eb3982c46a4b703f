"""Backpressure: signals from the trainer's side that stop new groups (accepted ones still finish).

Redis is read (`refresh`) as soon as the trainer reports progress (it read groups or recorded weights:
the `progress` stream, read with a blocking XREAD) and at least every `backpressure_interval_s`; between
reads each signal answers `holds()` from local counts, so the limits hold exactly, not one read late:

- `unconsumed_groups`: complete groups the trainer has not read yet, plus groups this orchestrator
  completed since (not yet visible in the read) and groups still open (they will be complete groups
  soon), >= max_unconsumed_groups: the trainer lags. Groups the trainer has read but not acknowledged
  (training, or waiting for the checkpoint that makes them durable) do not count: counting them would
  deadlock a trainer that checkpoints every few steps. Per env: an env's own open groups count in full
  against its new groups, another env's only up to that env's share of the limit (its dispatch weight's
  share, at least one group), so an env whose episodes hang holds up its own dispatch, not the others'.
- `staleness`: group n may start only while n < (trained_version + staleness_limit + 1) * groups_per_step,
  so rollouts never run more than staleness_limit weight versions ahead of the trainer (AReaL's rule).
  trained_version is the `weights` hash's served_version (asyncrl.store.WeightsState: the version of the
  trainer's last push, whatever its method; not the newest snapshot, which tensor/distributed pushes
  write only now and then) less its lineage_offset: a restarted trainer pushes its checkpoint's weights
  under a new version, and that push trained nothing.

A new signal is a `Signal` subclass added to `Backpressure.signals`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from typing import Callable, Optional, Sequence

from asyncrl.config import OrchestratorConfig
from asyncrl.store import Store

log = logging.getLogger("orchestrator.backpressure")


class Signal(ABC):
    name: str

    async def refresh(self, store: Store) -> None:
        """Read what this signal needs from Redis (every backpressure_interval_s)."""

    @abstractmethod
    def holds(self, trained_version: Optional[int], env: Optional[str] = None) -> bool:
        """True while new groups of `env` (None: of any env, the run-wide rule) must wait (called before every
        new group: keep it cheap)."""


class UnconsumedGroups(Signal):
    name = "unconsumed_groups"

    def __init__(self, limit: int, recorded: Callable[[], int], unwritten: Callable[[], int],
                 open_groups: Callable[[], dict[str, int]], shares: Callable[[], dict[str, float]]) -> None:
        """`recorded`: group records this process has written to the stream; `unwritten`: complete groups
        not written yet. Both count from this process's start only: the run's total of groups (restored
        from the ledger by a restarted orchestrator) would count every group of the previous process as
        not yet read, and hold new groups for good (a resumed run that never trained again).
        `open_groups`: open groups by env; `shares`: each env's share of dispatch (weights summing to 1)."""
        self.limit, self.recorded, self.unwritten = limit, recorded, unwritten
        self.open_groups, self.shares = open_groups, shares
        self.unconsumed = 0
        self.recorded_at_read = 0

    async def refresh(self, store):
        self.unconsumed = await store.unread_groups()
        self.recorded_at_read = self.recorded()  # after the read: a group written meanwhile counts twice, never 0 times

    def holds(self, trained_version, env=None):
        not_yet_read = self.recorded() - self.recorded_at_read + self.unwritten()
        return self.unconsumed + not_yet_read + self._open(env) >= self.limit

    def _open(self, env: Optional[str]) -> int:
        """Open groups that count against new groups of `env` (None: all of them)."""
        groups = self.open_groups()
        if env is None:
            return sum(groups.values())
        shares = self.shares()
        return groups.get(env, 0) + sum(min(n, max(1, math.ceil(self.limit * shares.get(other, 1.0))))
                                        for other, n in groups.items() if other != env)


class Staleness(Signal):
    name = "staleness"

    def __init__(self, limit: int, groups_per_step: int, groups_started: Callable[[], int]) -> None:
        self.limit, self.groups_per_step, self.groups_started = limit, groups_per_step, groups_started

    def holds(self, trained_version, env=None):
        return self.groups_started() >= ((trained_version or 0) + self.limit + 1) * self.groups_per_step


class Backpressure:
    def __init__(self, cfg: OrchestratorConfig, store: Store, signals: list[Signal],
                 on_change: Callable[[], None]) -> None:
        self.store = store
        self.interval_s = cfg.backpressure_interval_s
        self.signals = signals
        self.on_change = on_change
        self.served_version: Optional[int] = None
        """The weight version the engines serve (None until the first read)."""
        self.trained_version: Optional[int] = None
        """served_version less the versions a restarted trainer pushed without training (lineage_offset):
        what the staleness rule budgets by."""

    def reasons(self, envs: Sequence[Optional[str]] = (None,)) -> list[str]:
        """The signals that hold new groups of every env in `envs` (default: the run-wide rule)."""
        return [s.name for s in self.signals if all(s.holds(self.trained_version, env) for env in envs)]

    async def refresh(self) -> None:
        weights = await self.store.weights()
        self.served_version = weights.served_version
        self.trained_version = weights.served_version - weights.lineage_offset
        for signal in self.signals:
            await signal.refresh(self.store)
        self.on_change()

    async def refresh_forever(self) -> None:
        """Refresh at once when the trainer reads groups or records weights (a blocking read of its
        `progress` stream), else every interval_s."""
        seen = "0-0"
        while True:
            try:
                await self.refresh()
                seen = await self.store.wait_trainer_progress(seen, self.interval_s)
            except Exception as err:  # noqa: BLE001 - a Redis hiccup must not stop the poller
                log.warning("reading backpressure signals failed: %r", err)
                await asyncio.sleep(self.interval_s)
