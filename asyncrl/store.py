"""The run's Redis data model (docs/protocols/store.md; extensions in docs/store.md).

Every key is `asyncrl:{run}:<name>`. Writers: the gateway appends samples; the orchestrator appends a
group entry once every member of a GRPO group is done; the trainer reads groups through the consumer
group `trainer` and acknowledges them only after the optimizer step that used them is durable, so a
trainer crash re-delivers them. Acknowledged groups are kept for `retention_groups` more groups
(inspection, dashboards), then deleted with their samples, so memory stays bounded.

The API is asyncio (redis.asyncio): every component that touches Redis runs an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable, Container, Iterable, Optional, TypeVar

import msgpack
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from asyncrl.types import GroupRecord, Sample, TrainedTokens, TrainingGroup

T = TypeVar("T")
log = logging.getLogger("asyncrl.store")

TRAINER_GROUP = "trainer"
COMMAND_TIMEOUT_S = 30.0
"""How long one Redis command may take before it fails with redis.exceptions.TimeoutError. Generous: the
largest calls (a step's samples in one pipeline) take well under a second, blocking reads ask for 1 s."""
RECORDED_TTL_S = 3600
"""How long Store.add_samples remembers a write's name (retries come within seconds to minutes)."""
ADD_SAMPLES_ONCE = """
local done = redis.call('LRANGE', KEYS[2], 0, -1)
if #done > 0 then return done end
local refs = {}
for i = 2, #ARGV, 3 do
  refs[#refs + 1] = redis.call('XADD', KEYS[1], '*', 'sample_id', ARGV[i], 'group_id', ARGV[i + 1], 'data', ARGV[i + 2])
end
if #refs > 0 then
  redis.call('RPUSH', KEYS[2], unpack(refs))
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return refs
"""
"""add_samples as one script (atomic like MULTI/EXEC): the XADDs, and their ids kept under the write's
name; a name already there returns its ids and appends nothing."""
RETRY_BACKOFF_CAP_S = 1.0
"""Store.connect(retry_s=...): back-off between attempts doubles from 0.1 s up to this."""
REGISTRY_RETRY_S = 60.0
"""store_call's retry_s: the one-off registry calls (engine URLs, services, weights) components make as
they start and stop are idempotent, and one starting during a Redis stall waits it out, not fails."""


@dataclass(frozen=True)
class WeightsState:
    """The `weights` hash: the one version the engines serve, and the newest snapshot on disk."""

    served_version: int = 0
    """What every engine serves: the version of the trainer's last push (0 before the first). An engine
    that did not take a push is restarted from a snapshot of it, so they all converge on this one."""
    lineage_offset: int = 0
    """Versions a restarted trainer pushed without training (its checkpoint's weights under a new version,
    TrainerState.repushes): served_version - lineage_offset is the trained pushes, what the orchestrator's
    staleness rule budgets groups by (rollouts during a restart must not run further ahead)."""
    snapshot_version: int = 0
    snapshot: Optional[str] = None
    """The newest snapshot directory (None before the first): a (re)starting engine loads it, labelled
    snapshot_version. `disk` pushes are snapshots; `tensor` / `distributed` write one every
    snapshot_every_pushes pushes and whenever an engine has to be restarted."""
    method: Optional[str] = None


def run_sync(coro: Awaitable[T]) -> T:
    """Run a store coroutine from synchronous code, also where an event loop is already running
    (Ray actor threads): it runs on a private loop in a helper thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class BoundedConnection(aioredis.Connection):
    """redis-py's connection with its send bounded by asyncio.timeout instead of asyncio.wait_for.

    With a socket timeout, redis-py bounds each send with asyncio.wait_for, which on Python 3.11 returns
    normally when a cancellation arrives as the send completes: the cancelled task keeps running (196 of
    300 cancellations lost: bench/results/redis_cancellation.md). Its reads already use asyncio.timeout, which
    does not lose them. A connection serves one command at a time, so the send can run with the socket
    timeout cleared and bounded here instead."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        timeout, self.socket_timeout = self.socket_timeout, None
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)
        except TimeoutError:  # asyncio's; redis-py has disconnected on the cancellation it raised
            raise redis.exceptions.TimeoutError(f"sending a command to Redis took over {timeout} s") from None
        finally:
            self.socket_timeout = timeout


class Store:
    """Typed access to one run's keys. Construct with `Store.connect(url, run)`."""

    def __init__(self, client: aioredis.Redis, run: str, retention_groups: int = 10_000) -> None:
        self.redis = client
        self.run = run
        self.retention_groups = retention_groups
        self._add_samples_once = client.register_script(ADD_SAMPLES_ONCE)

    @classmethod
    def connect(cls, url: str, run: str, retention_groups: int = 10_000, max_connections: int = 64,
                command_timeout_s: float = COMMAND_TIMEOUT_S, retry_s: float = 0.0) -> "Store":
        """A blocking pool: beyond `max_connections` concurrent commands wait for a connection
        (redis-py's default pool raises MaxConnectionsError past 100, e.g. 1,000 sessions finishing).
        Every command fails after `command_timeout_s`, so a hung (stopped, not dead) Redis surfaces as
        an error instead of a wait without end; see BoundedConnection for why not redis-py's own.

        `retry_s` > 0: a command that fails on a lost connection or a timeout is sent again, backing off
        for about `retry_s` seconds in all (plus up to `command_timeout_s` an attempt), so a Redis that
        restarts or stalls meanwhile is ridden out. Only for callers whose writes may be applied twice
        (a timed-out command may have been applied): the trainer's are (acks, metrics, weight records)."""
        retry = {}
        if retry_s > 0:
            retry = {"retry": Retry(ExponentialBackoff(cap=RETRY_BACKOFF_CAP_S, base=0.05),
                                    retries=math.ceil(retry_s / RETRY_BACKOFF_CAP_S) + 4)}
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=60,
                                                        connection_class=BoundedConnection,
                                                        socket_timeout=command_timeout_s, **retry)
        return cls(aioredis.Redis(connection_pool=pool), run, retention_groups)

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, name: str) -> str:
        return f"asyncrl:{self.run}:{name}"

    async def delete_run(self) -> int:
        """Delete every key of this run (a fresh start on a shared Redis); -> how many."""
        return await _delete_keys(self.redis, self.key("*"))

    # Samples -----------------------------------------------------------------------------------
    async def add_sample(self, sample: Sample) -> str:
        """Append a finished trajectory; returns its stream id (the reference groups carry)."""
        fields = {"sample_id": sample.sample_id, "group_id": sample.group_id, "data": sample.encode()}
        return _s(await self.redis.xadd(self.key("samples"), fields))

    async def add_samples(self, samples: list[Sample], once: str) -> list[str]:
        """Append several trajectories atomically (all or none); their stream ids. `once` names the write
        (the gateway's session id): a second call with it appends nothing and returns the first call's
        ids, for a caller retrying a call that failed after Redis had applied it (lost reply, timeout).
        The name is remembered for RECORDED_TTL_S."""
        args = [field for sample in samples for field in (sample.sample_id, sample.group_id, sample.encode())]
        refs = await self._add_samples_once(keys=[self.key("samples"), self.key(f"recorded:{once}")],
                                            args=[RECORDED_TTL_S, *args])
        return [_s(ref) for ref in refs]

    async def get_samples(self, refs: Iterable[str]) -> list[Sample]:
        """Samples by stream id, in order; a missing id raises KeyError (it was trimmed or never written)."""
        refs = list(refs)
        found = await self._samples_by_ref(refs)
        for ref, sample in zip(refs, found):
            if sample is None:
                raise KeyError(f"sample {ref} not in {self.key('samples')}")
        return found

    async def _samples_by_ref(self, refs: list[str]) -> list[Optional[Sample]]:
        pipe = self.redis.pipeline(transaction=False)
        for ref in refs:
            pipe.xrange(self.key("samples"), ref, ref)
        return [Sample.decode(entries[0][1][b"data"]) if entries else None for entries in await pipe.execute()]

    async def list_samples(self, before: str = "+", count: int = 100) -> list[tuple[str, Sample]]:
        """(stream id, sample) of up to `count` samples recorded before stream id `before` ("+": the newest
        first), newest first: paging for dashboards."""
        end = f"({before}" if before != "+" else "+"
        entries = await self.redis.xrevrange(self.key("samples"), end, "-", count=count)
        return [(_s(ref), Sample.decode(fields[b"data"])) for ref, fields in entries]

    async def add_trained(self, trained: list[TrainedTokens]) -> None:
        """Record what a step made of its samples (deleted with the samples by retention)."""
        if trained:
            await self.redis.hset(self.key("trained"), mapping={t.sample_ref: t.encode() for t in trained})

    async def trained(self, refs: Iterable[str]) -> dict[str, TrainedTokens]:
        """The trained record of each sample ref that has one (samples not trained yet, or dropped, have none)."""
        refs = list(refs)
        if not refs:
            return {}
        blobs = await self.redis.hmget(self.key("trained"), refs)
        return {ref: TrainedTokens.decode(blob) for ref, blob in zip(refs, blobs) if blob is not None}

    # Groups ------------------------------------------------------------------------------------
    async def add_group(self, record: GroupRecord) -> str:
        record.created_at = record.created_at or time.time()
        return _s(await self.redis.xadd(self.key("groups"), record.encode()))

    async def ensure_consumer_group(self, group: str = TRAINER_GROUP) -> None:
        try:
            await self.redis.xgroup_create(self.key("groups"), group, id="0", mkstream=True)
        except aioredis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def read_groups(self, consumer: str, count: int, block_ms: Optional[int] = None,
                          group: str = TRAINER_GROUP, claim_idle_ms: int = 60_000,
                          exclude: Container[str] = frozenset()) -> list[TrainingGroup]:
        """Up to `count` groups for `consumer`, oldest first: its own unacknowledged deliveries (a
        restarted reader), then deliveries of other consumers idle for `claim_idle_ms` (a crashed
        reader), then new entries. Nothing is acknowledged here: see `ack_groups`. Stream ids in
        `exclude` (groups the caller already holds) count towards `count` but are not fetched again."""
        await self.ensure_consumer_group(group)
        stream = self.key("groups")
        entries = (await self.redis.xreadgroup(group, consumer, {stream: "0"}, count=count))[0][1]
        if len(entries) < count:  # every own pending entry is in `entries` now: claim only others'
            entries += await self._claim_from_others(group, consumer, claim_idle_ms, count - len(entries),
                                                     own_pending=len(entries))
        if len(entries) < count:
            fresh = await self.redis.xreadgroup(group, consumer, {stream: ">"}, count=count - len(entries),
                                                block=block_ms)
            entries += fresh[0][1] if fresh else []
            if fresh and fresh[0][1]:
                await self.note_trainer_progress("read")
        return [await self._training_group(entry_id, fields) for entry_id, fields in entries
                if _s(entry_id) not in exclude]

    async def _claim_from_others(self, group: str, consumer: str, min_idle_ms: int, count: int,
                                 own_pending: int) -> list:
        """Up to `count` entries delivered to other consumers and idle for `min_idle_ms` (their reader
        died), now owned by `consumer`. Own entries are never claimed: a reader holding groups through a
        long step would otherwise take them back instead of new work."""
        stream = self.key("groups")
        pending = await self.redis.xpending_range(stream, group, "-", "+", count + own_pending, idle=min_idle_ms)
        ids = [p["message_id"] for p in pending if _s(p["consumer"]) != consumer][:count]
        if not ids:
            return []
        claimed = await self.redis.xclaim(stream, group, consumer, min_idle_ms, ids)
        return [e for e in claimed if e and e[1]]  # entries deleted meanwhile come back empty

    async def _training_group(self, entry_id: bytes, fields: dict[bytes, bytes]) -> TrainingGroup:
        """The record with the samples Redis still holds: one it lost (a restart from an AOF without its
        last writes) leaves its member missing, which the trainer's group rule counts, instead of a
        group no trainer can ever read."""
        record = GroupRecord.decode(fields)
        found = await self._samples_by_ref(record.sample_refs)
        if None in found:
            log.error("group %s (%s): %d of its %d samples are not in Redis (lost in a restart, or trimmed): "
                      "trained without them", _s(entry_id), record.group_id, found.count(None), len(found))
        return TrainingGroup(_s(entry_id), record, [s for s in found if s is not None])

    async def ack_groups(self, groups: list[TrainingGroup], group: str = TRAINER_GROUP) -> None:
        """Acknowledge consumed groups, then delete what falls out of the retention window."""
        if not groups:
            return
        consumed = self.key("consumed")
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.key("groups"), group, *[g.stream_id for g in groups])
        for g in groups:
            pipe.rpush(consumed, msgpack.packb([g.stream_id, g.record.sample_refs]))
        await pipe.execute()
        await self._enforce_retention()

    async def _enforce_retention(self) -> None:
        consumed = self.key("consumed")
        excess = await self.redis.llen(consumed) - self.retention_groups
        if excess <= 0:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.lrange(consumed, 0, excess - 1)
        pipe.ltrim(consumed, excess, -1)
        expired, _ = await pipe.execute()
        groups, samples = [], []
        for blob in expired:
            group_id, refs = msgpack.unpackb(blob, raw=False)
            groups.append(group_id)
            samples.extend(refs)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xdel(self.key("groups"), *groups)
        if samples:
            pipe.xdel(self.key("samples"), *samples)
            pipe.hdel(self.key("trained"), *samples)
        await pipe.execute()

    async def unconsumed_groups(self, group: str = TRAINER_GROUP) -> int:
        """Groups not yet acknowledged by the trainer (unread + read-but-unacknowledged)."""
        lag, pending = await self._consumer_state(group)
        return lag + pending

    async def unread_groups(self, group: str = TRAINER_GROUP) -> int:
        """Complete groups the trainer has not read yet: the orchestrator's backpressure signal (groups
        the trainer holds are being trained, or trained and awaiting their checkpoint)."""
        return (await self._consumer_state(group))[0]

    async def _consumer_state(self, group: str) -> tuple[int, int]:
        await self.ensure_consumer_group(group)
        info = next(g for g in await self.redis.xinfo_groups(self.key("groups")) if _s(g["name"]) == group)
        lag = info.get("lag")
        if lag is None:  # Redis < 7 has no lag field: count entries after last-delivered-id
            lag = len(await self.redis.xrange(self.key("groups"), f"({_s(info['last-delivered-id'])}", "+"))
        return int(lag), int(info["pending"])

    # Weights -----------------------------------------------------------------------------------
    async def record_snapshot(self, version: int, path: str) -> None:
        """A weight snapshot directory (HF format) is on disk: what a (re)starting engine loads from now on."""
        await self.redis.hset(self.key("weights"), mapping={"snapshot_version": str(version), "snapshot": path})

    async def record_served_version(self, version: int, method: str, lineage_offset: int = 0) -> None:
        """The engines were told to serve `version` (a push); the orchestrator's staleness rule follows it."""
        await self.redis.hset(self.key("weights"), mapping={"served_version": str(version), "method": method,
                                                            "lineage_offset": str(lineage_offset),
                                                            "pushed_at": str(time.time())})
        await self.note_trainer_progress("weights")

    async def weights(self) -> WeightsState:
        fields = {_s(k): _s(v) for k, v in (await self.redis.hgetall(self.key("weights"))).items()}
        return WeightsState(served_version=int(fields.get("served_version", 0)),
                            lineage_offset=int(fields.get("lineage_offset", 0)),
                            snapshot_version=int(fields.get("snapshot_version", 0)),
                            snapshot=fields.get("snapshot"), method=fields.get("method"))

    async def request_engine_restarts(self, engine_ids: Iterable[str], version: int) -> None:
        """Ask the actors of `engine_ids` to restart their engine process (it did not take weight version
        `version`); the snapshot of `version` must be recorded first, so the restart loads it."""
        ids = list(engine_ids)
        if ids:
            await self.redis.hset(self.key("engine_restarts"), mapping={eid: str(version) for eid in ids})

    async def engine_restart_request(self, engine_id: str) -> int:
        """The newest weight version `engine_id` was asked to restart for (0: never). Requests are never
        deleted: an actor honours one whose version is above what its engine already started with."""
        value = await self.redis.hget(self.key("engine_restarts"), engine_id)
        return int(value) if value is not None else 0

    # Engines ---------------------------------------------------------------------------------
    async def register_engine(self, engine_id: str, url: str) -> None:
        """Where an engine serves now (engine actors re-register after every restart)."""
        await self.redis.hset(self.key("engines"), engine_id, url)

    async def unregister_engine(self, engine_id: str) -> None:
        await self.redis.hdel(self.key("engines"), engine_id)

    async def engines(self) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in (await self.redis.hgetall(self.key("engines"))).items()}

    # Trainer progress ---------------------------------------------------------------------------
    async def note_trainer_progress(self, event: str) -> None:
        """One entry in the `progress` stream: the trainer read new groups or recorded new weights, the
        two things the orchestrator's backpressure waits for (it blocks on the stream: wait_trainer_progress)."""
        await self.redis.xadd(self.key("progress"), {"event": event, "ts": time.time()}, maxlen=1000, approximate=True)

    async def wait_trainer_progress(self, after: str, timeout_s: float) -> str:
        """Block until the `progress` stream has an entry newer than `after` ("0-0": any), at most
        `timeout_s`; -> the newest entry's id (`after` when none came)."""
        reply = await self.redis.xread({self.key("progress"): after}, count=1000, block=max(1, int(timeout_s * 1000)))
        return _s(reply[0][1][-1][0]) if reply and reply[0][1] else after

    # Metrics -----------------------------------------------------------------------------------
    async def add_metrics(self, source: str, values: dict[str, float], maxlen: int = 100_000) -> None:
        """Append a metrics record (time series for `asyncrl watch`, TensorBoard and tests)."""
        data = msgpack.packb(values)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.key("metrics"), {"source": source, "ts": time.time(), "data": data}, maxlen=maxlen,
                      approximate=True)
            pipe.hset(self.key("metrics_last"), source, data)
            await pipe.execute()

    async def last_metrics(self, source: str) -> Optional[dict[str, float]]:
        """The newest record `source` added (None before its first), without a walk over the stream."""
        data = await self.redis.hget(self.key("metrics_last"), source)
        return None if data is None else msgpack.unpackb(data, raw=False)

    async def read_metrics(self, after: str = "0-0", count: int = 1000) -> list[tuple[str, str, dict[str, float]]]:
        """(stream id, source, values) records after `after`."""
        entries = await self.redis.xrange(self.key("metrics"), f"({after}" if after != "0-0" else "-", "+", count=count)
        return [(_s(i), _s(f[b"source"]), msgpack.unpackb(f[b"data"], raw=False)) for i, f in entries]


async def _delete_keys(client: aioredis.Redis, pattern: str) -> int:
    deleted = 0
    async for key in client.scan_iter(match=pattern, count=1000):
        deleted += await client.delete(key)
    return deleted


def store_call(url: str, run: str, op: Callable[[Store], Awaitable[T]], retry_s: float = REGISTRY_RETRY_S) -> T:
    """`op(store)` from synchronous code, on a Store opened for the call and closed after it: the one-off
    calls components make as they start, stop or report (retrying for `retry_s`)."""
    async def call() -> T:
        store = Store.connect(url, run, retry_s=retry_s)
        try:
            return await op(store)
        finally:
            await store.close()
    return run_sync(call())
