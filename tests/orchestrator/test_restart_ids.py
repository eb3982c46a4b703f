"""A restarted orchestrator never reuses an episode id the dead one sent.

The ledger writes behind dispatch (up to 50 ms), so a process killed right after dispatching leaves
Redis without those attempts; the next start rebuilds the same group (same ordinal, task and seeds) and
numbered its attempts the same: one id for two episodes (a CI run saw two completions of `...-a1`),
and a 409 `already running` from a service still running the first, counted as a failure."""

import asyncio

from asyncrl.config import OrchestratorConfig
from asyncrl.protocols.orchestrator import RegisterRequest
from asyncrl.store import Store
from orchestrator.core import Orchestrator
from orchestrator.envclient import Outcome
from orchestrator.groups import TaskOrder
from orchestrator.recovery import restore


async def dispatched_ids(redis_url: str, run_name: str) -> list[str]:
    """Start an orchestrator as Runtime does (load, restore), let it dispatch one group, and die before
    its ledger writes anything (no writer runs): the episode ids it sent."""
    cfg = OrchestratorConfig(sessions="endpoint", llm_url="http://127.0.0.1:9/v1", group_size=2,
                             max_unconsumed_groups=0, max_groups=1)
    store = Store.connect(redis_url, run_name)
    orch = Orchestrator(cfg, store)
    sent: list[str] = []
    both_sent = asyncio.Event()

    async def play(group, member, service, episode_id):  # the service runs it; the orchestrator dies meanwhile
        sent.append(episode_id)
        if len(sent) == cfg.group_size:
            both_sent.set()
        await asyncio.Event().wait()
        return Outcome("error")

    orch._play = play
    orch.awaited_envs = []
    await restore(orch, await orch.ledger.load())
    dispatch = asyncio.create_task(orch.dispatch_forever())
    try:
        await orch.register(RegisterRequest(name="env", url="http://127.0.0.1:9", capacity=2, heartbeat="probe"))
        orch.scheduler.queue("env").tasks = TaskOrder("env", ["t-1"], cfg.seed)
        orch.wake()
        await asyncio.wait_for(both_sent.wait(), 10)
    finally:
        dispatch.cancel()
        await asyncio.gather(dispatch, return_exceptions=True)
        await orch.close()
        await store.close()
    return sent


async def test_a_restart_dispatches_under_new_episode_ids(redis_server, run_name):
    dead = await dispatched_ids(redis_server.url, run_name)
    restarted = await dispatched_ids(redis_server.url, run_name)
    assert dead == ["g0000001-env-m0-a1", "g0000001-env-m1-a1"]
    assert restarted == ["g0000001-env-m0-a1-r2", "g0000001-env-m1-a1-r2"]  # the same group, played again
