"""Stopping the orchestrator while episodes are settling: the settle stops with it, its state stays in Redis
for the next start, and nothing is counted as a failure (it was, once per settling episode, at every stop)."""

import asyncio

from asyncrl.config import OrchestratorConfig
from asyncrl.protocols.env_service import EpisodeReason, EpisodeResponse, EpisodeStatus
from asyncrl.protocols.orchestrator import RegisterRequest
from asyncrl.store import Store
from orchestrator.core import Orchestrator
from orchestrator.envclient import Outcome
from orchestrator.groups import MemberState, TaskOrder


async def test_a_stop_while_episodes_settle_fails_none_of_them(redis_server, run_name):
    cfg = OrchestratorConfig(sessions="endpoint", llm_url="http://127.0.0.1:9/v1", group_size=2,
                             max_unconsumed_groups=0, max_groups=1)
    store = Store.connect(redis_server.url, run_name)
    orch = Orchestrator(cfg, store)
    settling, closed = asyncio.Event(), asyncio.Event()

    async def play(group, member, service, episode_id):  # the env service answered: a model outcome
        return Outcome("result", EpisodeResponse(episode_id=episode_id, task_id=group.task_id, reward=1.0,
                                                 status=EpisodeStatus.completed, reason=EpisodeReason.completed,
                                                 num_turns=1))

    async def record(group, member, response):  # as the gateway's finish does when the client closes under it
        settling.set()
        await closed.wait()
        raise RuntimeError("Session is closed")

    close_sessions = orch.sessions.close

    async def close():
        closed.set()
        await close_sessions()

    orch._play, orch._record, orch.sessions.close = play, record, close
    orch.awaited_envs = []
    dispatch = asyncio.create_task(orch.dispatch_forever())
    try:
        await orch.register(RegisterRequest(name="env", url="http://127.0.0.1:9", capacity=2, heartbeat="probe"))
        orch.scheduler.queue("env").tasks = TaskOrder("env", ["t-1"], cfg.seed)  # what the health monitor lists
        orch.wake()
        await asyncio.wait_for(settling.wait(), 10)
        assert orch.settling == 2
    finally:
        dispatch.cancel()
        await asyncio.gather(dispatch, return_exceptions=True)
        await orch.close()
    await asyncio.sleep(0.1)  # a settle left running would fail now, and requeue its member as a retry
    (group,) = orch.groups.values()
    assert orch.counters.retried == 0 and orch.settling == 0
    assert all(m.state is MemberState.running and m.attempt == 1 for m in group.members)
    await store.close()
