"""`RolloutEngine`: the Ray actor that hosts one engine server process and keeps it healthy.

The actor launches the configured backend (built-in CPU engine or SGLang) as a child process
(asyncrl.supervisor), publishes its URL in Redis (`engines` hash), and checks /health_generate every
`health_check_interval_s`; a failed or dead engine is killed and started again with the *current*
weights (the newest snapshot recorded in the `weights` hash). If the actor itself dies, Ray restarts
it (max_restarts=-1) and __init__ does the same: nothing but in-flight requests is lost, and the
gateway re-routes those.

Across hosts (docs/run.md "A run across hosts") the engine binds `bind_host` (cluster.host) and
publishes its node's address; a node without the launcher's disk unpacks the initial weights the
launcher shipped (asyncrl.node_files), and a restart whose snapshot is on the trainer's disk only
fetches it from the trainer actor.

On the same tick the actor reads its engine's restart request (`engine_restarts` hash): the trainer
records one, after recording a snapshot of the version, for an engine that did not take a push
(trainer/weight_push.py). A request for a version above the one the engine started with restarts
the healthy process, which then loads that snapshot; each request is honoured once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Optional

from redis.exceptions import RedisError

from asyncrl.config import RolloutConfig
from asyncrl.engine_client import EngineClient
from asyncrl.network import advertised_host
from asyncrl.node_files import ensure_dir, unpack_dir
from asyncrl.store import store_call
from asyncrl.supervisor import Supervisor
from rollout.backends import LaunchSpec, make_backend

log = logging.getLogger("rollout.actor")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RolloutEngine(Supervisor):
    def __init__(self, cfg: RolloutConfig, engine_id: str, model_path: str, redis_url: str, run: str,
                 work_dir: str, seed: int = 0, tokenizer_path: Optional[str] = None,
                 bind_host: str = "127.0.0.1", shipped_weights: Optional[list] = None) -> None:
        super().__init__(engine_id, work_dir, health_path="/health_generate",
                         check_interval_s=cfg.health_check_interval_s, check_timeout_s=cfg.health_check_timeout_s,
                         start_timeout_s=cfg.health_check_timeout_s * 10)
        self.cfg, self.engine_id = cfg, engine_id
        self.initial_model_path, self.tokenizer_path, self.seed = model_path, tokenizer_path, seed
        self.redis_url, self.run = redis_url, run
        self.shipped_weights = shipped_weights
        """[ObjectRef] of the initial weights (asyncrl.node_files), for a node without the launcher's disk."""
        self.backend = make_backend(cfg)
        self.host = bind_host
        self.public_host = advertised_host(bind_host)
        self.port = _free_port(bind_host)
        self.weights: tuple[str, str] = (model_path, "0")
        self.restarted_for = 0
        """The newest restart request this engine has met: it restarted for it, or started with that version
        or newer."""
        self.start()

    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    def before_start(self) -> None:
        self.weights = self._current_weights()
        if self.weights[0] == self.initial_model_path:  # a snapshot was fetched by _current_weights
            ensure_dir(self.initial_model_path, self.shipped_weights)
        self.restarted_for = max(self.restarted_for, int(self.weights[1]))

    def restart_requested(self) -> bool:
        """True once for each restart request (Store.request_engine_restarts) above `restarted_for`."""
        try:
            requested = store_call(self.redis_url, self.run, lambda store: store.engine_restart_request(self.engine_id),
                                   retry_s=0)
        except (RedisError, OSError) as err:  # asked again on the next tick
            log.warning("%s: reading its restart request failed (%r)", self.engine_id, err)
            return False
        if requested <= self.restarted_for:
            return False
        log.warning("%s did not take weights v%d: restarting it with the recorded snapshot", self.engine_id, requested)
        self.restarted_for = requested
        return True

    def command(self) -> list[str]:
        path, version = self.weights
        return self.backend.command(LaunchSpec(model_path=path, host=self.host, port=self.port, weight_version=version,
                                               log_path=self.log_path, tokenizer_path=self.tokenizer_path,
                                               seed=self.seed))

    def environment(self) -> dict[str, str]:
        self.backend.check_available()
        return self.backend.environment()

    def on_serving(self) -> None:
        """Catch up, register, catch up again: the trainer pushes to the engines registered when its push
        starts, so one that missed a push while it started would generate at weights the trainer has moved
        past (its groups stale) until the next push reached it."""
        self._catch_up()
        store_call(self.redis_url, self.run, lambda store: store.register_engine(self.engine_id, self.url()))
        self._catch_up()

    def _catch_up(self) -> None:
        """Load the newest recorded snapshot if it is newer than what the engine serves (asked of the engine:
        a push may have reached it meanwhile, and versions only grow)."""
        try:
            weights = store_call(self.redis_url, self.run, lambda store: store.weights())
            if (weights.snapshot and weights.snapshot_version > int(self.weights[1])
                    and self._have_snapshot(weights.snapshot)):
                asyncio.run(self._load_if_newer(weights.snapshot, weights.snapshot_version))
        except Exception as err:  # noqa: BLE001 - a serving engine stays up; the next push brings the weights
            log.warning("%s: catching up with the newest weight snapshot failed (%r); the next push brings them",
                        self.engine_id, err)

    async def _load_if_newer(self, snapshot: str, version: int) -> None:
        async with EngineClient(self.url(), api_key=self.cfg.api_key) as engine:
            serving = int(await engine.weight_version())
            if serving < version:
                await engine.update_weights_from_disk(snapshot, str(version))
                log.info("%s started with weights v%d and missed pushes meanwhile: loaded snapshot v%d",
                         self.engine_id, serving, version)
        self.weights = (snapshot, str(version))

    def shutdown(self, grace_s: float = 15.0) -> Optional[int]:
        """Graceful: the engine aborts in-flight work on SIGTERM; the URL leaves the registry."""
        code = super().shutdown(grace_s)
        store_call(self.redis_url, self.run, lambda store: store.unregister_engine(self.engine_id))
        return code

    def _current_weights(self) -> tuple[str, str]:
        """(checkpoint path, version) the engine must serve: the newest recorded snapshot, else the initial model."""
        weights = store_call(self.redis_url, self.run, lambda store: store.weights())
        if weights.snapshot and self._have_snapshot(weights.snapshot):
            if weights.snapshot_version < weights.served_version:  # tensor/distributed between two snapshots
                log.info("%s starts with snapshot v%d; the next push brings v%d or newer", self.engine_id,
                         weights.snapshot_version, weights.served_version)
            return weights.snapshot, str(weights.snapshot_version)
        return self.initial_model_path, "0"

    def _have_snapshot(self, path: str) -> bool:
        """The snapshot is on this node, or is now: fetched from the trainer actor, whose disk it was written on."""
        if (Path(path) / "config.json").is_file():
            return True
        try:
            import ray

            trainer = ray.get_actor(f"{self.run}-trainer")
            unpack_dir(ray.get(trainer.snapshot_files.remote(path), timeout=self.cfg.health_check_timeout_s * 10), path)
            log.info("%s fetched weight snapshot %s from the trainer", self.engine_id, path)
            return True
        except Exception as err:  # noqa: BLE001 - no Ray, no trainer, or the snapshot was pruned meanwhile
            log.warning("%s: weight snapshot %s is not on this node and the trainer did not send it (%s): starting "
                        "with the initial weights; the next push brings the current ones", self.engine_id, path, err)
            return False


class EngineGroup:
    """N `RolloutEngine` actors placed by Ray with the configured resources; restarted on death."""

    def __init__(self, cfg: RolloutConfig, model_path: str, redis_url: str, run: str, work_dir: str,
                 seed: int = 0, tokenizer_path: Optional[str] = None, bind_host: str = "127.0.0.1",
                 resources: Optional[dict[str, float]] = None, shipped_weights: Optional[list] = None) -> None:
        """`bind_host`, `resources` (Ray custom resources of each actor), `shipped_weights`: a run across hosts
        (cluster.host, cluster.placement.engines, asyncrl.node_files)."""
        import ray

        actor_cls = ray.remote(RolloutEngine)
        self.actors = [
            actor_cls.options(name=f"{run}-engine-{i}", num_cpus=cfg.num_cpus_per_engine,
                              num_gpus=cfg.num_gpus_per_engine, resources=dict(resources or {}), max_restarts=-1,
                              max_task_retries=3, max_concurrency=4)
            .remote(cfg, f"engine-{i}", model_path, redis_url, run, work_dir, seed + i, tokenizer_path, bind_host,
                    shipped_weights)
            for i in range(cfg.num_engines)
        ]

    def urls(self, timeout_s: float = 300.0) -> list[str]:
        import ray

        return ray.get([a.url.remote() for a in self.actors], timeout=timeout_s)

    def shutdown(self, grace_s: float = 15.0, timeout_s: float = 60.0) -> None:
        """Every engine process SIGTERMed (killed after `grace_s`), its actor then killed; at most `timeout_s`."""
        import ray

        ray.wait([a.shutdown.remote(grace_s) for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
