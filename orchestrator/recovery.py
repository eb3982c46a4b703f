"""A (re)started orchestrator picks up the run where the previous one left it.

From Redis (orchestrator/ledger.py): the registered services (presumed alive for one heartbeat
timeout), counters and task cursors, and every open group with its members' states:

- pending members queue again;
- running members belonged to attempts of the dead orchestrator, whose requests cannot be
  re-attached. Their session is finished as "aborted": if the previous orchestrator had already
  recorded it (it crashed between finishing the session and writing "done"), the gateway's
  idempotent finish returns that first reply and the member is done with those sample refs;
  otherwise nothing is recorded, the episode is cancelled at its service and queued again
  (a restart does not count as a failed attempt);
- groups that are complete are appended to the `groups` stream now (or filtered, with dynamic
  sampling: the same decision as for any group; a member recovered from the gateway's finish reply has
  no known reward, so its group is delivered).

Exactly once: a GroupRecord is appended exactly once (ledger transaction); an episode's result is
counted at most once (only the current attempt of a running member is settled; sessions of every
other attempt are aborted, so their trajectories never reach the trainer).
"""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator.core import Orchestrator
from orchestrator.counters import Counters
from orchestrator.groups import Group, Member, MemberState
from orchestrator.ledger import Snapshot

log = logging.getLogger("orchestrator.recovery")

CONCURRENT_RECOVERIES = 256


async def restore(orch: Orchestrator, snapshot: Snapshot) -> None:
    orch.incarnation = snapshot.incarnation
    counters = Counters.from_meta(snapshot.meta)
    orch.counters.retried, orch.counters.ordinal = counters.retried, counters.ordinal
    orch.counters.filter_streak = counters.filter_streak
    orch.ledger.filtered_unreported = int(snapshot.meta.get("filtered_unreported", 0))
    orch.ledger.records = int(snapshot.meta.get("records", 0))
    orch.ledger.records_lost = int(snapshot.meta.get("records_lost", 0))
    orch.counters.cursors.update(counters.cursors)
    orch.counters.by_env.update(counters.by_env)
    orch.counters.outcomes.update(counters.outcomes)
    for service in snapshot.services:
        orch.registry.restore(service)
        orch.scheduler.add_service(service, time.monotonic())
    running = []
    for group in snapshot.groups:
        orch.add_group(group)
        for member in group.members:
            if member.state is MemberState.pending:
                _requeue(orch, group, member)
            elif member.state is MemberState.running:
                running.append((group, member))
    limit = asyncio.Semaphore(CONCURRENT_RECOVERIES)
    await asyncio.gather(*(_recover(orch, group, member, limit) for group, member in running))
    for group in [g for g in orch.groups.values() if g.complete]:
        orch.complete_group(group)
    await orch.ledger.sync()
    log.info("restored %d services, %d open groups (%d episodes were running), %d groups done so far",
             len(snapshot.services), len(orch.groups), len(running), orch.counters.total("groups"))


async def _recover(orch: Orchestrator, group: Group, member: Member, limit: asyncio.Semaphore) -> None:
    async with limit:
        finished = await orch.sessions.finish(member.session_id, "aborted") if member.session_id else None
        if finished is not None and finished.status != "aborted":
            member.state, member.status, member.sample_refs = MemberState.done, finished.status, finished.sample_refs
            orch.counters.by_env[group.env]["completed"] += 1
            orch.ledger.touch(group)
            return
        service = orch.registry.get(member.service or "")
        if service is not None:
            await orch.envs.cancel(service.url, group.episode_id(member))
    orch.metrics.retries.labels(group.env, "restart").inc()
    orch.counters.retried += 1
    _requeue(orch, group, member)


def _requeue(orch: Orchestrator, group: Group, member: Member) -> None:
    member.state, member.session_id, member.ready_at = MemberState.pending, None, time.monotonic()
    orch.scheduler.queue(group.env).pending.append((group, member))
    orch.ledger.touch(group)
