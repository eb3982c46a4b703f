"""Runs one RL job from a composed RunConfig: Redis, Ray, engines, gateway, orchestrator, env
services and the trainer, wired by URL, until `total_steps`; then a clean shutdown.

    Ray (join or start) -> embedded Redis (when no redis.url) -> initial weights (+ warm-up)
      -> trainer actor (built while the rest starts) -> engines (Ray actors) -> gateway -> orchestrator
      -> env services -> trainer.run(total_steps)

Components are named by import path in `cfg.components` and imported at run time, so a run config can
swap one for another. Services run as supervised processes inside Ray actors
(asyncrl.supervisor), so a crashed service is restarted and a killed actor is recreated by Ray.
Each service gets its resolved config section as `--config <run_dir>/config/<name>.json` (secrets by
environment variable; docs/run.md "One config path into every service"), carried by its actor to the
node it runs on. Across hosts (cfg.cluster, docs/run.md "A run across hosts") every service binds
cluster.host and publishes its node's address, each component's actors go where cluster.placement
says, and nothing assumes a shared disk unless cluster.shared_fs says so.
The launcher exits 0 when the trainer reaches total_steps, or non-zero with a message naming the
component that failed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from redis.exceptions import RedisError

from asyncrl.auth import bearer_headers
from asyncrl.config import (ENGINE_API_KEY_ENV, EnvServiceConfig, GatewayConfig, OrchestratorConfig, RunConfig,
                            TrainerConfig, section_data, write_section)
from asyncrl.network import is_loopback
from asyncrl.node_files import pack_dir
from asyncrl.plugins import load_object
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from asyncrl.store import store_call
from asyncrl.supervisor import ServiceActor
from asyncrl_run import leftovers
from asyncrl_run.redis_server import EmbeddedRedis
from asyncrl_run.run_metrics import Collector, TensorBoardMirror
from asyncrl_run.run_summary import RunSummary, format_duration, summarize
from asyncrl_run.stall import STATUS_STALE_S, idle_s, stall_cause

if TYPE_CHECKING:
    from asyncrl_run.wandb_mirror import WandbMirror

log = logging.getLogger("asyncrl_run.launcher")


class ComponentFailed(RuntimeError):
    def __init__(self, component: str, reason: str) -> None:
        super().__init__(f"{component} failed: {reason}")
        self.component = component


class StopSignals:
    """Ctrl-C and SIGTERM (`ray job stop`, a timeout, `kill`) unwind the launcher through its clean
    shutdown as a KeyboardInterrupt (what Ray's blocking calls expect; Ray re-raises a fresh one, so
    which signal came is kept here, for the exit code)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None

    def install(self) -> None:
        """At start, and again after ray.init: its core worker installs a SIGTERM handler of its own (a
        crash banner, then abort)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._raise)

    def ignore(self) -> None:
        """While shutting down: a second Ctrl-C must not cut the shutdown short and leave processes behind."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def _raise(self, signum: int, _frame: object) -> None:
        self.received = signum
        raise KeyboardInterrupt()

    def _note(self, signum: int, _frame: object) -> None:
        log.warning("%s: already stopping (within %.0f s)", signal.Signals(signum).name, STOP_BUDGET_S)


STOP_BUDGET_S = 15.0
"""Ctrl-C / SIGTERM to exit, every process of the run gone (the trainer gets TRAINER_STOP_S of it)."""
TRAINER_STOP_S = 5.0
"""How long an interrupted run lets the trainer finish its step and checkpoint; after that it is killed
and its unacknowledged groups are trained again by the next run (nothing is lost either way)."""
FINISH_BUDGET_S = 120.0
"""Shutdown after the last step: no hurry, every service drains."""


def run(cfg: RunConfig, experiment: Optional[str] = None) -> int:
    """-> the exit code: 0 done, 1 a component failed, 130 Ctrl-C, 143 SIGTERM. `experiment`: the
    experiment the config was composed from (for the eval command the summary prints)."""
    started = time.monotonic()
    run_dir = resolve_run_dir(cfg.run_dir)
    _configure_logging(run_dir)
    try:
        leftovers.stop_leftovers(run_dir)  # of a killed launcher, before anything of this run starts
    except RuntimeError as err:
        log.error("asyncrl: %s", err)
        print(f"asyncrl: {err}", flush=True)
        return 1
    _prepare_run_dir(cfg, run_dir)
    signals = StopSignals()
    signals.install()
    with ExitStack() as stack:
        job: Optional[Job] = None
        interrupted = True
        try:
            _start_ray(cfg, stack)  # first: the embedded Redis of a run across hosts publishes the node's address
            signals.install()
            redis_url, embedded = _redis_for(cfg, run_dir, stack)
            (run_dir / "redis.url").write_text(redis_url)  # `asyncrl watch --run-dir` finds the run by it
            job = Job(cfg, run_dir, redis_url, embedded)
            job.start()
            leftovers.record(run_dir)  # what a killed launcher would leave for the next launch to stop
            job.wait()
            interrupted = False
            summary = job.summary(time.monotonic() - started, experiment)
        except ComponentFailed as err:
            log.error("asyncrl: %s", err)
            print(f"asyncrl: {err}", flush=True)
            return 1
        except KeyboardInterrupt:
            code = signals.exit_code
            log.warning("%s: stopping the run (exit %d); re-run the same command to resume",
                        "SIGTERM" if code == 143 else "interrupted", code)
            return code
        finally:
            signals.ignore()
            if job is not None:
                job.shutdown(interrupted)
    path = summary.write(run_dir)
    for line in summary.lines():
        log.info("%s", line)
    log.info("summary in %s", path)
    return 0


def resolve_run_dir(run_dir: Optional[str]) -> Path:
    """Absolute. Under `ray job submit` the working directory is Ray's temporary copy of the package
    (deleted with the session), so a relative run_dir goes under $ASYNCRL_HOME (default ~/asyncrl)."""
    path = Path(run_dir or "runs/asyncrl")
    if not path.is_absolute() and os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        path = Path(os.environ.get("ASYNCRL_HOME", Path.home() / "asyncrl")) / path
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _configure_logging(run_dir: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per status poll otherwise
    handler = logging.FileHandler(run_dir / "launcher.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    log.info("run dir %s (logs: launcher.log, trainer.log, services/, engines/)", run_dir)


def _prepare_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    """resume=false: an existing run dir is moved aside (never deleted) and the run starts afresh;
    else the run resumes from what the dir holds (the trainer announces its checkpoint's step)."""
    held = [p.name for p in run_dir.iterdir() if p.name not in ("launcher.log", "hydra")]
    if not held:
        return
    if cfg.resume:
        log.info("run dir %s holds a previous run (%s): resuming it; resume=false starts afresh", run_dir,
                 ", ".join(sorted(held)))
        return
    archive = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    archive.mkdir()
    for name in held:
        (run_dir / name).rename(archive / name)
    log.warning("resume=false: moved the previous run's files to %s; starting afresh", archive)
    if cfg.redis.url:
        deleted = store_call(cfg.redis.url, cfg.name, lambda s: s.delete_run())
        log.warning("resume=false: deleted the run's %d keys from %s", deleted, cfg.redis.url)


def _redis_for(cfg: RunConfig, run_dir: Path, stack: ExitStack) -> tuple[str, Optional[EmbeddedRedis]]:
    """The run's Redis URL, and the embedded server behind it (None where `redis.url` names one of the user's)."""
    if cfg.redis.url:
        return cfg.redis.url, None
    server = EmbeddedRedis(cfg.redis.data_dir or run_dir / "redis", aof=cfg.redis.aof,
                           appendfsync=cfg.redis.appendfsync, host=cfg.cluster.host or "127.0.0.1").start()
    stack.callback(server.stop)
    log.info("embedded redis-server at %s (AOF %s, appendfsync %s, data in %s)", server.url, cfg.redis.aof,
             cfg.redis.appendfsync, server.data_dir)
    return server.url, server


LOOPBACK_ONLY_RAY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, Ray takes 127.0.0.1 as the node's address, and each of its servers binds
loopback when the node's address is loopback (GCS, raylet, object manager, workers, the agents and their
Prometheus endpoints); otherwise they bind 0.0.0.0 (Ray 2.60: docs/run.md "What listens where")."""


def _start_ray(cfg: RunConfig, stack: ExitStack) -> None:
    """Join the cluster of `ray job submit` / cfg.ray.address, else start a local one."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") and is_loopback(cfg.cluster.host):
        os.environ.setdefault(LOOPBACK_ONLY_RAY, "0")  # a cluster of this machine alone: Ray on loopback
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        ray.init(address=address, namespace=cfg.name, log_to_driver=False)  # the job's working_dir carries the code
    else:
        # The run's working directory too: env classes of the user's own (`target: my_pkg.MyEnv`) import from it.
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(dict.fromkeys(filter(None, [repo, os.getcwd(), os.environ.get("PYTHONPATH")])))
        # "local": a fresh cluster of our own; with no address Ray would try the last cluster started on
        # this machine (/tmp/ray/ray_current_cluster), which may be dead or someone else's.
        local = {} if address else {"num_cpus": cfg.ray.num_cpus or os.cpu_count(), "include_dashboard": False}
        ray.init(address=address or "local", namespace=cfg.name, runtime_env={"env_vars": {"PYTHONPATH": path}},
                 log_to_driver=False, **local)
    stack.callback(ray.shutdown)


class Job:
    """The running components of one run, and how they are started, watched and stopped."""

    def __init__(self, cfg: RunConfig, run_dir: Path, redis_url: str, embedded: Optional[EmbeddedRedis] = None) -> None:
        self.cfg, self.run_dir, self.redis_url = cfg, run_dir, redis_url
        self.embedded = embedded
        """The run's own redis-server (no redis.url): restarted from its AOF if it dies (`_revive_redis`)."""
        self.engines: Any = None
        self.services: dict[str, Any] = {}
        self.trainer: Any = None
        self.training: Any = None
        self.collector: Optional[Collector] = None
        self.wandb: Optional[WandbMirror] = None
        """The W&B run (wandb.enabled); the collector closes it, or shutdown when no collector started."""
        self.redis_restarts = 0
        self.resumed_from = 0
        self.shipped_weights: Optional[list] = None
        """[ObjectRef] of the initial weights, on a cluster of several nodes without a shared filesystem."""
        self.started_at = time.time()
        """Unix time the launch began (also the `services` hash's started_at: `asyncrl watch`'s elapsed time)."""
        self.training_started = time.monotonic()
        self.training_started_at = self.started_at
        """Unix time the trainer began this launch's steps, after any warm-up: idle time counts from here."""

    # Start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        for env in cfg.envs.services.values():
            self._guard(f"env service {env.name}", lambda: env_interpreter(env))  # a wrong path fails before any start
        multi_node = self._guard("cluster", self._check_cluster)
        model_path = self._initial_weights()
        if multi_node and not cfg.cluster.shared_fs:
            self._ship_weights(model_path)
        # Ray builds the trainer (worker, torch, model, checkpoint: seconds) while the services start up;
        # it begins training once they serve.
        self._guard("trainer", lambda: self._create_trainer(model_path))
        # The checkpoints are on the trainer's node: with no shared disk, only the trainer can say (it waits for it)
        may_resume = (self.run_dir / "checkpoints").is_dir() or self.shipped_weights is not None
        if may_resume and self._announce_resume() >= cfg.total_steps:
            return  # nothing to train: wait() returns at once, the summary says what the run did
        if cfg.wandb.enabled:  # before the services: a W&B that cannot log in fails the run in seconds
            self.wandb = self._guard("wandb", self._start_wandb)
        self._guard("engines", lambda: self._start_engines(model_path))
        gateway = self._guard("gateway", self._start_gateway)
        orchestrator = self._guard("orchestrator", lambda: self._start_orchestrator(gateway))
        for env in cfg.envs.services.values():
            for replica in range(env.num_replicas):
                self._guard(f"env service {env.name}", lambda: self._start_env(env, replica, orchestrator))
        self._start_training()
        store_call(self.redis_url, self.cfg.name, lambda s: s.redis.hset(s.key("services"), mapping={
            "gateway": gateway.split(",")[0], "gateways": gateway, "orchestrator": orchestrator,
            "total_steps": str(cfg.total_steps),
            "mode": cfg.mode, "started_at": str(self.started_at), "training_started_at": str(self.training_started_at)}))
        mirrors = [TensorBoardMirror(self.run_dir / "tensorboard")] + ([self.wandb] if self.wandb else [])
        self.collector = Collector(self.redis_url, cfg.name, orchestrator, mirrors,
                                   headers=bearer_headers(cfg.orchestrator.auth_token), scrape_to=self.wandb,
                                   gateway_headers=bearer_headers(cfg.gateway.auth_token)).start()
        log.info("run %s: %s mode, gateway %s, orchestrator %s, %d env service(s); watch with "
                 "`asyncrl watch --run-dir %s`", cfg.name, cfg.mode, gateway, orchestrator,
                 sum(e.num_replicas for e in cfg.envs.services.values()), self.run_dir)

    def _start_wandb(self) -> WandbMirror:
        """The W&B run, with the resolved run config (section_data: secrets left out)."""
        from asyncrl_run.wandb_mirror import WandbMirror  # wandb is imported only by runs that log to it

        return WandbMirror(self.cfg.wandb, self.cfg.name, self.run_dir, section_data(self.cfg))

    def _announce_resume(self) -> int:
        """Say what a re-run found and what it does with it; -> the step it resumes from."""
        import ray

        step = self._guard("trainer", lambda: ray.get(self.trainer.resumed_from.remote(), timeout=600))
        if step == 0:  # a fresh start
            return 0
        unacked, unread = store_call(self.redis_url, self.cfg.name, _group_counts)
        if step >= self.cfg.total_steps:
            log.info("run %s already finished %d steps (checkpoint step %d): nothing to train; raise "
                     "total_steps to train on, or resume=false to start afresh", self.cfg.name, self.cfg.total_steps, step)
        else:
            log.info("resuming run %s from its step-%d checkpoint (%d/%d steps to go); Redis holds %d groups "
                     "delivered but not acknowledged (trained again) and %d not read yet", self.cfg.name, step,
                     self.cfg.total_steps - step, self.cfg.total_steps, unacked - unread, unread)
        self.resumed_from = step
        return step

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
                load_object(cfg.components.warmup)(cfg.model, cfg.warmup, str(out), cfg.seed)
            return str(out)
        if cfg.model.path:
            return cfg.model.path
        out = self.run_dir / "init"
        if not (out / "config.json").exists():
            from asyncrl.model.io import save_pretrained
            from asyncrl.model.model import Glm5ForCausalLM

            save_pretrained(Glm5ForCausalLM.from_config(cfg.model.arch, seed=cfg.seed), out)
        return str(out)

    def _check_cluster(self) -> bool:
        """-> whether the Ray cluster has several nodes. There, refuse services on loopback and, without a shared
        filesystem, a disk push (engines on other nodes cannot read the trainer's snapshots)."""
        import ray

        cluster = self.cfg.cluster
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        if len(nodes) < 2:
            return False
        if cluster.host is None:
            raise ValueError(f"this Ray cluster has {len(nodes)} nodes ({', '.join(nodes)}), and with cluster.host "
                             "unset every service binds 127.0.0.1, which the other nodes cannot reach: set "
                             "cluster.host=0.0.0.0 (or cluster.host=127.0.0.1 if cluster.placement keeps the whole "
                             "run on one node)")
        if self.cfg.trainer.weight_push.method == "disk" and not cluster.shared_fs:
            raise ValueError("trainer.weight_push.method=disk hands the engines a path on the trainer's disk, and "
                             f"this Ray cluster has {len(nodes)} nodes ({', '.join(nodes)}) that do not share one "
                             "(cluster.shared_fs=false): use trainer.weight_push.method=tensor (over HTTP) or "
                             "distributed (a broadcast group), or set cluster.shared_fs=true if the run dir "
                             f"({self.run_dir}) is on a filesystem every node mounts at that path")
        log.info("Ray cluster of %d nodes: %s; services bind %s", len(nodes), ", ".join(nodes), cluster.host)
        return True

    def _ship_weights(self, model_path: str) -> None:
        """The initial weights into Ray's object store, for the engine and trainer nodes that lack this disk."""
        import ray

        if not Path(model_path).is_dir():  # not a local checkpoint (a hub id): each engine resolves it itself
            return
        self.shipped_weights = [ray.put(pack_dir(model_path))]
        log.info("no shared filesystem: the initial weights %s travel to the engines' and the trainer's nodes "
                 "through Ray's object store", model_path)

    def _start_engines(self, model_path: str) -> None:
        tokenizer = None if self.cfg.model.tokenizer.startswith("builtin:") else self.cfg.model.tokenizer
        self.engines = load_object(self.cfg.components.engine_group)(
            self.cfg.rollout, model_path, self.redis_url, self.cfg.name, str(self.run_dir / "engines"),
            self.cfg.seed, tokenizer, **_set_only(bind_host=self.cfg.cluster.host,
                                                  resources=self.cfg.cluster.placement.engines,
                                                  shipped_weights=self.shipped_weights))
        self.engines.urls()

    def _service(self, name: str, module: str, args: list[str], resources: dict[str, float],
                 env: Optional[dict[str, str]] = None, port: int = 0, python: Optional[str] = None) -> str:
        """A supervised `python -m module args` in a Ray actor on a node with `resources` (cluster.placement),
        bound to `port` (0: a free one) -> its URL; `python`: another interpreter than the run's. Its config
        file travels with the actor (its node may not share this disk)."""
        import ray

        actor = ray.remote(ServiceActor).options(name=f"{self.cfg.name}-{name}", num_cpus=0, resources=dict(resources),
                                                 max_restarts=-1, max_task_retries=3, max_concurrency=4)
        handle = actor.remote(name, module, args, str(self.run_dir / "services"), env, port, python,
                              config_files(args))
        self.services[name] = handle
        return ray.get(handle.url.remote(), timeout=300)

    def _start_gateway(self) -> str:
        """The gateway, or gateway.replicas of them (`gateway`, `gateway-1`, ...) -> their URLs, comma-separated
        (the orchestrator's gateway_url: it places sessions among them)."""
        g = self.cfg.gateway
        args = write_config(self.run_dir, "gateway", gateway_section(self.cfg, self.redis_url, self.engines.urls()))
        env = {**_token_env("ASYNCRL_GATEWAY_TOKEN", g.auth_token), **_token_env(ENGINE_API_KEY_ENV, self.cfg.rollout.api_key)}
        return ",".join(self._service("gateway" if i == 0 else f"gateway-{i}", self.cfg.components.gateway, args,
                                      self.cfg.cluster.placement.gateway, env, g.port + i if g.port else 0)
                        for i in range(g.replicas))

    def _start_orchestrator(self, gateway: str, section: Optional[OrchestratorConfig] = None) -> str:
        """The orchestrator, with its resolved section (None: the training run's, orchestrator_section)."""
        cfg = self.cfg
        env = {**_token_env("ASYNCRL_ORCHESTRATOR_TOKEN", cfg.orchestrator.auth_token),
               **_token_env("ASYNCRL_GATEWAY_TOKEN", cfg.gateway.auth_token),
               **_token_env(SERVICE_TOKEN_ENV, cfg.envs.auth_token)}
        args = write_config(self.run_dir, "orchestrator", section or orchestrator_section(cfg, self.redis_url, gateway))
        return self._service("orchestrator", cfg.components.orchestrator, args, cfg.cluster.placement.orchestrator,
                             env, cfg.orchestrator.port)

    def _start_env(self, env: EnvServiceConfig, replica: int, orchestrator: Optional[str]) -> str:
        """One replica of an env service, from its section (<run_dir>/config/env-<name>.json); it registers
        under the section's name with `orchestrator` (None: it does not, and is called directly, as
        `asyncrl eval` does). With no domain configured the service takes its class's `domain`, else its name."""
        if replica == 0 and env.sandbox == "local_unsafe":
            log.warning("UNSAFE SANDBOX: env service %s (%s) is configured with sandbox local_unsafe: if its agents "
                        "run commands or code (a tool-using env, requires_sandbox), they run WITHOUT isolation, as "
                        "the service's user, with network access and its files (the service's log says whether it "
                        "does); set envs.services.%s.sandbox=namespace to isolate them", env.name, env.target, env.name)
        return self._service(f"env-{env.name}-{replica}", self.cfg.components.env_service,
                             env_service_args(self.run_dir, env, orchestrator, self.cfg.cluster.host),
                             self.cfg.cluster.placement.envs,
                             {**_token_env("ASYNCRL_ORCHESTRATOR_TOKEN", self.cfg.orchestrator.auth_token),
                              **_token_env(SERVICE_TOKEN_ENV, self.cfg.envs.auth_token)},
                             python=env_interpreter(env))

    def _create_trainer(self, model_path: str) -> None:
        import ray

        cfg = self.cfg
        trainer_cfg = trainer_config(cfg)
        model = replace(cfg.model, path=model_path)
        actor = ray.remote(load_object(cfg.components.trainer)).options(
            name=f"{cfg.name}-trainer", num_cpus=cfg.trainer_resources.num_cpus,
            num_gpus=cfg.trainer_resources.num_gpus, resources=dict(cfg.cluster.placement.trainer), max_concurrency=4,
            max_restarts=cfg.trainer_restarts)
        self.trainer = actor.remote(trainer_cfg, model, self.redis_url, cfg.name, str(self.run_dir), cfg.seed,
                                    retention_groups=cfg.redis.retention_groups,
                                    log_file=str(self.run_dir / "trainer.log"),
                                    **_set_only(shipped_weights=self.shipped_weights))

    def _start_training(self) -> None:
        self.training = self.trainer.run.remote(self.cfg.total_steps)
        self.training_started, self.training_started_at = time.monotonic(), time.time()

    # Watch ----------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Until the trainer returns; a component that cannot be brought back fails the run."""
        import ray

        last_report = last_check = time.monotonic()
        restarts = 0
        while self.training is not None:
            done, _ = ray.wait([self.training], timeout=1.0)  # short: Ctrl-C is seen within a second
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
            self._revive_redis()
            if time.monotonic() - last_check > SERVICE_CHECK_EVERY_S:
                last_check = time.monotonic()
                self._check_services()
            if time.monotonic() - last_report > PROGRESS_EVERY_S:
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

    def _revive_redis(self) -> None:
        """A dead embedded redis-server is started again on its address from its AOF; every component's
        Redis client retries its commands meanwhile (trainer.redis_retry_s and the services' own retries).
        Writes that redis acknowledged but had not appended to the AOF yet are lost with appendfsync
        everysec (redis.appendfsync: `always` loses none); their writers count them (summary.json
        `lost_to_redis`)."""
        code = self.embedded.died() if self.embedded else None
        if code is None:
            return
        self.redis_restarts += 1
        log.warning("embedded redis-server died (exit code %s): restarting it from its AOF at %s (restart %d)", code,
                    self.redis_url, self.redis_restarts)
        started = time.monotonic()
        try:
            self.embedded.revive()
        except RuntimeError as err:
            raise ComponentFailed("redis-server", f"died (exit code {code}) and could not be restarted: {err}") from err
        log.warning("embedded redis-server back after %.1f s", time.monotonic() - started)

    def _check_services(self) -> None:
        import ray

        for name, handle in self.services.items():
            try:
                status = ray.get(handle.status.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                raise ComponentFailed(name, _first_line(err)) from err
            if status.get("failure"):
                raise ComponentFailed(name, status["failure"])

    def _report_progress(self) -> None:
        """One line every PROGRESS_EVERY_S: where training is, how fast, and what holds it up if nothing
        moves (a stall names the component and its reason instead of repeating the same step)."""
        try:
            records = store_call(self.redis_url, self.cfg.name, lambda s: s.read_metrics(count=100_000),
                                 retry_s=0)
        except (RedisError, OSError) as err:  # a report is not worth failing the run, nor a wait
            log.warning("progress report skipped: reading metrics from Redis failed (%r)", err)
            return
        steps = [(_stream_time(sid), values) for sid, source, values in records if source == "trainer"]
        status = self.collector.status if self.collector else None
        line = progress_line(self.cfg.total_steps, self.resumed_from, [v for _, v in steps], status,
                             time.monotonic() - self.training_started)
        idle, stall_after = idle_s(time.time(), self.training_started_at, [t for t, _ in steps])
        status_age_s = self.collector.status_age_s() if self.collector else 0.0
        if status is not None and status_age_s > STATUS_STALE_S:
            line += f" (rollout figures {format_duration(status_age_s)} old: the orchestrator does not answer)"
        limit = self.cfg.stall_limit_s
        if idle <= stall_after and not (limit and idle > limit):
            log.info("%s", line)
            return
        component, why = stall_cause(status, status_age_s)
        log.warning("%s; STALLED: no step for %.0f s: %s: %s", line, idle, component, why)
        if limit and idle > limit:
            raise ComponentFailed(component, f"no training step for {format_duration(idle)} (stall_limit_s "
                                             f"{limit:g}): {why}")

    def summary(self, wall_s: float, experiment: Optional[str]) -> RunSummary:
        records = store_call(self.redis_url, self.cfg.name, lambda s: s.read_metrics(count=1_000_000))
        trainer = [values for _, source, values in records if source == "trainer"]
        status = self.collector.final_status() if self.collector else None
        return summarize(self.cfg.name, self.run_dir, self.cfg.total_steps, wall_s, trainer, status, experiment)

    # Stop -----------------------------------------------------------------------------------------
    def shutdown(self, interrupted: bool) -> None:
        """Stop producing work (orchestrator), then the trainer and the other services, then the engines.
        Interrupted: within STOP_BUDGET_S in all (the trainer may finish its step and checkpoint for
        TRAINER_STOP_S, then it is killed); after the last step: up to FINISH_BUDGET_S."""
        import ray

        # 3 s of the budget are left for ray.shutdown and Redis (the ExitStack after this)
        deadline = time.monotonic() + (STOP_BUDGET_S - 3 if interrupted else FINISH_BUDGET_S)
        grace_s = 3.0 if interrupted else 20.0
        took, mark = {}, time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            took[name], mark = time.monotonic() - mark, time.monotonic()

        if self.collector is not None:  # the services' last /metrics, while they all still answer
            _quietly(lambda: self.collector.collect_now(timeout_s=2 if interrupted else 15))
        phase("last scrape")
        orchestrator = [h for name, h in self.services.items() if name == "orchestrator"]
        self._stop_services(orchestrator, grace_s, deadline)
        phase("orchestrator")
        # after the orchestrator: its last metrics record (written as it stops) reaches the mirrors; after the
        # last step the W&B run may take a while to finish (an upload in online mode)
        if self.collector is not None:
            _quietly(lambda: self.collector.stop(timeout_s=2 if interrupted else 30))
        elif self.wandb is not None:  # a start that failed after the W&B run began
            _quietly(self.wandb.close)
        phase("metrics")
        if self.trainer is not None:
            self._stop_trainer(TRAINER_STOP_S if interrupted else max(1.0, deadline - time.monotonic()))
        phase("trainer")
        self._stop_services([h for name, h in self.services.items() if name != "orchestrator"], grace_s, deadline)
        phase("services")
        if self.engines is not None:
            _quietly(lambda: self.engines.shutdown(grace_s, max(1.0, deadline - time.monotonic())))
        phase("engines")
        log.info("stopped: %s", ", ".join(f"{name} {s:.1f} s" for name, s in took.items()))

    def _stop_trainer(self, grace_s: float) -> None:
        """Ask the trainer to stop (it checkpoints what it trained); kill it if it takes longer than
        `grace_s`: its unacknowledged groups are delivered again to the next run."""
        import ray

        if self.training is not None:
            _quietly(lambda: ray.get(self.trainer.request_stop.remote(), timeout=grace_s))
            done, _ = ray.wait([self.training], timeout=grace_s)
            if not done:
                log.warning("trainer still busy after %.0f s: killed; its unacknowledged groups are trained "
                            "again on resume", grace_s)
        _quietly(lambda: ray.get(self.trainer.close.remote(), timeout=2))
        _quietly(lambda: ray.kill(self.trainer, no_restart=True))

    @staticmethod
    def _stop_services(handles: list, grace_s: float, deadline: float) -> None:
        """SIGTERM each service's process (in parallel), then kill its actor."""
        import ray

        if not handles:
            return
        stops = [h.shutdown.remote(grace_s) for h in handles]
        ray.wait(stops, num_returns=len(stops), timeout=max(1.0, deadline - time.monotonic()))
        for handle in handles:
            _quietly(lambda: ray.kill(handle, no_restart=True))


PROGRESS_EVERY_S = 30.0
SERVICE_CHECK_EVERY_S = 5.0


def progress_line(total_steps: int, resumed_from: int, steps: list[dict[str, float]], status: Optional[dict],
                  training_s: float) -> str:
    """`step 12/150 (8%), 1m32s, ETA 9m10s: reward 0.31, ... | rollout: 96 in flight, paused: staleness`."""
    parts = []
    if steps:
        last = steps[-1]
        step = int(last["step"])
        done_here = step - resumed_from
        eta = f", ETA {format_duration((total_steps - step) * training_s / done_here)}" if done_here > 0 else ""
        parts.append(f"step {step}/{total_steps} ({100 * step // max(total_steps, 1)}%), {format_duration(training_s)}"
                     f"{eta}: reward {last['reward_mean']:.3f}, loss {last['loss']:.4f}, weight version "
                     f"{int(last['weight_version'])}, staleness {last['staleness_mean']:.2f}")
    else:
        parts.append(f"step {resumed_from}/{total_steps}, {format_duration(training_s)}: waiting for the first groups")
    if status is not None:
        rollout = (f"rollout: {status['in_flight']} episodes in flight, {status['groups_open']} groups open, "
                   f"{status['groups_completed']} done, {status['episodes_per_s']:.1f} episodes/s")
        if status.get("pause_reasons"):
            rollout += f", paused: {', '.join(status['pause_reasons'])}"
        parts.append(rollout)
    return " | ".join(parts)


async def _group_counts(store) -> tuple[int, int]:
    return await store.unconsumed_groups(), await store.unread_groups()


def _stream_time(stream_id: str) -> float:
    """A Redis stream id's time (ms-seq) in seconds."""
    return int(stream_id.split("-", 1)[0]) / 1000


def gateway_section(cfg: RunConfig, redis_url: str, engine_urls: list[str]) -> GatewayConfig:
    """The gateway's resolved section: cfg.gateway with what the run fills in (its Redis and name, the
    engines, which it then follows in Redis, the model's tokenizer unless one is set, routing replay)."""
    return replace(cfg.gateway, host=cfg.cluster.host or cfg.gateway.host, redis_url=redis_url, run_name=cfg.name,
                   engine_urls=list(engine_urls),
                   engines_from_redis=True, tokenizer=cfg.gateway.tokenizer or cfg.model.tokenizer,
                   routing_replay=cfg.rollout.routing_replay)


def orchestrator_section(cfg: RunConfig, redis_url: str, gateway: str) -> OrchestratorConfig:
    """The orchestrator's resolved section (the same in both modes but for the staleness limit): the run's
    Redis, name, gateway (a training run records every episode: never an llm_url; RunConfig refuses
    sessions=endpoint), seed and sampling, the trainer's schedule, and each env's own limits."""
    o = cfg.orchestrator
    # Staleness rule (AReaL's): group n starts only while n < (version + limit + 1) * groups per version.
    # sync mode is limit 0: one batch per weight version, generated after the previous push.
    staleness = 0 if cfg.mode == "sync" else cfg.trainer.staleness_tau
    groups_per_version = cfg.trainer.groups_per_step * cfg.trainer.weight_push.every_k_steps
    # Per-env limits: the orchestrator's maps, and each env service's own setting (which wins for its name).
    envs = cfg.envs.services.values()
    return replace(o, host=cfg.cluster.host or o.host, redis_url=redis_url, run_name=cfg.name, gateway_url=gateway,
                   llm_url=None,
                   seed=cfg.seed, sampling=cfg.rollout.sampling, staleness_limit=staleness,
                   groups_per_step=groups_per_version, wait_for_envs=[e.name for e in envs],
                   max_turns_by_env=_by_env(o.max_turns_by_env, {e.name: e.max_turns for e in envs}),
                   episode_timeout_s_by_env=_by_env(o.episode_timeout_s_by_env,
                                                    {e.name: e.episode_timeout_s for e in envs}))


def _by_env(configured: dict, own: dict) -> dict:
    return {**configured, **{name: value for name, value in own.items() if value is not None}}


def env_interpreter(env: EnvServiceConfig) -> Optional[str]:
    """The absolute path of the env's `python` (relative to the working directory), or None for the run's own;
    a ValueError naming the field when nothing executable is there."""
    if env.python is None:
        return None
    path = Path(env.python).expanduser().absolute()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"envs.services.{env.name}.python: no executable interpreter at {path}")
    return str(path)


def env_service_args(run_dir: Path, env: EnvServiceConfig, orchestrator: Optional[str],
                     host: Optional[str] = None) -> list[str]:
    """An env service's command line (`python -m envs.serve ...`): its section, the orchestrator it
    registers with (none: it does not), and the interface it binds (None: loopback, the service's default)."""
    return (write_config(run_dir, f"env-{env.name}", env) + (["--orchestrator", orchestrator] if orchestrator else [])
            + (["--host", host] if host else []))


def write_config(run_dir: Path, name: str, section: Any) -> list[str]:
    """Write a service's resolved section to <run_dir>/config/<name>.json; -> its `--config FILE` argv."""
    return ["--config", str(write_section(section, run_dir / "config" / f"{name}.json"))]


def config_files(args: list[str]) -> dict[str, str]:
    """The files a service's argv names after `--config`, by path: what its actor writes on its own node."""
    return {path: Path(path).read_text() for flag, path in zip(args, args[1:]) if flag == "--config"}


def trainer_config(cfg: RunConfig) -> TrainerConfig:
    """The trainer's config for this run: sync mode's schedule, cluster.host, and the engines' API key for its pushes
    (rollout.api_key, else $ASYNCRL_ENGINE_API_KEY, which the built-in engines and the gateway inherit)."""
    trainer_cfg = cfg.trainer
    if cfg.mode == "sync":  # generate a batch, train, push, checkpoint: then the next batch starts
        trainer_cfg = replace(trainer_cfg, checkpoint_every=1,
                              weight_push=replace(trainer_cfg.weight_push, every_k_steps=1))
    api_key = cfg.rollout.api_key or os.environ.get(ENGINE_API_KEY_ENV)
    return replace(trainer_cfg, metrics_host=cfg.cluster.host or trainer_cfg.metrics_host,
                   weight_push=replace(trainer_cfg.weight_push, engine_api_key=api_key))


def _set_only(**options: Any) -> dict[str, Any]:
    """The options of a run across hosts that are set: a component plugin written for one machine (the engine
    group, the trainer) is constructed exactly as before, without them."""
    return {key: value for key, value in options.items() if value}


def _token_env(name: str, token: Optional[str]) -> dict[str, str]:
    return {name: token} if token else {}


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _first_line(err: BaseException) -> str:
    """One plain line naming what failed. A RayTaskError's own text starts with a colored `ray::Actor.method()`
    header; the exception raised inside the actor (its `cause`) names the failure, with its module, so a
    dead Redis reads as `redis.exceptions.ConnectionError: ...`."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        kind = type(cause)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return f"{name}: {_first_line(cause)}"
    text = ANSI_ESCAPE.sub("", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as err:  # shutdown continues past a component that is already gone
        log.warning("shutdown: %s", _first_line(err))
