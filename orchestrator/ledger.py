"""The orchestrator's durable state in Redis, written behind the dispatch loop in batches.

Keys (prefix `asyncrl:{run}:`):

| key | type | content |
|---|---|---|
| `orch:envs` | hash | env_id -> registration (name, domain, url, capacity, weight, heartbeat mode) |
| `orch:heartbeats` | hash | env_id -> unix time of the last heartbeat / successful probe |
| `orch:groups` | hash | group_id -> the open group with every member's state (msgpack) |
| `orch:meta` | hash | group ordinal, per-env task cursors, counters |
| `orch:batch` | string | id of the last batch applied (a retried batch is applied once) |
| `orch:meta` `records`, `records_lost` | hash fields | group records appended so far, and how many of them a Redis restart lost |
| `orch:meta` `incarnation` | hash field | how many times an orchestrator of this run has started (raised by each start's `load`) |
| `groups` | stream | the trainer's stream: one GroupRecord per complete group (but filtered ones) |

The dispatch loop changes groups in memory and marks them dirty; a writer task snapshots everything
dirty and writes it in one MULTI/EXEC, at most every LINGER_S (events meanwhile share the next one).
A group's completion (XADD of its GroupRecord to `groups`) and its deletion from `orch:groups` are
in the same transaction, together with the counters: a group is appended exactly once, also across
crashes. A group filtered by dynamic sampling (`discard`) is deleted from `orch:groups` with its
samples (XDEL from `samples`: nobody will acknowledge them, so retention would never trim them) in
the same way, and never appended. `durable(group)` waits until the group's current state is in Redis.

A Redis that comes back from its AOF without its last writes (appendfsync everysec; `always` loses none)
shows here as a batch marker older than the last batch this ledger applied. The ledger then counts the
group records it had appended that are gone (`records` then and now), logs them and keeps the count
(`records_lost`, the status' `groups_lost_to_redis`): those groups will not be trained.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from redis.exceptions import RedisError, WatchError

from asyncrl.store import Store
from orchestrator.groups import Group
from orchestrator.registry import Service

log = logging.getLogger("orchestrator.ledger")

RETRY_S = (0.1, 0.5, 2.0)
LINGER_S = 0.05
"""At most one batch per 50 ms: each MULTI/EXEC costs syscalls (a profile at 2k in flight had a fifth of
the process in Redis writes without it); nothing on the hot path waits for a batch."""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Snapshot:
    """What a (re)started orchestrator reads back."""

    services: list[Service] = field(default_factory=list)
    heartbeats: dict[str, float] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    incarnation: int = 1
    """This start's number among the run's orchestrator starts (1: the first)."""


class Ledger:
    def __init__(self, store: Store, meta: Callable[[], dict[str, int]]) -> None:
        self.store = store
        self.redis = store.redis
        self.meta = meta
        """Called at each flush: counters and cursors to write with the groups (one consistent instant)."""
        self._dirty: dict[str, Group] = {}
        self._completed: dict[str, Group] = {}
        self._discarded: dict[str, Group] = {}
        self._heartbeats: dict[str, float] = {}
        self._in_batch: set[str] = set()
        self._records_in_batch = 0
        self._kick = asyncio.Event()
        self._next: asyncio.Future = asyncio.get_running_loop().create_future()
        self._current: Optional[asyncio.Future] = None
        self.groups_recorded = 0
        """GroupRecords this ledger has written to the `groups` stream."""
        self.records = 0
        """GroupRecords the run's orchestrators have appended, as of the last batch (`orch:meta` `records`)."""
        self.records_lost = 0
        """Of those, how many Redis restarts lost (acknowledged, then gone from the restored AOF)."""
        self._applied: Optional[str] = None
        """Id of the last batch this ledger applied: `orch:batch` says another one only if Redis lost writes."""
        self.filtered_unreported = 0
        """Groups discarded since the last GroupRecord written: the next record carries them
        (GroupRecord.filtered_before), so the trainer can count what filling a step took. Kept in
        `orch:meta` (`filtered_unreported`) with the batch."""

    def key(self, name: str) -> str:
        return self.store.key(f"orch:{name}")

    # Reading -------------------------------------------------------------------------------------
    async def load(self) -> Snapshot:
        pipe = self.redis.pipeline(transaction=True)
        for name in ("envs", "heartbeats", "groups", "meta"):
            pipe.hgetall(self.key(name))
        pipe.hincrby(self.key("meta"), "incarnation", 1)
        envs, beats, groups, meta, incarnation = await pipe.execute()
        return Snapshot(services=[Service.decode(blob) for blob in envs.values()],
                        heartbeats={_s(k): float(v) for k, v in beats.items()},
                        groups=sorted((Group.decode(blob) for blob in groups.values()), key=lambda g: g.ordinal),
                        meta={_s(k): _s(v) for k, v in meta.items()}, incarnation=int(incarnation))

    # Registry (rare, written at once) --------------------------------------------------------------
    async def save_service(self, service: Service) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key("envs"), service.env_id, service.encode())
        pipe.hset(self.key("heartbeats"), service.env_id, service.last_heartbeat)
        await pipe.execute()

    async def delete_service(self, env_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.key("envs"), env_id)
        pipe.hdel(self.key("heartbeats"), env_id)
        await pipe.execute()

    def heartbeat(self, env_id: str, at: float) -> None:
        self._heartbeats[env_id] = at
        self._kick.set()

    # Groups (batched) ----------------------------------------------------------------------------
    def touch(self, group: Group) -> None:
        """The group changed in memory; it is written with the next batch."""
        self._dirty[group.group_id] = group
        self._kick.set()

    def complete(self, group: Group) -> None:
        """Append the group's record and forget it, atomically, with the next batch."""
        self._dirty.pop(group.group_id, None)
        self._completed[group.group_id] = group
        self._kick.set()

    def discard(self, group: Group) -> None:
        """Forget the group and delete its samples, atomically, with the next batch; no record."""
        self._dirty.pop(group.group_id, None)
        self._discarded[group.group_id] = group
        self._kick.set()

    @property
    def unwritten_completions(self) -> int:
        """Complete groups whose records are not in Redis yet (waiting for, or in, the running batch)."""
        return len(self._completed) + self._records_in_batch

    async def durable(self, group: Group) -> None:
        """Return once the group's state as of now is in Redis."""
        gid = group.group_id
        if gid in self._dirty or gid in self._completed or gid in self._discarded:
            await asyncio.shield(self._next)
        elif gid in self._in_batch and self._current is not None:
            await asyncio.shield(self._current)

    async def sync(self) -> None:
        """Return once everything changed so far is in Redis."""
        if self._dirty or self._completed or self._discarded or self._heartbeats:
            await asyncio.shield(self._next)
        elif self._current is not None and not self._current.done():
            await asyncio.shield(self._current)

    async def write_forever(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            started = time.monotonic()
            await self._write_batch()
            await asyncio.sleep(LINGER_S - (time.monotonic() - started))

    async def _write_batch(self) -> None:
        dirty, completed, discarded, beats = self._dirty, self._completed, self._discarded, self._heartbeats
        self._dirty, self._completed, self._discarded, self._heartbeats = {}, {}, {}, {}
        self._in_batch = set(dirty) | set(completed) | set(discarded)
        self._records_in_batch = len(completed)
        self._current, self._next = self._next, asyncio.get_running_loop().create_future()
        states = {gid: g.encode() for gid, g in dirty.items()}
        records = [(gid, g.record()) for gid, g in completed.items()]
        for _, record in records:
            record.created_at = time.time()
        dropped = [(gid, g.record().sample_refs) for gid, g in discarded.items()]
        unreported = self.filtered_unreported + len(dropped)
        if records:  # the first record of the batch carries every group filtered before it
            records[0][1].filtered_before, unreported = unreported, 0
        meta = self.meta()
        if unreported or self.filtered_unreported:  # only runs that filter have the key
            meta = {**meta, "filtered_unreported": unreported}
        await self._execute(lambda pipe: self._queue_batch(
            pipe, states, records, beats, {**meta, "records": self.records + len(records),
                                           "records_lost": self.records_lost}, dropped))
        self.filtered_unreported = unreported
        self.groups_recorded += len(records)
        self.records += len(records)
        self._in_batch, self._records_in_batch = set(), 0
        self._current.set_result(None)

    def _queue_batch(self, pipe, states: dict[str, bytes], records: list, beats: dict[str, float],
                     meta: dict[str, int], dropped: list[tuple[str, list[str]]]) -> None:
        if states:
            pipe.hset(self.key("groups"), mapping=states)
        for gid, record in records:
            pipe.xadd(self.store.key("groups"), record.encode())
            pipe.hdel(self.key("groups"), gid)
        for gid, refs in dropped:
            pipe.hdel(self.key("groups"), gid)
            if refs:
                pipe.xdel(self.store.key("samples"), *refs)
        if beats:
            pipe.hset(self.key("heartbeats"), mapping=beats)
        pipe.hset(self.key("meta"), mapping=meta)

    async def _execute(self, queue_batch: Callable) -> None:
        """Retry until Redis takes the batch: accepted work is never dropped, nor written twice."""
        batch_id, attempt = uuid.uuid4().hex, 0
        while True:
            try:
                await self._apply_once(queue_batch, batch_id)
                return
            except (RedisError, OSError) as err:
                delay = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                log.warning("writing orchestrator state to Redis failed (%r); retrying in %.1fs", err, delay)
                await asyncio.sleep(delay)
                attempt += 1

    async def _apply_once(self, queue_batch: Callable, batch_id: str) -> None:
        """One MULTI/EXEC that also sets `orch:batch` to `batch_id`, under WATCH of that key.

        A failed attempt may still have been applied (the connection dropped after Redis ran it, or a
        hung Redis ran it after the command timed out); a retry that appended the records again would
        train those groups twice. So each attempt first reads the marker (already `batch_id`: done), and
        WATCH makes a transaction that reaches Redis after another attempt's, sent earlier but run later,
        abort instead of applying twice."""
        marker = self.key("batch")
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                await pipe.watch(marker)
                applied = _s(await pipe.get(marker) or b"")
                if applied == batch_id:
                    self._applied = batch_id
                    return
                if self._applied is not None and applied != self._applied:
                    self._count_lost(int(await pipe.hget(self.key("meta"), "records") or 0))
                pipe.multi()
                queue_batch(pipe)
                pipe.set(marker, batch_id)
                try:
                    await pipe.execute()
                    self._applied = batch_id
                    return
                except WatchError:  # another attempt of this batch got there first: the marker says so
                    continue

    def _count_lost(self, restored: int) -> None:
        """Redis came back without this ledger's last batches: count the group records that went with them."""
        lost = max(self.records - restored, 0)
        self.records_lost += lost
        self._applied = None  # counted once: the batch being written now is the new baseline
        log.error("Redis came back without the last writes it had acknowledged (its AOF lost them: "
                  "redis.appendfsync everysec, or a host crash): %d group records this orchestrator had appended "
                  "are gone and will not be trained (%d lost in this run)", lost, self.records_lost)
