"""The gateway's periodic /health rounds over its engines (gateway/engines.py), against real HTTP servers."""

import asyncio
import re
import time

import httpx
from aiohttp import web

from gateway.engines import EnginePool
from tests.gateway.conftest import start_gateway
from tests.services import ServiceProcess


async def ok(_: web.Request) -> web.Response:
    return web.Response()


async def health_server(handler=ok) -> tuple[web.AppRunner, str]:
    """A server answering GET /health and GET /{engine}/health (many engine URLs on one port)."""
    app = web.Application()
    app.router.add_get("/health", handler)
    app.router.add_get("/{engine}/health", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, "http://127.0.0.1:%d" % runner.addresses[0][1]


async def test_a_health_round_does_not_revive_an_engine_that_failed_after_its_check():
    """A round's results applied at its end (all checks gathered) turned an engine a turn had just found
    dead back to healthy from a check answered before it died: the next turns were routed to it and
    failed over again (seen in bench/control_plane_scale.py when the victim engine was killed)."""
    servers = [await health_server() for _ in range(2)]
    first, second = (url for _, url in servers)
    pool = EnginePool([first, second], timeout_s=5.0, load_factor=1.25, health_interval_s=1.0)
    try:
        health_round = asyncio.create_task(pool.check_health(spread_s=0.8))  # first now, second 0.4 s later
        await asyncio.sleep(0.2)
        pool.mark_failed(pool.engines[first], "ConnectError: a turn's call failed after the check")
        await health_round
        assert not pool.engines[first].healthy
        assert pool.engines[second].healthy
    finally:
        await pool.close()
        for runner, _ in servers:
            await runner.cleanup()


async def test_health_checks_start_one_at_a_time_over_the_spread():
    """64 checks started at once held the event loop ~35 ms every round; spread, they start `spread / n` apart."""
    started: list[float] = []
    loop = asyncio.get_running_loop()

    async def health(_: web.Request) -> web.Response:
        started.append(loop.time())
        return web.Response()

    runner, url = await health_server(health)
    urls = [f"{url}/e{i}" for i in range(8)]
    pool = EnginePool(urls, timeout_s=5.0, load_factor=1.25, health_interval_s=1.0)
    try:
        await pool.check_health(spread_s=0.8)
        gaps = [b - a for a, b in zip(started, started[1:])]
        assert len(started) == 8 and min(gaps) > 0.05, gaps
        assert all(engine.healthy for engine in pool.engines.values())
    finally:
        await pool.close()
        await runner.cleanup()


async def test_an_engine_that_answered_a_call_within_the_interval_is_not_probed():
    """Passive health: under load every engine answers calls every interval, and a /health probe of each on top
    cost the gateway's event loop as much as a third of its engine requests. An answer within the interval is
    the check; a quiet engine, or one marked unhealthy, is probed as before."""
    probes: list[str] = []

    async def health(request: web.Request) -> web.Response:
        probes.append(request.match_info["engine"])
        return web.Response()

    runner, url = await health_server(health)
    busy, quiet, failed = (f"{url}/{name}" for name in ("busy", "quiet", "failed"))
    pool = EnginePool([busy, quiet, failed], timeout_s=5.0, load_factor=1.25, health_interval_s=0.5)
    try:
        pool.mark_answered(pool.engines[busy])
        pool.mark_answered(pool.engines[failed])
        pool.mark_failed(pool.engines[failed], "ReadError: its last call failed after it had answered one")
        await pool.check_health()
        assert sorted(probes) == ["failed", "quiet"]
        assert pool.engines[failed].healthy  # the probe answered: healthy again
        await asyncio.sleep(0.5)  # every answer is older than an interval now
        probes.clear()
        await pool.check_health()
        assert sorted(probes) == ["busy", "failed", "quiet"]
    finally:
        await pool.close()
        await runner.cleanup()


def test_a_gateway_under_load_does_not_probe_its_engine(redis_server, run_name, tmp_path):
    """End to end: the gateway's turns mark their engine answered, so while turns run back to back (each
    0.2 s) for ~3 s with a health interval of 0.5 s, the stand-in engine sees no /health probe beyond the
    first round (~6 without passive health); once the turns stop, the probes come back."""
    engine = ServiceProcess("bench.standin_engine", ["--ttft-s", "0.2", "--decode-s-per-token", "0"], tmp_path,
                            name="standin")
    gateway = start_gateway(tmp_path, [engine], redis_server.url, run_name)  # --health-interval-s 0.5

    def probes() -> int:
        text = httpx.get(f"{engine.url}/metrics").text
        return int(re.search(r"^standin_health_checks_total (\d+)$", text, re.M).group(1))

    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            sid = http.post("/sessions", json={}).json()["session_id"]
            messages = [{"role": "user", "content": "hi"}]
            http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
            before, ends = probes(), time.monotonic() + 3.0
            while time.monotonic() < ends:
                reply = http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
                assert reply.status_code == 200, reply.text
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
            under_load = probes() - before
            time.sleep(1.5)
            idle = probes() - before - under_load
    finally:
        gateway.stop()
        engine.stop()
    assert under_load <= 1, under_load
    assert idle >= 2, idle
