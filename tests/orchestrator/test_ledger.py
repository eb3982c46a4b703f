"""The ledger's batches against a real redis-server whose replies can be lost on the way back, or whose
AOF loses its last writes.

A batch whose MULTI/EXEC Redis applied but whose reply never arrived (connection reset, a hung server
timed out) is retried; the retry must not append the group's record a second time. A restart that lost
batches Redis had acknowledged is counted: how many group records went with them.
"""

from __future__ import annotations

import asyncio

from asyncrl.store import Store
from asyncrl.types import GroupRecord
from asyncrl_run.redis_server import EmbeddedRedis
from orchestrator.groups import Group, MemberState
from orchestrator.ledger import Ledger
from tests.redis_faults import AofTail, ReplyCuttingProxy


def finished_group(ordinal: int) -> Group:
    group = Group.new("arith", f"t-{ordinal}", ordinal, group_size=2, seed=0)
    for member in group.members:
        member.state, member.reward, member.sample_refs = MemberState.done, 1.0, [f"{ordinal}-{member.index}"]
    return group


async def test_a_batch_applied_whose_reply_is_lost_appends_its_groups_once(redis_server, run_name):
    async with ReplyCuttingProxy.serving(redis_server.port, b"EXEC") as proxy:
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
            assert snapshot.meta == {"ordinal": "3", "records": "2", "records_lost": "0"}
        finally:
            writer.cancel()
            await store.close()


async def test_group_records_a_redis_restart_lost_are_counted(tmp_path, run_name):
    server = EmbeddedRedis(tmp_path / "redis").start()
    aof = AofTail(server, tmp_path)
    store = Store.connect(server.url, run_name)
    ledger = Ledger(store, lambda: {"ordinal": 9})
    writer = asyncio.create_task(ledger.write_forever())

    async def complete(*ordinals: int) -> None:
        for ordinal in ordinals:
            ledger.complete(finished_group(ordinal))
        async with asyncio.timeout(30):
            await ledger.sync()

    try:
        await complete(0)
        aof.mark()
        await complete(1, 2)
        await complete(3)  # three records in two batches after the mark
        aof.lose()
        await complete(4)
        assert ledger.records_lost == 3
        entries = await store.redis.xrange(store.key("groups"))
        assert [GroupRecord.decode(f).group_id for _, f in entries] == [finished_group(i).group_id for i in (0, 4)]
        assert (await ledger.load()).meta == {"ordinal": "9", "records": "5", "records_lost": "3"}
        await complete(5)  # counted once
        assert ledger.records_lost == 3
    finally:
        writer.cancel()
        await store.close()
        server.stop()
