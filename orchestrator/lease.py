"""One orchestrator per run: a Redis lease (SET NX PX) renewed every ttl/3.

A second orchestrator on the same run waits until the lease expires (the first was SIGKILLed) or is
released (clean shutdown). An orchestrator that finds its lease taken stops dispatching.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid

from redis.exceptions import RedisError

from asyncrl.store import Store

log = logging.getLogger("orchestrator.lease")

RENEW = """local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not holder then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0"""
"""Extend our lease; if it expired (a stalled loop) and nobody took it, take it again."""
RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"""


class LeaseLost(RuntimeError):
    pass


class Lease:
    def __init__(self, store: Store, ttl_s: float) -> None:
        self.redis = store.redis
        self.key = store.key("orch:lease")
        self.ttl_ms = int(ttl_s * 1000)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    async def acquire(self) -> None:
        """Wait until this orchestrator holds the lease. Redis errors are retried; a SET that failed may
        still have been applied (its reply lost), so finding our own name there means we hold it."""
        waited, pause = False, min(1.0, self.ttl_ms / 4000)
        while True:
            try:
                if await self.redis.set(self.key, self.holder, nx=True, px=self.ttl_ms):
                    break
                owner = await self.redis.get(self.key)
            except (RedisError, OSError) as err:
                log.warning("taking lease %s failed (%r); retrying", self.key, err)
                await asyncio.sleep(pause)
                continue
            if owner is not None and owner.decode() == self.holder:
                break
            if not waited:
                log.warning("run is held by orchestrator %s; waiting for its lease to expire", owner)
                waited = True
            await asyncio.sleep(pause)
        log.info("lease %s acquired by %s", self.key, self.holder)

    async def keep(self) -> None:
        """Renew until cancelled; raises LeaseLost if another holder took it."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                renewed = await self.redis.eval(RENEW, 1, self.key, self.holder, self.ttl_ms)
            except (RedisError, OSError) as err:
                log.warning("renewing lease %s failed: %r", self.key, err)
                continue
            if not renewed:
                raise LeaseLost(f"lease {self.key} is no longer held by {self.holder}")

    async def release(self) -> None:
        await self.redis.eval(RELEASE, 1, self.key, self.holder)
