"""Every config field of the gateway, the orchestrator, an env service and the engines reaches the running service.

Each field of their sections is set to a value other than its default (generated from the dataclass
fields, so a field added later is covered at once), the services are started the way the launcher
starts them (its section builders, the section files in the run dir, the tokens by environment; real
processes, a real redis-server), and each one's GET /server_info is compared with what the run config
asked for: the test fails naming every field that did not arrive. A field the launcher fills in from
elsewhere in the run config says where from (LAUNCHER_FILLS); one that cannot take an arbitrary value
is given one (FIXED), with the reason.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import fields, is_dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import pytest

from asyncrl.config import (EnvsConfig, EnvServiceConfig, GatewayConfig, OrchestratorConfig, RolloutConfig, RunConfig,
                            SamplingConfig, TrainerConfig, WeightPushConfig, is_secret, section_data)
from asyncrl_run.launcher import Job, gateway_section
from tests.services import ServiceProcess, free_port, wait_until

ENGINE_URL = "http://127.0.0.1:9/engine"
"""No engine serves there: the gateway only has to hold it in its config."""

FIXED: dict[str, Any] = {
    "gateway.host": "localhost",  # an address of this machine, other than the default 127.0.0.1
    "orchestrator.host": "localhost",
    "orchestrator.task_order": "listed",  # one of two orders (default shuffled)
    "gateway.port": free_port(),  # a port that is free (default 0: any free port)
    "gateway.replicas": 2,  # two gateways (the second on gateway.port + 1), each given its section
    "orchestrator.port": free_port(),
    "gateway.tokenizer": "builtin:tiny",  # a tokenizer the gateway can load (default None: the model's)
    "env.target": "tests.orchestrator.timed_env.TimedEnv",  # an env class that exists (no default)
    "env.options": {"sleep_s": 0.05, "num_tasks": 3},  # keyword arguments the class takes
    "orchestrator.sessions": "orchestrator.sessions:GatewaySessions",  # a provider by import path (no built-in name)
    "env.sandbox": "local_unsafe",  # a sandbox type that exists (default namespace)
    "env.sandbox_options": {"memory_mb": 1024},  # a SandboxConfig field
    "env.context": {"keep_recent_k": 5},  # a ContextConfig field
    "env.python": sys.executable,  # an interpreter that exists (default None: the run's own)
    "gateway.load_factor": 1.5,  # at least 1 (halving the default gives less)
    # The launcher replaces these by rollout.routing_replay and rollout.sampling (both varied): kept at
    # their defaults here, so that a builder that forgot to replace them is seen.
    "gateway.routing_replay": False,
    "orchestrator.sampling": SamplingConfig(),
}

LAUNCHER_FILLS: dict[str, Callable[[RunConfig, dict], Any]] = {
    "gateway.redis_url": lambda cfg, urls: urls["redis"],
    "gateway.run_name": lambda cfg, urls: cfg.name,
    "gateway.engine_urls": lambda cfg, urls: [ENGINE_URL],  # the engines the launcher started
    "gateway.engines_from_redis": lambda cfg, urls: True,   # then followed in Redis, across restarts
    "gateway.routing_replay": lambda cfg, urls: cfg.rollout.routing_replay,
    "orchestrator.redis_url": lambda cfg, urls: urls["redis"],
    "orchestrator.run_name": lambda cfg, urls: cfg.name,
    "orchestrator.gateway_url": lambda cfg, urls: urls["gateway"],
    "orchestrator.llm_url": lambda cfg, urls: None,
    "orchestrator.seed": lambda cfg, urls: cfg.seed,
    "orchestrator.sampling": lambda cfg, urls: section_data(cfg.rollout.sampling),
    "orchestrator.staleness_limit": lambda cfg, urls: cfg.trainer.staleness_tau,  # async mode
    "orchestrator.wait_for_envs": lambda cfg, urls: [e.name for e in cfg.envs.services.values()],
    "orchestrator.groups_per_step": lambda cfg, urls: (cfg.trainer.groups_per_step
                                                       * cfg.trainer.weight_push.every_k_steps),
    "orchestrator.max_turns_by_env": lambda cfg, urls: {**cfg.orchestrator.max_turns_by_env,
                                                        **{e.name: e.max_turns for e in cfg.envs.services.values()}},
    # Secrets travel by environment variable, from where the run config holds them; /server_info says "<set>".
    "gateway.engine_api_key": lambda cfg, urls: "<set>" if cfg.rollout.api_key else None,
    "orchestrator.gateway_token": lambda cfg, urls: "<set>" if cfg.gateway.auth_token else None,
    "orchestrator.env_token": lambda cfg, urls: "<set>" if cfg.envs.auth_token else None,
    "orchestrator.episode_timeout_s_by_env": lambda cfg, urls: {
        **cfg.orchestrator.episode_timeout_s_by_env,
        **{e.name: e.episode_timeout_s for e in cfg.envs.services.values()}},
}


def other_value(value: Any, hint: Any, key: str) -> Any:
    """A value of type `hint` other than `value` (the default)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    origin = typing.get_origin(kind) or kind
    if is_dataclass(value):
        return varied(value, key)
    if origin is bool:
        return not value
    if origin is int:
        return (value or 0) + 3
    if origin is float:
        return value / 2 if value else 0.5
    if origin is str:
        return f"{key}-varied"
    if origin is list:
        return [*(value or []), f"{key}-varied"]
    if origin is dict:
        return {"varied": other_value(None, typing.get_args(kind)[1], key)}
    raise AssertionError(f"{key}: no rule for a non-default {hint}; add one here or a FIXED value with its reason")


def varied(section: Any, prefix: str) -> Any:
    """`section` with every field changed (FIXED ones as given there)."""
    hints = typing.get_type_hints(type(section))
    keys = {f.name: f"{prefix}.{f.name}" for f in fields(section)}
    return type(section)(**{name: FIXED[key] if key in FIXED else other_value(getattr(section, name), hints[name], key)
                            for name, key in keys.items()})


def run_config() -> RunConfig:
    env = varied(EnvServiceConfig(), "env")
    return RunConfig(name="propagation", seed=11, gateway=varied(GatewayConfig(), "gateway"),
                     orchestrator=varied(OrchestratorConfig(), "orchestrator"),
                     envs=EnvsConfig(services={"timed": env}, auth_token="env-secret"),
                     rollout=RolloutConfig(routing_replay=True, api_key="engine-key",
                                           sampling=varied(SamplingConfig(), "sampling")),
                     trainer=TrainerConfig(staleness_tau=2, groups_per_step=3,
                                           weight_push=WeightPushConfig(every_k_steps=2)))


def expected(name: str, section: Any, cfg: RunConfig, urls: dict) -> dict[str, Any]:
    """What /server_info should say: the run config's section, the launcher's fills, secrets as "<set>"."""
    data = section_data(section, redact=True)
    for key, source in LAUNCHER_FILLS.items():
        owner, _, field_name = key.partition(".")
        if owner == name:
            data[field_name] = source(cfg, urls)
    return data


def not_arrived(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [f"{key}: configured {value!r}, the service has {got.get(key, '<missing>')!r}"
            for key, value in want.items() if got.get(key, "<missing>") != value]


def test_every_field_differs_from_its_default():
    """Otherwise a field that never arrives would pass unseen (the launcher's fills come from elsewhere)."""
    cfg = run_config()
    pairs = [("gateway", cfg.gateway, GatewayConfig()), ("orchestrator", cfg.orchestrator, OrchestratorConfig()),
             ("sampling", cfg.rollout.sampling, SamplingConfig()),
             ("env", cfg.envs.services["timed"], EnvServiceConfig(target="x"))]
    same = [f"{name}.{f.name}" for name, s, default in pairs for f in fields(s)
            if getattr(s, f.name) == getattr(default, f.name) and f"{name}.{f.name}" not in LAUNCHER_FILLS]
    assert same == []


def test_the_check_names_a_field_the_launcher_drops():
    cfg = run_config()
    urls = {"redis": "redis://127.0.0.1:1", "gateway": "http://gw"}
    dropped = replace(gateway_section(cfg, urls["redis"], [ENGINE_URL]), max_interruptions=8)
    assert [line.split(":")[0] for line in not_arrived(expected("gateway", cfg.gateway, cfg, urls),
                                                       section_data(dropped, redact=True))] == ["max_interruptions"]


def test_every_field_of_every_service_section_arrives(tmp_path, redis_server):
    cfg = run_config()
    job, started = Job(cfg, tmp_path, redis_server.url), []

    def service(name: str, module: str, args: list[str], _resources, env=None, port: int = 0,
                python=None) -> str:  # no Ray
        started.append(ServiceProcess(module, args, tmp_path, name=name, env=env, port=port, python=python))
        return started[-1].url

    job._service = service
    job.engines = SimpleNamespace(urls=lambda: [ENGINE_URL])
    env = cfg.envs.services["timed"]
    try:
        urls = {"redis": redis_server.url, "gateway": job._start_gateway()}
        urls["orchestrator"] = job._start_orchestrator(urls["gateway"])
        urls["env"] = job._start_env(env, 0, urls["orchestrator"])
        missing = []
        assert len(urls["gateway"].split(",")) == cfg.gateway.replicas == 2  # gateway.replicas: each gets its section
        for name, url, section, token in [*(("gateway", u, replace(cfg.gateway, port=cfg.gateway.port + i),
                                              cfg.gateway.auth_token)  # replica i binds gateway.port + i
                                             for i, u in enumerate(urls["gateway"].split(","))),
                                          ("orchestrator", urls["orchestrator"], cfg.orchestrator,
                                           cfg.orchestrator.auth_token),
                                          ("env", urls["env"], env, cfg.envs.auth_token)]:
            reply = httpx.get(f"{url}/server_info", headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert reply.status_code == 200, reply.text
            missing += [f"{name}.{line}" for line in not_arrived(expected(name, section, cfg, urls), reply.json())]
        assert missing == [], "settings that did not reach the service:\n" + "\n".join(missing)
        assert all(is_secret(f) for f in fields(GatewayConfig) if f.name in ("auth_token", "engine_api_key"))
        assert not any(str(cfg.gateway.auth_token) in p.read_text() for p in (tmp_path / "config").iterdir())
    finally:
        codes = [proc.stop() for proc in reversed(started)]
    assert codes == [0] * len(started), [proc.log() for proc in started]


ENGINE_VALUES: dict[str, tuple[Any, str, Any]] = {
    # RolloutConfig field: (a value, the engine's server_info key that shows it, what it should say there);
    # each value differs from the engine's own default, so a flag the backend forgot shows.
    "max_running_requests": (17, "max_running_requests", 17),
    "max_total_tokens": (20000, "max_total_tokens", 20000),
    "chunked_prefill_size": (96, "chunked_prefill_size", 96),
    "num_cpus_per_engine": (2.0, "num_threads", 2),
    "incremental_streaming_output": (True, "incremental_streaming_output", True),
    "routing_replay": (True, "enable_return_routed_experts", True),
    "cpu_args": (["--served-model-name", "propagated"], "served_model_name", "propagated"),
    "speculative": (True, "speculative_algorithm", "EAGLE"),
    "speculative_num_steps": (3, "speculative_num_steps", 3),
}
NOT_FOR_THE_ENGINE_PROCESS = {
    "backend": "the engine actor: which EngineBackend builds the command (tests/rollout/test_actor.py)",
    "num_engines": "the launcher: how many engine actors (tests/test_e2e_run.py runs two)",
    "num_gpus_per_engine": "Ray: each engine actor's GPU resources",
    "health_check_interval_s": "the engine actor's supervisor, which probes the engine",
    "health_check_timeout_s": "the engine actor's supervisor, which probes the engine",
    "sglang_args": "the SGLang backend's command only (tests/rollout/test_actor.py)",
    "sampling": "the orchestrator's section (test_every_field_of_every_service_section_arrives)",
    "api_key": "by environment ($ASYNCRL_ENGINE_API_KEY): checked below by the engine's 401",
}


def test_every_engine_setting_reaches_the_engine(tmp_path, tiny_checkpoint):
    """The engine takes SGLang's command line, which the rollout backend builds from RolloutConfig in the
    engine actor (rollout/backends.py): launch that command and read the engine's /server_info."""
    from asyncrl.process import spawn, terminate
    from rollout.backends import CpuBackend, LaunchSpec

    named = set(ENGINE_VALUES) | set(NOT_FOR_THE_ENGINE_PROCESS)
    assert {f.name for f in fields(RolloutConfig)} == named, "classify each RolloutConfig field here"
    cfg = RolloutConfig(api_key="engine-key", **{name: value for name, (value, _, _) in ENGINE_VALUES.items()})
    backend, port = CpuBackend(cfg), free_port()
    spec = LaunchSpec(model_path=str(tiny_checkpoint), host="127.0.0.1", port=port, weight_version="7",
                      log_path=tmp_path / "engine.log", seed=5)
    proc = spawn(backend.command(spec), spec.log_path, backend.environment())
    url, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer engine-key"}
    try:
        info = _wait_for_server_info(url, key, proc, spec.log_path)
        assert httpx.get(f"{url}/server_info", timeout=30).status_code == 401  # the key arrived too
        want = {"weight_version": "7", "random_seed": 5,
                **{key_: shown for _, key_, shown in ENGINE_VALUES.values()}}
        missing = [f"{k}: configured {v!r}, the engine has {info.get(k, '<missing>')!r}"
                   for k, v in want.items() if info.get(k, "<missing>") != v]
        assert missing == [], "settings that did not reach the engine:\n" + "\n".join(missing)
    finally:
        terminate(proc, 30)


def _wait_for_server_info(url: str, headers: dict, proc, log_path, timeout_s: float = 120.0) -> dict:
    def served() -> dict | None:
        assert proc.poll() is None, log_path.read_text()
        try:
            reply = httpx.get(f"{url}/server_info", headers=headers, timeout=5)
        except httpx.TransportError:
            return None
        return reply.json() if reply.status_code == 200 else None
    return wait_until(served, timeout_s, lambda: f"the engine did not serve: {log_path.read_text()[-2000:]}")


def test_a_training_run_refuses_sessions_that_record_nothing():
    with pytest.raises(ValueError, match="orchestrator.sessions=endpoint records no trajectories"):
        RunConfig(orchestrator=OrchestratorConfig(sessions="endpoint"))
