"""The gateway's periodic /health rounds over its engines (gateway/engines.py), against real HTTP servers."""

import asyncio

from aiohttp import web

from gateway.engines import EnginePool


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
