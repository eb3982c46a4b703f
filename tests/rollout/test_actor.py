"""The RolloutEngine Ray actor: placement, health monitor, restart with the current weights."""

import asyncio
import os
import signal
import time

import pytest
import ray

from asyncrl.config import RolloutConfig
from asyncrl.engine_client import EngineClient
from asyncrl.store import Store
from rollout.actor import EngineGroup, RolloutEngine
from rollout.backends import LaunchSpec, SGLangBackend, make_backend
from rollout.server import parse_args

PROMPT = [1006, 1008, 1011, 50, 60, 70, 1012]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


async def greedy(url: str):
    async with EngineClient(url, timeout_s=60) as client:
        return await client.generate(PROMPT, GREEDY)


def wait_for(fn, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = fn()
            if value:
                return value
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_killed_engine_actor_restarts_with_current_weights(local_ray, redis_server, run_name, tiny_checkpoint,
                                                          tiny_checkpoint_b, tmp_path):
    cfg = RolloutConfig(num_engines=1, num_cpus_per_engine=1, health_check_interval_s=0.5, max_total_tokens=8192)
    group = EngineGroup(cfg, str(tiny_checkpoint), redis_server.url, run_name, str(tmp_path))
    try:
        url = group.urls()[0]
        before = asyncio.run(greedy(url))
        # the trainer's push: weights on disk, recorded in Redis, loaded by the engine
        asyncio.run(_push(redis_server.url, run_name, url, str(tiny_checkpoint_b), "1"))
        pushed = asyncio.run(greedy(url))
        assert pushed.output_ids != before.output_ids and pushed.meta_info.weight_version == "1"

        actor = group.actors[0]
        old_pid = ray.get(actor.status.remote())["pid"]
        ray.kill(actor, no_restart=False)
        restarted = wait_for(lambda: (s := ray.get(actor.status.remote(), timeout=5))["pid"] != old_pid and s)
        new_url = restarted["url"]
        after = asyncio.run(greedy(new_url))
        assert after.output_ids == pushed.output_ids and after.meta_info.weight_version == "1"
        assert asyncio.run(_engines(redis_server.url, run_name)) == {"engine-0": new_url}
    finally:
        group.shutdown()
    assert asyncio.run(_engines(redis_server.url, run_name)) == {}


def test_health_monitor_relaunches_a_dead_engine_process(local_ray, redis_server, run_name, tiny_checkpoint, tmp_path):
    cfg = RolloutConfig(num_engines=1, num_cpus_per_engine=1, health_check_interval_s=0.5, max_total_tokens=8192)
    group = EngineGroup(cfg, str(tiny_checkpoint), redis_server.url, run_name, str(tmp_path))
    try:
        actor = group.actors[0]
        status = ray.get(actor.status.remote())
        os.kill(status["pid"], signal.SIGKILL)  # the engine process dies, the actor lives
        restarted = wait_for(lambda: (s := ray.get(actor.status.remote())) and s["restarts"] == 1 and s["serving"] and s)
        assert restarted["pid"] != status["pid"]
        assert asyncio.run(greedy(restarted["url"])).meta_info.weight_version == "0"
    finally:
        group.shutdown()


def test_engine_that_missed_a_push_while_starting_loads_the_newest_snapshot(redis_server, run_name, tiny_checkpoint,
                                                                           tiny_checkpoint_b, tmp_path):
    """The trainer pushes to the engines registered when its push starts: one (re)starting meanwhile catches
    up when it serves (RolloutEngine.on_serving), instead of generating at weights the trainer moved past."""
    cfg = RolloutConfig(num_engines=1, num_cpus_per_engine=1, health_check_interval_s=0.5, max_total_tokens=8192)
    engine = RolloutEngine(cfg, "engine-0", str(tiny_checkpoint), redis_server.url, run_name, str(tmp_path))
    try:
        started = asyncio.run(greedy(engine.url()))
        assert started.meta_info.weight_version == "0"
        asyncio.run(_record(redis_server.url, run_name, str(tiny_checkpoint_b), 3))  # a push it was not part of
        engine.on_serving()
        caught_up = asyncio.run(greedy(engine.url()))
        assert caught_up.meta_info.weight_version == "3" and caught_up.output_ids != started.output_ids
        asyncio.run(_record(redis_server.url, run_name, str(tiny_checkpoint), 2))  # versions only grow
        engine.on_serving()
        assert asyncio.run(greedy(engine.url())).output_ids == caught_up.output_ids
    finally:
        engine.shutdown()


async def _record(redis_url, run, path, version):
    store = Store.connect(redis_url, run)
    try:
        await store.record_snapshot(version, path)
        await store.record_served_version(version, "disk")
    finally:
        await store.close()


async def _push(redis_url, run, engine_url, path, version):
    store = Store.connect(redis_url, run)
    await store.record_snapshot(int(version), path)
    await store.record_served_version(int(version), "disk")
    await store.close()
    async with EngineClient(engine_url) as client:
        await client.update_weights_from_disk(path, weight_version=version)


async def _engines(redis_url, run):
    store = Store.connect(redis_url, run)
    try:
        return await store.engines()
    finally:
        await store.close()


def test_cpu_backend_passes_extra_flags_the_server_understands(tmp_path):
    backend = make_backend(RolloutConfig(cpu_args=["--stream-interval", "4", "--disable-radix-cache"]))
    argv = backend.command(LaunchSpec("/ckpt", "127.0.0.1", 0, "3", tmp_path / "log"))
    assert argv[1:3] == ["-m", "rollout.server"]
    args, _ = parse_args(argv[3:])
    assert (args.stream_interval, args.disable_radix_cache, args.weight_version) == (4, True, "3")
    assert args.incremental_streaming_output  # the run config's default
    plain = make_backend(RolloutConfig(incremental_streaming_output=False)).command(
        LaunchSpec("/ckpt", "127.0.0.1", 0, "3", tmp_path / "log"))
    assert not parse_args(plain[3:])[0].incremental_streaming_output
    assert not args.enable_return_routed_experts
    replay = make_backend(RolloutConfig(routing_replay=True)).command(LaunchSpec("/ckpt", "127.0.0.1", 0, "3",
                                                                                 tmp_path / "log"))
    assert parse_args(replay[3:])[0].enable_return_routed_experts


def test_sglang_backend_uses_dsa_flags_and_fails_clearly(tmp_path, monkeypatch):
    cfg = RolloutConfig(backend="sglang", sglang_args=["--tp-size", "8"])
    backend = make_backend(cfg)
    assert isinstance(backend, SGLangBackend)
    argv = backend.command(LaunchSpec("/ckpt", "0.0.0.0", 30000, "3", tmp_path / "log"))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in [("--attention-backend", "dsa"), ("--dsa-topk-backend", "torch"), ("--weight-version", "3"),
                        ("--tp-size", "8")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--incremental-streaming-output" in argv and "--enable-return-routed-experts" not in argv
    assert "--enable-return-routed-experts" in make_backend(RolloutConfig(backend="sglang", routing_replay=True)).command(
        LaunchSpec("/ckpt", "0.0.0.0", 30000, "3", tmp_path / "log"))
    assert backend.environment() == {"SGLANG_DSA_FUSE_TOPK": "0"}
    assert "--speculative-algorithm" not in argv
    spec = make_backend(RolloutConfig(backend="sglang", speculative=True, speculative_num_steps=3)).command(
        LaunchSpec("/ckpt", "0.0.0.0", 30000, "3", tmp_path / "log"))
    for flag, value in [("--speculative-algorithm", "EAGLE"), ("--speculative-num-steps", "3"),
                        ("--speculative-eagle-topk", "1"), ("--speculative-num-draft-tokens", "4")]:
        assert spec[spec.index(flag) + 1] == value  # SGLang's MTP recipe (docs/engine.md)
    with pytest.raises(RuntimeError, match="needs SGLang"):
        backend.check_available()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    strict = make_backend(RolloutConfig(backend="sglang", sglang_args=["--enable-deterministic-inference"]))
    with pytest.raises(RuntimeError, match="refuses --enable-deterministic-inference with the dsa"):
        strict.check_available()
    with pytest.raises(ValueError, match="rollout.backend 'vllm' not in"):
        make_backend(RolloutConfig(backend="vllm"))
