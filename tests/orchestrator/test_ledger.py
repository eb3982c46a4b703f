"""The ledger's batches against a real redis-server whose replies can be lost on the way back.

A batch whose MULTI/EXEC Redis applied but whose reply never arrived (connection reset, a hung server
timed out) is retried; the retry must not append the group's record a second time.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

from asyncrl.store import Store
from asyncrl.types import GroupRecord
from orchestrator.groups import Group, MemberState
from orchestrator.ledger import Ledger

EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class ReplyCuttingProxy:
    """A loopback TCP relay to Redis. Once armed, it forwards the next EXEC, lets Redis run it, and closes
    the client's connection before the reply: the transaction is applied, the client sees a reset."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.armed = False
        self.cuts = 0
        self.server: asyncio.Server
        self.relays: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.relays.add(asyncio.current_task())
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def replies() -> None:
            while data := await up_r.read(1 << 16):
                client_w.write(data)
                await client_w.drain()

        back = asyncio.create_task(replies())
        tail = b""
        try:
            while data := await client_r.read(1 << 16):
                if self.armed and EXEC in tail + data:
                    self.armed, self.cuts = False, self.cuts + 1
                    back.cancel()
                    up_w.write(data)
                    await up_w.drain()
                    await asyncio.sleep(0.2)  # Redis runs the transaction; its reply goes nowhere
                    break
                up_w.write(data)
                await up_w.drain()
                tail = data[-len(EXEC):]
        finally:
            back.cancel()
            for writer in (client_w, up_w):
                writer.close()

    @classmethod
    @asynccontextmanager
    async def serving(cls, upstream_port: int) -> AsyncIterator["ReplyCuttingProxy"]:
        proxy = cls(upstream_port)
        proxy.server = await asyncio.start_server(proxy._relay, "127.0.0.1", 0)
        try:
            yield proxy
        finally:
            proxy.server.close()
            for relay in proxy.relays:
                relay.cancel()
            await asyncio.gather(*proxy.relays, return_exceptions=True)


def finished_group(ordinal: int) -> Group:
    group = Group.new("arith", f"t-{ordinal}", ordinal, group_size=2, seed=0)
    for member in group.members:
        member.state, member.reward, member.sample_refs = MemberState.done, 1.0, [f"{ordinal}-{member.index}"]
    return group


async def test_a_batch_applied_whose_reply_is_lost_appends_its_groups_once(redis_server, run_name):
    async with ReplyCuttingProxy.serving(redis_server.port) as proxy:
        store = Store.connect(proxy.url, run_name)
        ledger = Ledger(store, lambda: {"ordinal": 3})
        writer = asyncio.create_task(ledger.write_forever())
        try:
            ledger.complete(finished_group(0))
            async with asyncio.timeout(10):
                await ledger.sync()
            proxy.armed = True
            ledger.complete(finished_group(1))
            ledger.touch(Group.new("arith", "t-2", 2, group_size=2, seed=0))
            async with asyncio.timeout(10):
                await ledger.sync()
            assert proxy.cuts == 1
            entries = await store.redis.xrange(store.key("groups"))
            assert [GroupRecord.decode(fields).group_id for _, fields in entries] == \
                [finished_group(0).group_id, finished_group(1).group_id]
            snapshot = await ledger.load()  # the rest of the batch is there, once
            assert [g.group_id for g in snapshot.groups] == [Group.new("arith", "t-2", 2, 2, 0).group_id]
            assert snapshot.meta == {"ordinal": "3"}
        finally:
            writer.cancel()
            await store.close()
