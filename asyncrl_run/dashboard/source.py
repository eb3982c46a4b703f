"""Where the dashboard reads a run: its Redis while it runs, a replay of its Redis data once it has ended.

The run is found as `asyncrl watch` finds it (asyncrl_run/watch.py `resolve`, `find_run`: <run_dir>/redis.url,
the run dir's name or the one run in that Redis), and its `metrics` stream and `services` hash are folded
by the same RunView. When the run's Redis stops answering (the run ended, its embedded Redis with it) and
the run dir keeps its Redis data, a private redis-server is started on a copy of that data
(asyncrl_run/redis_server.py `replay_copy`) and the dashboard goes on from there, read-only as before. A read
that meets the closed connection first (the run ended since the last refresh) switches over at once and is
answered from the replay (`RunSource.read`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from asyncrl.store import Store
from asyncrl_run.redis_server import has_redis_data, replay_copy
from asyncrl_run.watch import NotStarted, RunView, Target, find_run, refresh
from orchestrator.run_record import envs_of

log = logging.getLogger("asyncrl_run.dashboard")

COMMAND_TIMEOUT_S = 10.0
PER_ENV = ("env/", "filter_failed/")
"""Trainer record keys the curves leave out (per env and per failure reason: the page draws the run's whole)."""
LIVE_RECHECK_S = 30.0
"""While replaying a finished run's data, how often the run's own Redis is asked whether it is back."""
REFRESH_MIN_S = 1.0
"""Requests within this long of the last read of the stream share it (several tabs, several panels)."""

T = TypeVar("T")


class Unreadable(Exception):
    """The run's data cannot be read now; the message says why (the API answers 503 with it)."""


class RunSource:
    """The run's Store and its folded RunView, refreshed on demand (at most every REFRESH_MIN_S).

    `state`: `waiting` (nothing of the run in its Redis yet), `live`, `replayed` (a finished run, from a
    copy of its Redis data; back to `live` when the run's own Redis answers again, e.g. the run resumed)
    or `unreachable` (no Redis, no data to replay; `error` says why)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.store: Optional[Store] = None
        self.run: Optional[str] = target.run
        self.view = RunView()
        self.state = "waiting"
        self.error: Optional[str] = None
        self._refreshed_at = 0.0
        self._lock = asyncio.Lock()
        self._replay = ExitStack()
        self._live_checked_at = time.monotonic()

    @property
    def data_dir(self) -> Optional[Path]:
        return self.target.run_dir / "redis" if self.target.run_dir is not None else None

    async def refresh(self, force: bool = False) -> RunView:
        async with self._lock:
            if force or time.monotonic() - self._refreshed_at >= REFRESH_MIN_S:
                await self._refresh()
                self._refreshed_at = time.monotonic()
        return self.view

    async def _refresh(self) -> None:
        try:
            if self.state == "replayed" and time.monotonic() - self._live_checked_at >= LIVE_RECHECK_S:
                await self._back_to_live()
            if self.store is None:
                await self._connect()
            if self.store is None:
                return
            if self.run is None:
                self.store.run = self.run = await find_run(self.store, self.target.run, self.target.run_dir)
            await refresh(self.store, self.view)
            self.state = "replayed" if self.state == "replayed" else "live"
            self.error = None
        except NotStarted:
            self.state, self.error = "waiting", None
        except RedisConnectionError as err:
            await self._lost(err)
        except RedisError as err:  # a stalled server: keep what was read, say so
            self.error = f"the run's Redis failed: {err}"

    async def _connect(self) -> None:
        url = self.target.redis_url
        if url is None:
            return await self._start_replay("the run dir names no Redis")
        store = Store.connect(url, self.run or "", command_timeout_s=COMMAND_TIMEOUT_S)
        try:
            await store.redis.ping()
        except RedisError as err:
            await store.close()
            return await self._lost(err)
        self.store = store

    async def _lost(self, err: BaseException) -> None:
        """The live Redis is gone: replay the run dir's data if it has some, else report it."""
        if self.store is not None:
            await self.store.close()
            self.store = None
        if self.state == "replayed" or not has_redis_data(self.data_dir):
            self.state = "unreachable"
            self.error = f"cannot reach the run's Redis at {self.target.redis_url} ({err})"
            return
        await self._start_replay(f"its Redis at {self.target.redis_url} is gone")

    async def _start_replay(self, why: str) -> None:
        if not has_redis_data(self.data_dir):
            self.state, self.error = "unreachable", f"{why} and {self.data_dir} holds no Redis data"
            return
        log.info("%s: replaying the run's Redis data in %s", why, self.data_dir)
        server = await asyncio.to_thread(self._replay.enter_context, replay_copy(self.data_dir))
        self.store = Store.connect(server.url, self.run or "", command_timeout_s=60)
        self.state, self.error = "replayed", None
        self.view = RunView()  # read the whole stream again from the copy
        if self.run is None:
            self.store.run = self.run = await find_run(self.store, self.target.run, self.target.run_dir)
        await refresh(self.store, self.view)

    async def _back_to_live(self) -> None:
        """While replaying: the run's own Redis answers again (a resumed run, a Redis that was down a while):
        read it instead of the copy."""
        self._live_checked_at = time.monotonic()
        if self.target.redis_url is None:
            return
        store = Store.connect(self.target.redis_url, self.run or "", command_timeout_s=COMMAND_TIMEOUT_S)
        try:
            await store.redis.ping()
            if self.run is not None and not await store.redis.exists(store.key("metrics"), store.key("services")):
                raise NotStarted()
        except (RedisError, NotStarted):
            await store.close()
            return
        log.info("the run's Redis at %s answers again: reading it instead of the replay", self.target.redis_url)
        await self.store.close()
        await asyncio.to_thread(self._replay.close)
        self.store, self.state, self.view = store, "live", RunView()

    async def read(self, what: Callable[[Store], Awaitable[T]]) -> T:
        """`what(store)` on the run's data. A run that ends between the last refresh and this read takes its
        Redis with it: a refresh now finds it gone and moves to the replay of its data (or finds a dropped
        connection back), and `what` runs once more there, so a page open as the run ends goes on without
        an error."""
        try:
            return await what(await self._readable_store())
        except RedisConnectionError:
            await self.refresh(force=True)
        except RedisError as err:
            raise self._failed(err) from err
        try:
            return await what(await self._readable_store())
        except RedisError as err:
            raise self._failed(err) from err

    async def _readable_store(self) -> Store:
        """The store, once the run is found (Unreadable while waiting or unreachable)."""
        await self.refresh()
        if self.store is None or self.run is None or self.state not in ("live", "replayed"):
            raise Unreadable(f"the run's data is not readable now ({self.state}"
                             f"{': ' + self.error if self.error else ''})")
        return self.store

    def _failed(self, err: RedisError) -> Unreadable:
        """A stalled or lost server: the overview says so too."""
        self.error = f"the run's Redis failed: {err}"
        return Unreadable(self.error)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        await asyncio.to_thread(self._replay.close)

    def overview(self) -> dict[str, Any]:
        v = self.view
        return {
            "run": self.run or (self.target.run_dir.name if self.target.run_dir else None), "state": self.state,
            "error": self.error, "mode": v.mode, "step": v.step, "total_steps": v.total_steps,
            "finished": v.finished, "elapsed_s": v.elapsed_s(), "eta_s": None if v.finished else v.eta_s(),
            "weights": v.weights, "pause_reasons": v.pause_reasons(), "stall": v.stall(), "services": v.services,
            "trainer": v.trainer, "rollout": {k: val for k, val in v.orchestrator.items() if "/" not in k},
            "run_dir": str(self.target.run_dir) if self.target.run_dir else None,
            "envs": sorted(envs_of(v.orchestrator)),
        }

    def curves(self, after: int) -> dict[str, Any]:
        """Trainer records from index `after` of the run's history (the page asks for what it lacks)."""
        v = self.view
        reset = after > len(v.history)  # the history was read again (a replay began): send it all
        start = v.started_at or (v.history[0]["at"] if v.history else 0.0)
        records = [{k: x for k, x in r.items() if not k.startswith(PER_ENV)} for r in v.history[0 if reset else after:]]
        return {"trainer": records, "next": len(v.history), "reset": reset,
                "started_at": start,
                "rollout_rate": [[at - start, rate] for at, rate in v.rollout_rate[-2000:]]}
