"""Weight pushes against two real engine processes: disk, tensor and distributed (one gloo broadcast
group, ranks 1 and 2) change what every engine generates to exactly the trainer's weights and advance
its weight version; in-flight requests continue across an in_place push; a dead engine is reported
while the others update; the `weights` hash tells a restarting engine what to load. Verification runs
after every transfer: an engine that acknowledges an update but keeps its old weights fails the push,
and its actor restarts it with the pushed weights."""

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncrl.config import RolloutConfig, TrainerConfig, WeightPushConfig
from asyncrl.engine_client import EngineClient
from asyncrl.model.io import load_pretrained, read_tensors
from asyncrl.store import Store
from rollout.actor import RolloutEngine
from tests.rollout.conftest import argmax_continuation, start_engine
from tests.services import ROOT
from trainer.backends.base import make_backend
from trainer.weight_push import WeightPusher, WeightsMismatch, WeightSync, probe_names, verify_weights

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
    weights = await store.weights()  # a tensor push writes a snapshot when an engine must restart from it
    assert (weights.served_version, weights.snapshot_version, weights.snapshot) == (3, 3, report.snapshot)
    assert [await store.engine_restart_request(e) for e in ("engine-dead", "engine-0")] == [3, 0]
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


class AcknowledgingPusher(WeightPusher):
    """A transfer that reports every engine updated and sends nothing."""

    async def update(self, clients, tensors, version, snapshot):
        return {}


@pytest.mark.parametrize("verify", [True, False])
async def test_a_transfer_that_loads_nothing_fails_verification(verify, engines, store, trainer_backend, expected,
                                                                tmp_path):
    """Verification runs after every transfer the method calls a success: the engines kept their weights,
    so the push fails for each of them and asks for their restart (a snapshot of v5 recorded first)."""
    sync = WeightSync(WeightPushConfig(method="tensor", verify_weights=verify), store, tmp_path / "w")
    sync.pusher = AcknowledgingPusher(sync.cfg)
    report = await sync.push(trainer_backend, version=5)
    assert [await greedy(e.url) for e in engines] == [(expected["initial"], "0")] * 2  # nothing was loaded
    restarts = [await store.engine_restart_request(f"engine-{i}") for i in range(2)]
    if verify:
        assert sorted(report.failed) == ["engine-0", "engine-1"]
        assert all(error.startswith("WeightsMismatch: ") for error in report.failed.values())
        assert restarts == [5, 5] and (await store.weights()).snapshot_version == 5
    else:  # what every push reported before verification ran on the success path
        assert report.failed == {} and restarts == [0, 0] and (await store.weights()).snapshot is None
    await sync.close()


class FaultyFirstLaunch(RolloutEngine):
    """An engine actor whose first engine process takes weight updates without loading them
    (tests/engine_faults.py); every relaunch runs the real engine."""

    launches = 0

    def command(self) -> list[str]:
        argv = super().command()
        self.launches += 1
        if self.launches == 1:
            argv[argv.index("rollout.server")] = "tests.engine_faults"
        return argv

    def environment(self) -> dict[str, str]:
        return {**super().environment(),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["tensor", "distributed"])
async def test_an_engine_that_acknowledges_but_keeps_its_weights_is_restarted_with_them(
        method, redis_server, run_name, tiny_checkpoint, trainer_backend, expected, tmp_path):
    store = Store.connect(redis_server.url, run_name)
    cfg = RolloutConfig(num_cpus_per_engine=1, health_check_interval_s=0.5, max_total_tokens=8192)
    actor = await asyncio.to_thread(FaultyFirstLaunch, cfg, "engine-0", str(tiny_checkpoint), redis_server.url,
                                    run_name, str(tmp_path / "engines"))
    sync = WeightSync(WeightPushConfig(method=method, timeout_s=60), store, tmp_path / "weights")
    try:
        first = await sync.push(trainer_backend, version=1)
        assert list(first.failed) == ["engine-0"] and first.failed["engine-0"].startswith("WeightsMismatch: ")
        weights = await store.weights()  # a v1 snapshot for the restart to load (written for it)
        assert (weights.served_version, weights.snapshot_version, weights.snapshot) == (1, 1, first.snapshot)
        assert await store.engine_restart_request("engine-0") == 1

        deadline = time.monotonic() + 120
        while not ((status := actor.status())["restarts"] == 1 and status["serving"]):
            assert time.monotonic() < deadline, "the engine was not restarted"
            await asyncio.sleep(0.2)
        assert await greedy(actor.url()) == (expected["trained"], "1")  # the pushed weights, loaded
        async with EngineClient(actor.url()) as client:
            await verify_weights(client, trainer_backend.hf_state_dict())

        second = await sync.push(trainer_backend, version=2)  # training goes on: the next push reaches it
        assert second.failed == {} and await greedy(actor.url()) == (expected["trained"], "2")
        await asyncio.sleep(4 * cfg.health_check_interval_s)
        assert actor.status()["restarts"] == 1  # the request was honoured once
    finally:
        await sync.close()
        await asyncio.to_thread(actor.shutdown)
        await store.close()


def test_unknown_method_or_pause_mode_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="weight_push.method 'rdma' not in"):
        WeightSync(WeightPushConfig(method="rdma"), None, tmp_path)
    with pytest.raises(ValueError, match="weight_push.pause_mode 'nap' not in"):
        WeightSync(WeightPushConfig(pause_mode="nap"), None, tmp_path)
