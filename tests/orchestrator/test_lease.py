"""The run's orchestrator lease against a real redis-server, also when a reply is lost on the way back."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.store import Store
from orchestrator.lease import Lease
from tests.redis_faults import ReplyCuttingProxy


async def test_a_lease_taken_by_a_set_whose_reply_was_lost_is_held_at_once(redis_server, run_name):
    """Before, the SET's lost reply failed the start, and the restarted orchestrator waited out the lease
    its predecessor had in fact taken."""
    async with ReplyCuttingProxy.serving(redis_server.port, b"SET") as proxy:
        store = Store.connect(proxy.url, run_name)
        other_store = Store.connect(redis_server.url, run_name)
        try:
            lease = Lease(store, ttl_s=30)
            proxy.armed = True
            started = time.monotonic()
            async with asyncio.timeout(10):
                await lease.acquire()
            assert proxy.cuts == 1 and time.monotonic() - started < 5
            assert (await other_store.redis.get(lease.key)).decode() == lease.holder
            with pytest.raises(TimeoutError):  # a second orchestrator waits for it
                async with asyncio.timeout(1):
                    await Lease(other_store, ttl_s=30).acquire()
            await lease.release()
            async with asyncio.timeout(5):
                await Lease(other_store, ttl_s=30).acquire()
        finally:
            await store.close()
            await other_store.close()
