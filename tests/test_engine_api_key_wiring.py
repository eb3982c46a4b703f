"""The engine API key (rollout.api_key), config -> launcher -> each process that needs it: the engines
serve with it, the gateway and the trainer send it; off the command line wherever the process allows."""

from dataclasses import replace
from types import SimpleNamespace

from asyncrl.config import ENGINE_API_KEY_ENV, RolloutConfig, RunConfig
from asyncrl_run.launcher import Job, trainer_config
from gateway.server import parse_args as gateway_args
from rollout.backends import LaunchSpec, make_backend
from rollout.server import parse_args


def test_the_engine_api_key_reaches_engines_gateway_and_trainer_off_the_command_line(tmp_path, monkeypatch):
    """rollout.api_key -> the built-in engine (by environment), SGLang (its --api-key), the gateway (by
    environment, its --engine-api-key default) and the trainer's weight pushes."""
    key = "k-123"
    cfg = RunConfig(rollout=RolloutConfig(api_key=key))
    spec = LaunchSpec("/ckpt", "127.0.0.1", 0, "0", tmp_path / "log")
    cpu = make_backend(cfg.rollout)
    assert key not in " ".join(cpu.command(spec)) and cpu.environment() == {ENGINE_API_KEY_ENV: key}
    monkeypatch.setenv(ENGINE_API_KEY_ENV, key)
    assert parse_args(cpu.command(spec)[3:])[0].api_key == key
    sglang = make_backend(replace(cfg.rollout, backend="sglang")).command(spec)
    assert sglang[sglang.index("--api-key") + 1] == key  # SGLang takes it on its command line only

    job, started = Job(cfg, tmp_path, "redis://127.0.0.1:1"), {}
    job.engines = SimpleNamespace(urls=lambda: ["http://127.0.0.1:30000"])
    monkeypatch.setattr(job, "_service", lambda name, module, args, _resources, env=None, port=0:
                        started.update(args=args, env=env) or "http://127.0.0.1:1")  # a service's URL
    job._start_gateway()
    assert key not in started["args"] and started["env"][ENGINE_API_KEY_ENV] == key
    monkeypatch.setenv(ENGINE_API_KEY_ENV, started["env"][ENGINE_API_KEY_ENV])
    assert gateway_args(started["args"])[0].engine_api_key == key
    assert trainer_config(cfg).weight_push.engine_api_key == key
    assert trainer_config(RunConfig()).weight_push.engine_api_key == key  # what the engines inherit, it sends
    monkeypatch.delenv(ENGINE_API_KEY_ENV)
    assert trainer_config(RunConfig()).weight_push.engine_api_key is None
