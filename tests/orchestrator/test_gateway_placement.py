"""Session placement over two real TITO gateways (one CPU engine behind both): a group's members open their
sessions at once, and they must still spread over the gateways; a gateway that does not answer is passed
over while the other takes every new session."""

import asyncio

import aiohttp
import httpx
import pytest

from asyncrl.config import OrchestratorConfig
from orchestrator.groups import Group
from orchestrator.sessions import GatewaySessions
from tests.services import ServiceProcess


@pytest.fixture
def two_gateways(tiny_checkpoint, tmp_path, redis_server, run_name):
    pytest.importorskip("gateway.server", reason="the gateway component is not in this tree")
    from tests.rollout.conftest import start_engine

    engine = start_engine(tiny_checkpoint, tmp_path, name="engine")
    gateways = [ServiceProcess("gateway.server", ["--engine", engine.url, "--redis-url", redis_server.url,
                                                  "--run", run_name], tmp_path, name=f"gateway-{i}")
                for i in range(2)]
    yield gateways
    for proc in gateways:
        proc.stop()
    assert engine.stop() == 0, engine.log()


def sessions_created(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return int(sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("asyncrl_gateway_sessions_created_total")))


async def open_groups(sessions: GatewaySessions, ordinals: range, group_size: int) -> list[str]:
    """Every member of the groups opens its session at once, as the orchestrator dispatches a new group."""
    groups = [Group.new("timed", "t0", ordinal, group_size, seed=0) for ordinal in ordinals]
    opened = await asyncio.gather(*(sessions.open(g, m, g.episode_id(m)) for g in groups for m in g.members))
    assert all(endpoint.sampling is None for _, endpoint in opened)  # the session's defaults carry the sampling
    return [session_id for session_id, _ in opened]


async def test_a_groups_concurrent_sessions_spread_over_the_gateways(two_gateways, run_name):
    urls = [g.url for g in two_gateways]
    cfg = OrchestratorConfig(gateway_url=",".join(urls), run_name=run_name)
    async with aiohttp.ClientSession() as http:
        sessions = GatewaySessions(cfg, http)
        opened = await open_groups(sessions, range(2), group_size=8)
        assert [sessions_created(url) for url in urls] == [8, 8]
        assert sessions.open_sessions == dict.fromkeys(urls, 8)

        for session_id in opened[:8]:  # the first group ends: its sessions were spread too, so both drop by 4
            assert (await sessions.finish(session_id, "aborted")).status == "aborted"
        assert sessions.open_sessions == dict.fromkeys(urls, 4)

        two_gateways[1].kill()
        opened += await open_groups(sessions, range(2, 3), group_size=8)
        assert [sessions_created(urls[0])] == [16]  # the dead one is passed over, nothing waits for it
        assert sessions.open_sessions == {urls[0]: 12, urls[1]: 4}
