"""Runs one RL job from a composed RunConfig: Redis, Ray, engines, gateway, orchestrator, env
services and the trainer, wired by URL, until `total_steps`; then a clean shutdown.

    embedded Redis (when no redis.url) -> Ray (join or start) -> initial weights (+ warm-up)
      -> trainer actor (built while the rest starts) -> engines (Ray actors) -> gateway -> orchestrator
      -> env services -> trainer.run(total_steps)

Components are named by dotted path in `cfg.components` and imported only here, at run time (asyncrl
never imports a component statically). Services run as supervised processes inside Ray actors
(asyncrl.supervisor), so a crashed service is restarted and a killed actor is recreated by Ray.
The launcher exits 0 when the trainer reaches total_steps, or non-zero with a message naming the
component that failed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from redis.exceptions import RedisError

from asyncrl.config import RunConfig
from asyncrl.redis_server import EmbeddedRedis
from asyncrl.run_metrics import Collector
from asyncrl.store import store_call
from asyncrl.supervisor import ServiceActor

log = logging.getLogger("asyncrl.launcher")


class ComponentFailed(RuntimeError):
    def __init__(self, component: str, reason: str) -> None:
        super().__init__(f"{component} failed: {reason}")
        self.component = component


def load(path: str) -> Any:
    """`package.module.Name` -> the object (the launcher's only way to reach a component)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class Stopped(Exception):
    """SIGTERM (e.g. `ray job stop`, a timeout): unwind through the clean shutdown."""


def _raise_stopped(*_: object) -> None:
    raise Stopped()


def run(cfg: RunConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per status poll otherwise
    signal.signal(signal.SIGTERM, _raise_stopped)
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        redis_url = cfg.redis.url or _embedded_redis(cfg, run_dir, stack)
        (run_dir / "redis.url").write_text(redis_url)  # `asyncrl watch --run-dir` finds the run by it
        _start_ray(cfg, stack)
        job = Job(cfg, run_dir, redis_url)
        stack.callback(job.shutdown)
        try:
            job.start()
            job.wait()
        except ComponentFailed as err:
            log.error("asyncrl: %s", err)
            print(f"asyncrl: {err}", flush=True)
            return 1
        except (KeyboardInterrupt, Stopped) as err:
            log.warning("%s: shutting down", "interrupted" if isinstance(err, KeyboardInterrupt) else "SIGTERM")
            return 130 if isinstance(err, KeyboardInterrupt) else 143
    log.info("run %s finished %d steps", cfg.name, cfg.total_steps)
    return 0


def _embedded_redis(cfg: RunConfig, run_dir: Path, stack: ExitStack) -> str:
    server = EmbeddedRedis(cfg.redis.data_dir or run_dir / "redis", aof=cfg.redis.aof,
                           appendfsync=cfg.redis.appendfsync).start()
    stack.callback(server.stop)
    log.info("embedded redis-server at %s (AOF %s, appendfsync %s, data in %s)", server.url, cfg.redis.aof,
             cfg.redis.appendfsync, server.data_dir)
    return server.url


def _start_ray(cfg: RunConfig, stack: ExitStack) -> None:
    """Join the cluster of `ray job submit` / cfg.ray.address, else start a local one."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        ray.init(address=address, namespace=cfg.name, log_to_driver=False)  # the job's working_dir carries the code
    else:
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
        # "local": a fresh cluster of our own; with no address Ray would try the last cluster started on
        # this machine (/tmp/ray/ray_current_cluster), which may be dead or someone else's.
        local = {} if address else {"num_cpus": cfg.ray.num_cpus or os.cpu_count(), "include_dashboard": False}
        ray.init(address=address or "local", namespace=cfg.name, runtime_env={"env_vars": {"PYTHONPATH": path}},
                 log_to_driver=False, **local)
    stack.callback(ray.shutdown)


class Job:
    """The running components of one run, and how they are started, watched and stopped."""

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str) -> None:
        self.cfg, self.run_dir, self.redis_url = cfg, run_dir, redis_url
        self.engines: Any = None
        self.services: dict[str, Any] = {}
        self.trainer: Any = None
        self.training: Any = None
        self.collector: Optional[Collector] = None

    # Start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        model_path = self._initial_weights()
        # Ray builds the trainer (worker, torch, model, checkpoint: seconds) while the services start up;
        # it begins training once they serve.
        self._guard("trainer", lambda: self._create_trainer(model_path))
        self._guard("engines", lambda: self._start_engines(model_path))
        gateway = self._guard("gateway", self._start_gateway)
        orchestrator = self._guard("orchestrator", lambda: self._start_orchestrator(gateway))
        for env in cfg.envs.services:
            for replica in range(env.num_replicas):
                self._guard(f"env service {env.name}", lambda: self._start_env(env, replica, orchestrator))
        self._start_training()
        store_call(self.redis_url, self.cfg.name, lambda s: s.redis.hset(s.key("services"), mapping={
            "gateway": gateway, "orchestrator": orchestrator, "total_steps": str(cfg.total_steps),
            "mode": cfg.mode}))
        self.collector = Collector(self.redis_url, cfg.name, orchestrator, self.run_dir / "tensorboard").start()
        log.info("run %s: %s mode, gateway %s, orchestrator %s, %d env service(s); watch with "
                 "`asyncrl watch --run-dir %s`", cfg.name, cfg.mode, gateway, orchestrator,
                 sum(e.num_replicas for e in cfg.envs.services), self.run_dir)

    def _guard(self, component: str, start) -> Any:
        try:
            return start()
        except Exception as err:  # any start failure is reported with the component's name
            raise ComponentFailed(component, f"{type(err).__name__}: {err}") from err

    def _initial_weights(self) -> str:
        """An HF checkpoint directory the engines and the trainer start from."""
        cfg = self.cfg
        if cfg.warmup.steps > 0:
            out = self.run_dir / "warmup"
            if not (out / "config.json").exists():
                log.info("supervised warm-up: %d steps on %s", cfg.warmup.steps, cfg.warmup.env)
                load(cfg.components.warmup)(cfg.model, cfg.warmup, str(out), cfg.seed)
            return str(out)
        if cfg.model.path:
            return cfg.model.path
        out = self.run_dir / "init"
        if not (out / "config.json").exists():
            from asyncrl.model.io import save_pretrained
            from asyncrl.model.model import Glm5ForCausalLM

            save_pretrained(Glm5ForCausalLM.from_config(cfg.model.arch, seed=cfg.seed), out)
        return str(out)

    def _start_engines(self, model_path: str) -> None:
        tokenizer = None if self.cfg.model.tokenizer.startswith("builtin:") else self.cfg.model.tokenizer
        self.engines = load(self.cfg.components.engine_group)(
            self.cfg.rollout, model_path, self.redis_url, self.cfg.name, str(self.run_dir / "engines"),
            self.cfg.seed, tokenizer)
        self.engines.urls()

    def _service(self, name: str, module: str, args: list[str], env: Optional[dict[str, str]] = None) -> str:
        import ray

        actor = ray.remote(ServiceActor).options(name=f"{self.cfg.name}-{name}", num_cpus=0, max_restarts=-1,
                                                 max_task_retries=3, max_concurrency=4)
        handle = actor.remote(name, module, args, str(self.run_dir / "services"), env)
        self.services[name] = handle
        return ray.get(handle.url.remote(), timeout=300)

    def _start_gateway(self) -> str:
        g = self.cfg.gateway
        args = ["--redis-url", self.redis_url, "--run", self.cfg.name, "--tokenizer", self.cfg.model.tokenizer,
                "--engine-timeout-s", str(g.engine_timeout_s), "--health-interval-s", str(g.health_interval_s),
                "--load-factor", str(g.load_factor), "--max-request-bytes", str(g.max_request_bytes)]
        args += ["--engines-from-redis"] + ([] if g.thinking else ["--no-thinking"])
        args += ["--routing-replay"] if self.cfg.rollout.routing_replay else []
        for url in self.engines.urls():
            args += ["--engine", url]
        return self._service("gateway", self.cfg.components.gateway, args, _token_env("ASYNCRL_GATEWAY_TOKEN", g.auth_token))

    def _start_orchestrator(self, gateway: str) -> str:
        cfg = self.cfg
        env = {**_token_env("ASYNCRL_ORCHESTRATOR_TOKEN", cfg.orchestrator.auth_token),
               **_token_env("ASYNCRL_GATEWAY_TOKEN", cfg.gateway.auth_token)}
        return self._service("orchestrator", cfg.components.orchestrator, orchestrator_args(cfg, self.redis_url, gateway),
                             env)

    def _start_env(self, env, replica: int, orchestrator: str) -> str:
        args = ["--env", env.target, "--orchestrator", orchestrator, "--capacity", str(env.capacity),
                "--weight", str(env.weight)]
        if env.domain:
            args += ["--domain", env.domain]
        for key, value in env.options.items():
            args += ["--option", f"{key}={value}"]
        args += list(env.serve_args)
        return self._service(f"env-{env.name}-{replica}", self.cfg.components.env_service, args,
                             _token_env("ASYNCRL_ORCHESTRATOR_TOKEN", self.cfg.orchestrator.auth_token))

    def _create_trainer(self, model_path: str) -> None:
        import ray

        cfg = self.cfg
        trainer_cfg = cfg.trainer
        if cfg.mode == "sync":  # generate a batch, train, push, checkpoint: then the next batch starts
            trainer_cfg = replace(trainer_cfg, checkpoint_every=1,
                                  weight_push=replace(trainer_cfg.weight_push, every_k_steps=1))
        model = replace(cfg.model, path=model_path)
        actor = ray.remote(load(cfg.components.trainer)).options(
            name=f"{cfg.name}-trainer", num_cpus=cfg.trainer_resources.num_cpus,
            num_gpus=cfg.trainer_resources.num_gpus, max_concurrency=4, max_restarts=cfg.trainer_restarts)
        self.trainer = actor.remote(trainer_cfg, model, self.redis_url, cfg.name, str(self.run_dir), cfg.seed,
                                    retention_groups=cfg.redis.retention_groups)

    def _start_training(self) -> None:
        self.training = self.trainer.run.remote(self.cfg.total_steps)

    # Watch ----------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Until the trainer returns; a component that cannot be brought back fails the run."""
        import ray

        last_report, restarts = 0.0, 0
        while True:
            done, _ = ray.wait([self.training], timeout=5.0)
            if done:
                try:
                    ray.get(self.training)
                    return
                except ray.exceptions.RayActorError as err:  # the trainer process died: Ray restarts it
                    restarts += 1
                    if restarts > self.cfg.trainer_restarts:
                        raise ComponentFailed("trainer", _first_line(err)) from err
                    log.warning("trainer died (%s); waiting for Ray to restart it", _first_line(err))
                    self._await_restarted_trainer()
                    log.warning("trainer restarted; it resumes from its last checkpoint")
                    self.training = self.trainer.run.remote(self.cfg.total_steps)
                except ray.exceptions.RayError as err:
                    raise ComponentFailed("trainer", _first_line(err)) from err
            self._check_services()
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                self._report_progress()

    def _await_restarted_trainer(self) -> None:
        """Until Ray has brought the dead trainer actor back. Calls sent while it restarts fail at once
        (ActorUnavailableError); resubmitting the run at once and counting each of those as a death would
        spend the whole restart budget on one death when a restart is slow (a loaded machine)."""
        import ray

        timeout_s = self.cfg.trainer_restart_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self.trainer.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise ComponentFailed("trainer", f"not restarted within {timeout_s:g} s") from err
                time.sleep(0.5)
            except ray.exceptions.RayActorError as err:  # died for good (out of restarts)
                raise ComponentFailed("trainer", f"not restarted: {_first_line(err)}") from err

    def _check_services(self) -> None:
        import ray

        for name, handle in self.services.items():
            try:
                ray.get(handle.status.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                raise ComponentFailed(name, _first_line(err)) from err

    def _report_progress(self) -> None:
        try:
            records = store_call(self.redis_url, self.cfg.name, lambda s: s.read_metrics(count=100_000),
                                 retry_s=0)
        except (RedisError, OSError) as err:  # a report is not worth failing the run, nor a wait
            log.warning("progress report skipped: reading metrics from Redis failed (%r)", err)
            return
        steps = [values for _, source, values in records if source == "trainer"]
        if steps:
            last = steps[-1]
            log.info("step %d/%d: reward %.3f, loss %.4f, weight version %d, staleness %.2f", int(last["step"]),
                     self.cfg.total_steps, last["reward_mean"], last["loss"], int(last["weight_version"]),
                     last["staleness_mean"])

    # Stop -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Reverse order: stop producing work, then the consumers, then the engines."""
        import ray

        if self.collector is not None:
            _quietly(self.collector.stop)
        if self.trainer is not None:
            _quietly(lambda: ray.get(self.trainer.close.remote(), timeout=60))
        for name in sorted(self.services, key=lambda n: (n != "orchestrator", n.startswith("gateway"))):
            handle = self.services[name]
            _quietly(lambda: ray.get(handle.shutdown.remote(), timeout=60))
            _quietly(lambda: ray.kill(handle, no_restart=True))
        if self.engines is not None:
            _quietly(self.engines.shutdown)


def orchestrator_args(cfg: RunConfig, redis_url: str, gateway: str) -> list[str]:
    """The orchestrator's command line for this run (the same in both modes but for the staleness limit)."""
    o = cfg.orchestrator
    # Staleness rule (AReaL's): group n starts only while n < (version + limit + 1) * groups per version.
    # sync mode is limit 0: one batch per weight version, generated after the previous push.
    staleness = 0 if cfg.mode == "sync" else cfg.trainer.staleness_tau
    groups_per_version = cfg.trainer.groups_per_step * cfg.trainer.weight_push.every_k_steps
    args = ["--redis-url", redis_url, "--run", cfg.name, "--gateway", gateway,
            "--max-in-flight", str(o.max_in_flight), "--group-size", str(o.group_size),
            "--max-attempts", str(o.max_attempts), "--max-turns", str(o.max_turns),
            "--max-unconsumed-groups", str(o.max_unconsumed_groups), "--staleness-limit", str(staleness),
            "--groups-per-step", str(groups_per_version),
            "--heartbeat-interval-s", str(o.heartbeat_interval_s), "--heartbeat-timeout-s", str(o.heartbeat_timeout_s),
            "--episode-timeout-s", str(o.episode_timeout_s), "--seed", str(cfg.seed),
            "--sampling", json.dumps(asdict(cfg.rollout.sampling))]
    if o.dynamic_sampling.enabled:
        args += ["--dynamic-sampling", "--dynamic-sampling-std-tol", str(o.dynamic_sampling.std_tol),
                 "--dynamic-sampling-max-filtered-batches", str(o.dynamic_sampling.max_filtered_batches)]
    if o.domain_weights:
        args += ["--weights", ",".join(f"{k}={v}" for k, v in o.domain_weights.items())]
    if o.rate_limits:
        args += ["--rate-limits", ",".join(f"{k}={v}" for k, v in o.rate_limits.items())]
    return args


def _token_env(name: str, token: Optional[str]) -> dict[str, str]:
    return {name: token} if token else {}


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as err:  # shutdown continues past a component that is already gone
        log.warning("shutdown: %s", _first_line(err))
