"""Engine failure, client disconnects, finish/abort semantics, over real processes."""

import asyncio

import httpx
import pytest

from tests.gateway.checks import assert_ledger_consistent, assert_teacher_forced
from tests.gateway.conftest import GatewayClient, start_gateway
from tests.rollout.conftest import start_engine

LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}
"""Seconds of decoding on a tiny engine: long enough to kill or cut mid-way."""
FAILOVER = {**LONG, "max_new_tokens": 480}
"""A turn that still decodes 0.5 s in (~1.6 s on an idle machine), so a kill or a pause lands mid-turn."""


@pytest.fixture(scope="module")
def spare_engine(tiny_checkpoint, tmp_path_factory):
    """A second engine with the same weights as random_engine; the tests kill it."""
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("engine-spare"), name="engine-spare")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pair_gateway(random_engine, spare_engine, redis_server, gateway_run, tmp_path_factory):
    proc = start_gateway(tmp_path_factory.mktemp("gw-pair"), [random_engine, spare_engine], redis_server.url,
                         gateway_run, name="gateway-pair")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def pair(pair_gateway):
    c = GatewayClient(pair_gateway.url)
    yield c
    await c.close()


async def token_turn(client: GatewayClient, sid: str, input_ids: list[int], params: dict) -> dict:
    r = await client.http.post(f"/sessions/{sid}/generate", json={"input_ids": input_ids, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


async def session_homed_on(client: GatewayClient, engine_url: str) -> str:
    """A session whose first turn the ring sends to `engine_url` (session ids are random)."""
    for _ in range(40):
        sid = (await client.create(sampling={"sampling_seed": 3}))["session_id"]
        await token_turn(client, sid, [1006, 1008, 1011, 72, 1012, 1014], {"max_new_tokens": 4})
        if (await client.record(sid))["segments"][0]["turns"][0]["engine"] == engine_url:
            return sid
    raise AssertionError(f"no session landed on {engine_url}")


async def test_killing_an_engine_mid_turn_loses_nothing(pair, pair_gateway, random_engine, spare_engine,
                                                        reference_model, store):
    sid = await session_homed_on(pair, spare_engine.url)
    turn = asyncio.create_task(token_turn(pair, sid, [1011, 72, 105, 1012, 1014], FAILOVER))
    await asyncio.sleep(0.5)  # the long turn is decoding on the spare engine
    spare_engine.kill()
    out = await turn
    assert len(out["output_ids"]) == FAILOVER["max_new_tokens"] and out["meta_info"]["engines"] == [random_engine.url]
    await token_turn(pair, sid, [1011, 66, 1012, 1014], {"max_new_tokens": 6})
    [segment] = (await pair.record(sid))["segments"]
    assert [t["engine"] for t in segment["turns"]] == [spare_engine.url, random_engine.url, random_engine.url]
    assert_ledger_consistent(segment)
    assert_teacher_forced(reference_model, segment)
    engines = (await pair.http.get("/engines")).json()["engines"]
    assert {e["url"]: e["healthy"] for e in engines} == {random_engine.url: True, spare_engine.url: False}
    finished = await pair.finish(sid, reward=1.0)
    [sample] = await store.get_samples(finished["sample_refs"])
    assert sample.engines == [spare_engine.url, random_engine.url] and sample.num_turns == 3
    metrics = (await pair.http.get("/metrics")).text
    assert f'asyncrl_gateway_engine_errors_total{{engine="{spare_engine.url}"}} 1.0' in metrics


async def test_engine_set_is_replaceable_at_runtime(pair, random_engine, spare_engine):
    try:
        r = await pair.http.post("/engines", json={"urls": [random_engine.url]})
        assert [e["url"] for e in r.json()["engines"]] == [random_engine.url]
        r = await pair.http.post("/engines", json={"urls": "nope"})
        assert r.status_code == 400 and "urls" in r.json()["error"]
    finally:
        await pair.http.post("/engines", json={"urls": [random_engine.url, spare_engine.url]})


async def test_client_disconnect_aborts_the_engine_request(pair, random_engine):
    sid = (await pair.create())["session_id"]
    with pytest.raises(httpx.ReadTimeout):
        await pair.http.post(f"/sessions/{sid}/generate", json={"input_ids": [1006, 1008], "sampling_params": LONG},
                             timeout=1.0)
    async with httpx.AsyncClient(base_url=random_engine.url) as engine:
        for _ in range(50):
            loads = (await engine.get("/v1/loads")).json()["loads"][0]
            if loads["num_running_reqs"] + loads["num_waiting_reqs"] == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"engine still busy after the client left: {loads}")
    assert (await pair.record(sid))["segments"] == []  # the turn was not committed
    assert "asyncrl_gateway_client_disconnects_total 1.0" in (await pair.http.get("/metrics")).text


async def test_finish_is_idempotent_and_abort_records_nothing(pair, store):
    sid = (await pair.create(group_id="g-idem"))["session_id"]
    await token_turn(pair, sid, [1006, 1008, 1011, 72, 1012, 1014], {"max_new_tokens": 4})
    before = await store.redis.xlen(store.key("samples"))
    replies = await asyncio.gather(*(pair.finish(sid, reward=float(i)) for i in range(3)))
    assert replies[0] == replies[1] == replies[2] and len(replies[0]["sample_refs"]) == 1
    assert await store.redis.xlen(store.key("samples")) == before + 1
    [sample] = await store.get_samples(replies[0]["sample_refs"])
    assert sample.reward in (0.0, 1.0, 2.0) and sample.status == "completed"  # whichever finish came first

    running = (await pair.create())["session_id"]
    turn = asyncio.create_task(pair.http.post(f"/sessions/{running}/generate",
                                              json={"input_ids": [1006, 1008], "sampling_params": LONG}))
    await asyncio.sleep(0.5)
    deleted = (await pair.http.delete(f"/sessions/{running}")).json()
    assert deleted == {"session_id": running, "status": "aborted", "sample_refs": []}
    assert (await turn).status_code == 409  # the in-flight turn was aborted, not recorded
    assert (await pair.finish(running, reward=1.0))["status"] == "aborted"
    assert await store.redis.xlen(store.key("samples")) == before + 1


async def test_engine_abort_mid_turn_is_continued_with_its_tokens_kept(random_client, random_engine, reference_model):
    """pause_generation(abort), as a weight update does: the engine ends the call early; the gateway
    keeps the tokens it produced and continues the turn once the engine resumes."""
    sid = (await random_client.create())["session_id"]
    turn = asyncio.create_task(token_turn(random_client, sid, [1006, 1008, 1011, 72, 1012, 1014], FAILOVER))
    async with httpx.AsyncClient(base_url=random_engine.url, timeout=30) as engine:
        await asyncio.sleep(0.5)
        assert (await engine.post("/pause_generation", json={"mode": "abort"})).status_code == 200
        await asyncio.sleep(0.5)
        assert (await engine.post("/continue_generation", json={})).status_code == 200
    out = await turn
    assert len(out["output_ids"]) == FAILOVER["max_new_tokens"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    [segment] = (await random_client.record(sid))["segments"]
    calls = segment["turns"]
    assert len(calls) >= 2 and calls[0]["finish_reason"] == "abort" and calls[-1]["finish_reason"] == "length"
    assert sum(c["output_len"] for c in calls) == FAILOVER["max_new_tokens"]
    assert_ledger_consistent(segment)
    assert_teacher_forced(reference_model, segment)
