"""Weight pushes against two real engine processes: disk, tensor and distributed (one gloo broadcast
group, ranks 1 and 2) change what every engine generates to exactly the trainer's weights and advance
its weight version; in-flight requests continue across an in_place push; a dead engine is reported
while the others update; the `weights` hash tells a restarting engine what to load."""

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncrl.config import TrainerConfig, WeightPushConfig
from asyncrl.engine_client import EngineClient
from asyncrl.model.io import load_pretrained, read_tensors
from asyncrl.store import Store
from tests.rollout.conftest import argmax_continuation, start_engine
from trainer.backends.base import make_backend
from trainer.weight_push import WeightsMismatch, WeightSync, probe_names, verify_weights

pytestmark = pytest.mark.timeout(120)

PROMPT = [1006, 1008, 1011, 50, 60, 70, 1012]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("push-engines")
    procs = [start_engine(tiny_checkpoint, workdir, name=f"push-engine-{i}") for i in range(2)]
    yield procs
    assert [p.stop() for p in procs] == [0, 0], [p.log() for p in procs]


@pytest.fixture
def engine(engines):
    return engines[0]


@pytest.fixture(scope="module")
def trainer_backend(tiny_section, tiny_checkpoint_b):
    """A trainer holding other weights than the engine serves (the seed-1 checkpoint)."""
    return make_backend(TrainerConfig(), replace(tiny_section, path=str(tiny_checkpoint_b)))


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, tiny_checkpoint_b):
    """Greedy continuations of the engine's initial weights and of the trainer's."""
    return {name: argmax_continuation(load_pretrained(path).eval(), PROMPT, GREEDY["max_new_tokens"])
            for name, path in (("initial", tiny_checkpoint), ("trained", tiny_checkpoint_b))}


@pytest.fixture
async def store(redis_server, run_name, engines, tiny_checkpoint):
    s = Store.connect(redis_server.url, run_name)
    for i, proc in enumerate(engines):
        await s.register_engine(f"engine-{i}", proc.url)
        async with EngineClient(proc.url) as client:  # every test starts from the initial weights
            await client.update_weights_from_disk(str(tiny_checkpoint), "0")
    yield s
    await s.close()


async def greedy(url: str):
    async with EngineClient(url) as client:
        out = await client.generate(PROMPT, GREEDY)
    return out.output_ids, out.meta_info.weight_version


@pytest.mark.parametrize("method", ["disk", "tensor", "distributed"])
async def test_push_serves_the_trainers_weights_with_the_new_version(method, engines, store, trainer_backend,
                                                                     expected, tmp_path):
    assert [await greedy(e.url) for e in engines] == [(expected["initial"], "0")] * 2
    sync = WeightSync(WeightPushConfig(method=method, snapshot_every_pushes=2), store, tmp_path / "weights")
    first = await sync.push(trainer_backend, version=7)
    assert (first.engines, first.failed) == (2, {}) and first.bytes > 0
    assert [await greedy(e.url) for e in engines] == [(expected["trained"], "7")] * 2
    group = getattr(sync.pusher, "group", None)
    second = await sync.push(trainer_backend, version=8)
    assert [await greedy(e.url) for e in engines] == [(expected["trained"], "8")] * 2 and second.failed == {}
    assert getattr(sync.pusher, "group", None) is group  # distributed: the broadcast group is reused
    weights = await store.weights()
    assert weights.served_version == 8 and weights.method == method
    snapshot = Path(weights.snapshot)  # disk: every push; tensor/distributed: every 2nd push
    assert weights.snapshot_version == 8 and snapshot == tmp_path / "weights" / "v00000008"
    assert read_tensors(snapshot).keys() == trainer_backend.hf_state_dict().keys()
    assert (first.snapshot is not None) == (method == "disk")
    await sync.close()


async def test_in_place_push_continues_running_requests_with_both_versions(engine, store, trainer_backend, tmp_path):
    async with EngineClient(engine.url) as client:
        long = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 120, "temperature": 1.0,
                                                            "ignore_eos": True, "sampling_seed": 3}))
        while (await client.loads()).loads[0].num_running_reqs == 0:
            await asyncio.sleep(0.02)
        sync = WeightSync(WeightPushConfig(method="disk"), store, tmp_path / "w")
        report = await sync.push(trainer_backend, 1)
        out = await long
        await sync.close()
    assert out.meta_info.finish_reason["type"] == "length" and len(out.output_ids) == 120
    spans = [s.model_dump() for s in out.meta_info.weight_versions]
    assert [s["version"] for s in spans] == ["0", "1"] and spans[0]["end"] == spans[1]["start"]
    assert report.pause_s > 0 and report.update_s > 0 and report.resume_s > 0


async def test_a_dead_engine_is_reported_and_the_others_update(engine, store, trainer_backend, expected, tmp_path):
    await store.register_engine("engine-dead", "http://127.0.0.1:9")  # nothing listens there
    sync = WeightSync(WeightPushConfig(method="tensor", timeout_s=5), store, tmp_path / "w")
    report = await sync.push(trainer_backend, version=3)
    assert set(report.failed) == {"engine-dead"} and report.engines == 2
    assert await greedy(engine.url) == (expected["trained"], "3")  # updated and resumed
    assert (await store.weights()).served_version == 3
    await sync.close()


async def test_verification_reads_the_pushed_rows_back_and_catches_other_values(engines, store, trainer_backend,
                                                                                tiny_checkpoint, tmp_path, caplog):
    """Every push above passed verify_weights (their failed == {}); here the engines hold the trainer's
    weights and are checked against the initial ones: both are reported, with the tensor named."""
    sync = WeightSync(WeightPushConfig(method="disk"), store, tmp_path / "w")
    assert (await sync.push(trainer_backend, version=4)).failed == {}
    stale = read_tensors(tiny_checkpoint)
    async with EngineClient(engines[0].url) as client:
        await verify_weights(client, trainer_backend.hf_state_dict())
        with pytest.raises(WeightsMismatch, match=r"\S+\.weight: the engine serves other values"):
            await verify_weights(client, stale)
        await verify_weights(client, {"model.unknown.weight": torch.zeros(2, 2)})  # a refused read: logged only
    assert "cannot read weights back" in caplog.text
    assert len(probe_names(stale)) == 3 and "lm_head.weight" in probe_names(stale)
    await sync.close()


def test_unknown_method_or_pause_mode_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="weight_push.method 'rdma' not in"):
        WeightSync(WeightPushConfig(method="rdma"), None, tmp_path)
    with pytest.raises(ValueError, match="weight_push.pause_mode 'nap' not in"):
        WeightSync(WeightPushConfig(pause_mode="nap"), None, tmp_path)
