"""The only engine lost mid-turn: the turn waits (gateway.engine_wait_s) for an engine to come back, at its
old URL or at a new one from the engine registry (as a restarted engine actor re-registers), and finishes
there with the session's recorded tokens kept; with no engine within the wait, a 503 naming it."""

import asyncio
import time

import pytest

from asyncrl.store import Store
from tests.gateway.checks import assert_ledger_consistent, assert_teacher_forced
from tests.gateway.conftest import GatewayClient, start_gateway
from tests.gateway.test_failover import FAILOVER, token_turn
from tests.rollout.conftest import start_engine
from tests.services import free_port

RESTART_S = 3.0
"""How long the engine stays down: longer than the old ~0.6 s of failover rounds, shorter than the wait."""


@pytest.mark.parametrize("where", ["same_url", "new_url"])
async def test_the_only_engine_killed_mid_turn_is_waited_for(where, tiny_checkpoint, redis_server, reference_model,
                                                           tmp_path):
    run = f"engine-loss-{where}"
    port = free_port()
    engine = start_engine(tiny_checkpoint, tmp_path, name="engine-first", port=port)
    store = Store.connect(redis_server.url, run)
    await store.register_engine("engine-0", engine.url)
    gateway = start_gateway(tmp_path, [], redis_server.url, run, "--engines-from-redis", name="gateway-loss")
    client = GatewayClient(gateway.url)
    restarted = None
    try:
        sid = (await client.create(sampling={"sampling_seed": 5}))["session_id"]
        await token_turn(client, sid, [1006, 1008, 1011, 72, 1012, 1014], {"max_new_tokens": 6})
        turn = asyncio.create_task(token_turn(client, sid, [1011, 72, 105, 1012, 1014], FAILOVER))
        await asyncio.sleep(0.5)  # the long turn is decoding on the only engine
        engine.kill()
        await asyncio.sleep(RESTART_S)
        assert not turn.done()  # held open, not a 503
        restarted = start_engine(tiny_checkpoint, tmp_path, name="engine-restarted",
                                 port=port if where == "same_url" else 0)
        await store.register_engine("engine-0", restarted.url)
        out = await asyncio.wait_for(turn, 120)
        assert len(out["output_ids"]) == FAILOVER["max_new_tokens"] and out["meta_info"]["engines"] == [restarted.url]
        [segment] = (await client.record(sid))["segments"]
        assert [t["engine"] for t in segment["turns"]] == [engine.url, restarted.url]
        assert_ledger_consistent(segment)  # the first turn's tokens are kept; the second extends them
        assert_teacher_forced(reference_model, segment)
        metrics = (await client.http.get("/metrics")).text
        assert f'asyncrl_gateway_engine_errors_total{{engine="{engine.url}"}} 1.0' in metrics
        [sample] = await store.get_samples((await client.finish(sid, reward=1.0))["sample_refs"])
        assert sample.num_turns == 2  # the failed engine call is no turn of its own
    finally:
        await client.close()
        await store.close()
        assert gateway.stop() == 0, gateway.log()
        engine.stop()
        if restarted is not None:
            restarted.stop()


async def test_no_engine_within_the_wait_is_a_503_naming_it(redis_server, gateway_run, tmp_path):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gateway = start_gateway(tmp_path, [], redis_server.url, gateway_run, "--engine", gone, "--engine-wait-s", "2",
                            name="gateway-no-engine")
    client = GatewayClient(gateway.url)
    try:
        sid = (await client.create())["session_id"]
        started = time.monotonic()
        r = await client.http.post(f"/sessions/{sid}/generate", json={"input_ids": [1006, 1008]})
        assert r.status_code == 503 and "engine_wait_s" in r.json()["error"] and "2 s" in r.json()["error"], r.text
        assert 2.0 <= time.monotonic() - started < 30
        assert (await client.record(sid))["segments"] == []  # nothing committed: the client may retry
    finally:
        await client.close()
        assert gateway.stop() == 0, gateway.log()


def test_the_launcher_passes_the_engine_wait_to_the_gateway(tmp_path):
    from hydra import compose, initialize_config_dir

    from asyncrl.config import GatewayConfig, register_configs, to_dataclass
    from asyncrl_run.launcher import gateway_section, write_config
    from gateway.server import parse_args
    from tests.services import ROOT

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        run = to_dataclass(compose("config", overrides=["experiment=tiny_demo", "gateway.engine_wait_s=45.5",
                                                        "gateway.max_interruptions=3"]))
    cfg, _ = parse_args(write_config(tmp_path, "gateway", gateway_section(run, "redis://127.0.0.1:1",
                                                                          ["http://127.0.0.1:2"])))
    assert (cfg.engine_wait_s, cfg.max_interruptions, cfg.engine_urls) == (45.5, 3, ["http://127.0.0.1:2"])
    assert GatewayConfig.engine_wait_s > 11  # the default outlasts an engine restart (~11 s on CPU)
