"""The trainer's input: complete groups from Redis -> one optimizer step of packed micro-batches,
acknowledged only once the caller says the step is durable.

    loader = GroupLoader(store, consumer="trainer-0", config=cfg.trainer)
    batch = await loader.next_step(weight_version)   # groups_per_step usable groups, packed
    ...train on batch.micro_batches, make the step durable (checkpoint)...
    await loader.commit(batch)                       # XACK its groups, exactly once

Delivery guarantees (the "step ledger"):
* A group is acknowledged only by `commit` of the batch that read it, and at most once.
* A loader that dies before `commit` loses nothing: the groups stay pending in the consumer group;
  a new loader with the same consumer name gets them first, one with another name claims them
  after `claim_idle_ms` (Store.read_groups).
* Several batches may be in flight (prefetching the next step): no group is in two of them.
* The window between "durable" and XACK: store `batch.stream_ids` with the checkpoint and pass them
  as `trained_stream_ids` on restart; such groups are then acknowledged without being trained again.
* Dropped groups (stale, failed) are acknowledged with the step that saw them: consumed, not trained.
* A Redis that restarts from an AOF without its last writes (appendfsync everysec, a host crash) may have
  lost acknowledgements: those groups come back as pending. The loader remembers the last ACKED_MEMORY
  groups it acknowledged, acknowledges such a group again without training it, and counts it
  (`filter_redelivered`).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from asyncrl.config import TrainerConfig
from asyncrl.store import Store
from asyncrl.types import TrainingGroup
from trainer.advantages import FilterStats, ScoredGroup, as_recorded, score_group
from trainer.packing import MicroBatch, fill_ratio, pack

log = logging.getLogger("trainer.data")

ACKED_MEMORY = 10_000
"""Stream ids of the latest acknowledged groups the loader keeps: far more than the seconds of writes an
AOF can lose hold."""


@dataclass
class StepBatch:
    """Everything one optimizer step trains on, plus what must be acknowledged after it."""

    step_id: int
    """Sequence number of this batch within its loader (for logs)."""
    weight_version: int
    """Trainer weight version the staleness filter measured against."""
    micro_batches: list[MicroBatch]
    groups: list[TrainingGroup]
    """Every group consumed by this step, including dropped ones (all acknowledged on commit)."""
    stats: FilterStats
    micro_batch_tokens: int
    lineage: Callable[[int], int] = as_recorded
    """A sample's weight version in the numbering of `weight_version` (TrainerState.lineage_version)."""
    committed: bool = field(default=False, init=False)
    num_loss_tokens: int = field(init=False)
    num_loss_sequences: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_loss_tokens = sum(mb.num_loss_tokens for mb in self.micro_batches)
        self.num_loss_sequences = sum(mb.num_loss_sequences for mb in self.micro_batches)

    @property
    def stream_ids(self) -> list[str]:
        return [g.stream_id for g in self.groups]

    @property
    def fill_ratio(self) -> float:
        return fill_ratio(self.micro_batches, self.micro_batch_tokens)

    def staleness(self, sample) -> int:
        """Optimizer steps between the weights that generated the sample's first token and this step's."""
        return max(self.weight_version - self.lineage(sample.first_weight_version), 0)

    def normalizer(self, aggregation: str) -> int:
        """Loss denominator shared by all micro-batches of the step (LossInputs.normalizer), so the
        micro-batch losses sum to the loss of the whole step."""
        return self.num_loss_tokens if aggregation == "token" else self.num_loss_sequences


class GroupLoader:
    """Reads groups through the consumer group `trainer` and keeps the ledger of unacknowledged steps."""

    def __init__(self, store: Store, consumer: str, config: TrainerConfig, block_ms: int = 1000,
                 claim_idle_ms: int = 60_000, trained_stream_ids: Iterable[str] = ()) -> None:
        self.store = store
        self.consumer = consumer
        self.config = config
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self._trained = set(trained_stream_ids)
        self._acked: deque[str] = deque(maxlen=ACKED_MEMORY)
        self._acked_set: set[str] = set()
        self._redelivered = 0
        """Acknowledged groups Redis delivered again since the last next_step (their acknowledgement was lost)."""
        self._in_flight: set[str] = set()  # stream ids of groups in batches not committed yet
        self._step_ids = itertools.count()

    @property
    def in_flight(self) -> int:
        """Groups read into batches that are not committed yet."""
        return len(self._in_flight)

    async def next_step(self, weight_version: int, lineage: Callable[[int], int] = as_recorded) -> StepBatch:
        """Block until `groups_per_step` usable groups are read; score, pack and return them. `lineage`
        renumbers sample versions into weight_version's line (TrainerState.lineage_version)."""
        step_id = next(self._step_ids)
        kept: list[ScoredGroup] = []
        consumed: list[ScoredGroup] = []
        try:
            while len(kept) < self.config.groups_per_step:
                for group in await self._read(self.config.groups_per_step - len(kept)):
                    self._in_flight.add(group.stream_id)
                    scored = score_group(group, weight_version, self.config.staleness_tau, self.config.advantage,
                                         lineage)
                    consumed.append(scored)
                    if scored.samples:
                        kept.append(scored)
        except BaseException:  # cancelled or failed: hand the groups back to the next call
            self._in_flight.difference_update(scored.group.stream_id for scored in consumed)
            raise
        samples = [s for scored in kept for s in scored.samples]
        stats = sum((s.stats for s in consumed), FilterStats(redelivered=self._redelivered))
        self._redelivered = 0
        return StepBatch(step_id, weight_version, pack(samples, self.config.micro_batch_tokens),
                         [s.group for s in consumed], stats, self.config.micro_batch_tokens, lineage)

    async def commit(self, batch: StepBatch) -> None:
        """The step is durable: acknowledge its groups. Committing a batch again does nothing."""
        if batch.committed:
            return
        await self.store.ack_groups(batch.groups)
        batch.committed = True
        self._in_flight.difference_update(batch.stream_ids)
        self._remember_acked(batch.stream_ids)

    def _remember_acked(self, stream_ids: list[str]) -> None:
        for stream_id in stream_ids:
            if len(self._acked) == self._acked.maxlen:
                self._acked_set.discard(self._acked[0])
            self._acked.append(stream_id)
            self._acked_set.add(stream_id)

    async def _read(self, count: int) -> list[TrainingGroup]:
        """Up to `count` groups not already in an uncommitted batch of this loader. Our own pending
        entries (the in-flight ones among them) come back first from Store.read_groups, so ask for
        enough to see past them; the in-flight ones are skipped without being fetched."""
        groups = await self.store.read_groups(self.consumer, count + len(self._in_flight), block_ms=self.block_ms,
                                              claim_idle_ms=self.claim_idle_ms, exclude=self._in_flight)
        return await self._skip_trained(groups[:count])

    async def _skip_trained(self, groups: list[TrainingGroup]) -> list[TrainingGroup]:
        """Acknowledge (without training) groups a checkpoint says were trained before a crash, and groups
        this loader acknowledged before whose acknowledgement Redis lost."""
        done = [g for g in groups if g.stream_id in self._trained or g.stream_id in self._acked_set]
        if done:
            again = [g.stream_id for g in done if g.stream_id in self._acked_set]
            if again:
                log.error("Redis delivered %d groups again that this trainer had acknowledged (a restart from an "
                          "AOF without its last writes lost the acknowledgements): acknowledged again, not "
                          "trained: %s", len(again), again)
                self._redelivered += len(again)
            await self.store.ack_groups(done)
            self._trained.difference_update(g.stream_id for g in done)
        return [g for g in groups if all(g is not d for d in done)]
