"""Abort, pause (abort | retract | in_place), continue, weight updates (disk, tensor, gloo broadcast)
and retraction under memory pressure, against real engine processes."""

import asyncio

import httpx
import psutil
import pytest
import torch
import torch.distributed as dist

from asyncrl.engine_client import EngineClient, EngineError
from asyncrl.model.io import read_tensors
from tests.rollout.conftest import start_engine
from tests.services import free_port

PROMPT = [1006, 1008, 1011, 50, 60, 70, 1012]
LONG = {"max_new_tokens": 3000, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}


@pytest.fixture(scope="module")
def control_engine(tiny_checkpoint, tmp_path_factory):
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("control"), name="control")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def client(control_engine):
    async with EngineClient(control_engine.url, timeout_s=300) as c:
        yield c
        await c.resume()


async def until(predicate, timeout_s: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def running(client) -> int:
    return (await client.loads()).loads[0].num_running_reqs


async def busy(client, n: int = 1) -> bool:
    return await running(client) >= n


async def waiting(client) -> int:
    return (await client.loads()).loads[0].num_waiting_reqs


async def test_abort_by_rid_and_abort_all(client):
    task = asyncio.create_task(client.generate(PROMPT, LONG, rid="victim"))
    others = [asyncio.create_task(client.generate(PROMPT, LONG)) for _ in range(2)]
    await until(lambda: busy(client, 3))
    await client.abort("victim")
    out = await task
    assert out.meta_info.finish_reason["type"] == "abort" and 0 < len(out.output_ids) < 3000
    await client.abort(abort_all=True)
    assert [(await t).meta_info.finish_reason["type"] for t in others] == ["abort", "abort"]


async def test_abort_by_parent_rid_covers_the_samples_of_an_n_request(client):
    group = asyncio.create_task(client.generate_samples(PROMPT, LONG, 3, rid="group"))
    bystander = asyncio.create_task(client.generate(PROMPT, LONG, rid="grou"))
    await until(lambda: busy(client, 4))
    await client.abort("group")  # SGLang's scheduler matching: every rid that starts with it
    assert [s.meta_info.finish_reason["type"] for s in await group] == ["abort"] * 3
    assert await running(client) == 1 and not bystander.done()  # "grou" does not start with "group"
    await client.abort("grou")
    assert (await bystander).meta_info.finish_reason["type"] == "abort"


async def test_pause_abort_then_new_work_waits_for_continue(client):
    inflight = asyncio.create_task(client.generate(PROMPT, LONG))
    await until(lambda: busy(client))
    await client.pause("abort")
    assert (await inflight).meta_info.finish_reason["type"] == "abort"
    queued = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 4}))
    await asyncio.sleep(0.5)
    assert not queued.done() and await waiting(client) == 1
    await client.resume()
    assert len((await queued).output_ids) == 4


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_retract_and_in_place_resume_to_the_same_tokens(client, mode):
    params = {**LONG, "max_new_tokens": 600}
    reference = await client.generate(PROMPT, params)
    task = asyncio.create_task(client.generate(PROMPT, params))
    await until(lambda: busy(client))
    await client.pause(mode)
    await asyncio.sleep(0.3)
    loads = (await client.loads()).loads[0]
    if mode == "retract":
        assert (loads.num_running_reqs, loads.num_waiting_reqs) == (0, 1)
    else:
        assert (loads.num_running_reqs, loads.num_waiting_reqs) == (1, 0)
    assert not task.done()
    await client.resume()
    out = await task
    assert out.output_ids == reference.output_ids  # seeded: pausing changes nothing
    assert [e[0] for e in out.meta_info.output_token_logprobs] == pytest.approx(
        [e[0] for e in reference.meta_info.output_token_logprobs], abs=1e-5)


async def test_disk_update_changes_outputs_and_version(client, tiny_checkpoint, tiny_checkpoint_b):
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    before = await client.generate(PROMPT, greedy)
    result = await client.update_weights_from_disk(str(tiny_checkpoint_b), weight_version="1")
    assert result.success and "Weight version updated to 1" in result.message
    after = await client.generate(PROMPT, greedy)
    assert after.output_ids != before.output_ids and after.meta_info.weight_version == "1"
    assert await client.weight_version() == "1"
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="2")
    again = await client.generate(PROMPT, greedy)
    assert again.output_ids == before.output_ids and again.meta_info.weight_version == "2"


async def test_get_weights_by_name_shows_the_served_weights(client, tiny_checkpoint, tiny_checkpoint_b):
    """SGLang's /get_weights_by_name (how RL frameworks check a weight sync): the first rows of an HF-named
    tensor, before and after an update, experts included (stored stacked, named per expert)."""
    names = ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
             "lm_head.weight"]
    for checkpoint in (tiny_checkpoint_b, tiny_checkpoint):
        await client.update_weights_from_disk(str(checkpoint))
        expected = read_tensors(checkpoint)
        for name in names:
            assert torch.equal(await client.weights_by_name(name, 5), expected[name][:5].float()), name
    with pytest.raises(EngineError, match="no tensor named"):
        await client.weights_by_name("model.layers.0.nope")


async def test_update_weight_version_relabels_and_may_abort(client):
    task = asyncio.create_task(client.generate(PROMPT, LONG))
    await until(lambda: busy(client))
    await client.update_weight_version("41", abort_all_requests=False)
    await asyncio.sleep(0.2)
    await client.update_weight_version("42")  # SGLang's default: abort what runs
    out = await task
    assert out.meta_info.finish_reason["type"] == "abort"
    versions = [s.version for s in out.meta_info.weight_versions]
    assert len(versions) >= 2 and versions[-1] == "41"  # relabelled mid-request; aborted before "42" took effect
    assert await client.weight_version() == "42"
    assert (await client.generate(PROMPT, {"max_new_tokens": 2})).meta_info.weight_version == "42"


async def test_in_place_update_splits_weight_version_spans(client, tiny_checkpoint, tiny_checkpoint_b):
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="10")
    task = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 800}))
    await until(lambda: busy(client))
    await asyncio.sleep(0.2)
    await client.pause("in_place")
    await client.update_weights_from_disk(str(tiny_checkpoint_b), weight_version="11")
    await client.resume()
    out = await task
    spans = [s.model_dump() for s in out.meta_info.weight_versions]
    assert [s["version"] for s in spans] == ["10", "11"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 800
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="12")


async def test_tensor_update_equals_disk_update(client, tiny_checkpoint, tiny_checkpoint_b):
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    await client.update_weights_from_disk(str(tiny_checkpoint_b), weight_version="20")
    via_disk = await client.generate(PROMPT, greedy)
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="21")
    result = await client.update_weights_from_tensor(read_tensors(tiny_checkpoint_b), weight_version="22")
    assert result.success
    via_tensor = await client.generate(PROMPT, greedy)
    assert via_tensor.output_ids == via_disk.output_ids and via_tensor.meta_info.weight_version == "22"
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="23")



async def test_distributed_gloo_broadcast_update(client, tiny_checkpoint, tiny_checkpoint_b):
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    await client.update_weights_from_disk(str(tiny_checkpoint_b), weight_version="30")
    target = await client.generate(PROMPT, greedy)
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="31")
    port = free_port()
    joining = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo"))
    await asyncio.to_thread(dist.init_process_group, "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=2)
    try:
        assert (await joining).success
        tensors = read_tensors(tiny_checkpoint_b)
        update = asyncio.create_task(client.update_weights_from_distributed(tensors, weight_version="32", group_name="wg"))

        def broadcast_all():
            for tensor in tensors.values():
                dist.broadcast(tensor.contiguous(), src=0)
        await asyncio.to_thread(broadcast_all)
        assert (await update).success
        after = await client.generate(PROMPT, greedy)
        assert after.output_ids == target.output_ids and after.meta_info.weight_version == "32"
        await client.release_memory(["weights"])  # refused while released, yet the broadcast is taken (no hang)
        refused = asyncio.create_task(client.update_weights_from_distributed(tensors, group_name="wg"))
        await asyncio.wait_for(asyncio.to_thread(broadcast_all), timeout=60)
        with pytest.raises(EngineError, match="weights are released"):
            await refused
        await client.resume_memory(["weights"])
        assert (await client.generate(PROMPT, greedy)).output_ids == target.output_ids
        assert (await client.destroy_weights_update_group("wg")).success
    finally:
        dist.destroy_process_group()
    await client.update_weights_from_disk(str(tiny_checkpoint), weight_version="33")


async def test_memory_pressure_retracts_instead_of_failing(tiny_checkpoint, tmp_path):
    """A pool of 1,200 tokens, 12 requests of ~200 tokens each: retraction, no failure, same tokens."""
    small = start_engine(tiny_checkpoint, tmp_path, "--max-total-tokens", "1200", name="small")
    roomy = start_engine(tiny_checkpoint, tmp_path, name="roomy")
    try:
        prompts = [[1006, 1008] + [100 + i] * 48 for i in range(12)]
        params = [{"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i} for i in range(12)]
        async with EngineClient(small.url, timeout_s=300) as tight, EngineClient(roomy.url, timeout_s=300) as free:
            squeezed = await asyncio.gather(*(tight.generate(p, s) for p, s in zip(prompts, params)))
            baseline = await asyncio.gather(*(free.generate(p, s) for p, s in zip(prompts, params)))
        assert [o.output_ids for o in squeezed] == [o.output_ids for o in baseline]
        assert "retracted" in small.log()
    finally:
        small.stop()
        roomy.stop()


async def test_release_and_resume_memory_occupation_as_slime_colocates(tiny_checkpoint, tiny_checkpoint_b, tmp_path):
    """SGLang's release / resume_memory_occupation in slime's colocate order: release all (idle engines
    only), train, resume weights, update them, resume the KV cache. Released memory goes back to the
    OS; requests sent meanwhile wait; resumed weights are exactly the released ones."""
    proc = start_engine(tiny_checkpoint, tmp_path, "--max-total-tokens", "400000")
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        async with EngineClient(proc.url, timeout_s=120) as c:
            info = await c.server_info()
            pool_bytes = info["max_total_num_tokens"] * info["kv_cache_bytes_per_token"]
            server = psutil.Process(info["pid"])
            before = await c.generate(PROMPT, greedy)
            long = asyncio.create_task(c.generate(PROMPT, LONG))
            await until(lambda: busy(c))
            with pytest.raises(EngineError, match="needs an idle engine"):
                await c.release_memory()
            await c.abort(abort_all=True)
            await long
            with pytest.raises(EngineError, match="unknown"):
                await c.release_memory(["gpu"])

            rss = server.memory_info().rss
            await c.release_memory()  # no tags: all
            assert (await c.server_info())["memory_released"] == ["kv_cache", "weights"]
            assert rss - server.memory_info().rss > 0.8 * pool_bytes
            assert not await c.health_generate()
            queued = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            assert not queued.done() and await waiting(c) == 1
            with pytest.raises(EngineError, match="weights are released"):
                await c.update_weights_from_disk(str(tiny_checkpoint_b))

            await c.resume_memory(["weights"])
            assert (await c.update_weights_from_disk(str(tiny_checkpoint_b), weight_version="1")).success
            await asyncio.sleep(0.3)
            assert not queued.done()  # the KV cache is still released
            await c.resume_memory(["kv_cache"])
            out = await queued
            assert len(out.output_ids) == 4 and out.meta_info.weight_version == "1"
            assert await c.health_generate()

            await c.update_weights_from_disk(str(tiny_checkpoint), weight_version="2")
            await c.release_memory(["weights"])
            await c.resume_memory(["weights"])  # restored from the engine's own offload, bit for bit
            after = await c.generate(PROMPT, greedy)
            async with httpx.AsyncClient() as http:  # a body-less POST, as SGLang accepts
                assert (await http.post(proc.url + "/resume_memory_occupation")).json()["success"]
    finally:
        assert proc.stop() == 0, proc.log()
    assert after.output_ids == before.output_ids
    assert [e[0] for e in after.meta_info.output_token_logprobs] == [
        e[0] for e in before.meta_info.output_token_logprobs]


async def test_a_rendezvous_nobody_answers_holds_up_neither_generation_nor_shutdown(tiny_checkpoint, tmp_path):
    """A trainer that never comes (or an address nobody serves) keeps the join waiting for its timeout:
    meanwhile requests are served, a second join is refused, and the engine still stops at once."""
    engine = start_engine(tiny_checkpoint, tmp_path, name="lonely")
    client = EngineClient(engine.url)
    try:
        joining = asyncio.create_task(client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "wg", "gloo"))
        await asyncio.sleep(1.0)
        assert not joining.done()
        reply = await asyncio.wait_for(client.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True}), 30)
        assert len(reply.output_ids) == 8
        with pytest.raises(EngineError, match="being joined"):
            await client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "wg2", "gloo")
        joining.cancel()
    finally:
        await client.close()
        assert engine.stop() == 0, engine.log()
