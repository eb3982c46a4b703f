"""`Trainer`: one run's trainer, usable in-process, as a Ray actor (`ray.remote(Trainer)`), or from
`python -m trainer.run`.

It owns the parts the RL loop (trainer/loop.py) drives: the backend, the group loader, checkpoints,
weight sync and the metrics stream. Constructing it restores the newest checkpoint (model, optimizer,
step, weight version, the groups of the step window that may still need an acknowledgement).

Hooks for the launcher (issue 8):
* async mode: `await trainer.run(total_steps)`; it trains whenever `groups_per_step` groups are ready.
* sync mode: the launcher drives the loop itself: generate a batch of groups for the current weight
  version, then `await trainer.step()` (one RL step: read, train, push if due, checkpoint if due) and
  repeat. `trainer.state.weight_version` and the `weights` hash's `served_version` tell it when the
  engines serve new weights.
* `request_stop()` (also SIGTERM in trainer.run): finish the running step, checkpoint, acknowledge, return.
* `resumed_from()`: the step of the checkpoint it resumed from (0: a fresh start), which the launcher announces.
* at `total_steps`, `export_final()` writes the weights in HF format to <run_dir>/final.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Optional

from asyncrl.config import ModelSection, TrainerConfig
from asyncrl.model.io import save_tensors
from asyncrl.node_files import Packed, ensure_dir, pack_dir
from asyncrl.store import Store
from trainer.atomic_dir import write_atomically
from trainer.backends.base import StepResult, TrainerBackend, make_backend
from trainer.checkpoint import CheckpointManager
from trainer.data import GroupLoader, StepBatch
from trainer.loop import rl_step, train
from trainer.losses import build_loss
from trainer.metrics import TrainerMetrics, serve_metrics
from trainer.off_policy import trained_records
from trainer.weight_push import PushReport, WeightSync

log = logging.getLogger("trainer")

METRICS_KEY = "trainer_metrics"
"""The `services` hash field holding the trainer's metrics URL."""

CONSUMER = "trainer-0"
"""The loader's consumer name: the same after a restart, so the restarted trainer gets its own
unacknowledged groups back first (Store.read_groups)."""


class Trainer:
    def __init__(self, cfg: TrainerConfig, model: ModelSection, redis_url: str, run: str, run_dir: str,
                 seed: int = 0, backend: Optional[TrainerBackend] = None, retention_groups: int = 10_000,
                 log_file: Optional[str] = None, shipped_weights: Optional[list] = None) -> None:
        """`retention_groups`: the run's `redis.retention_groups` (acknowledging trims past it). `log_file`:
        also log there (the launcher's <run_dir>/trainer.log; a Ray actor's own log is in Ray's session dir).
        `shipped_weights`: [ObjectRef] of `model.path`, for a node that does not share the launcher's disk."""
        if log_file:
            _log_to(Path(log_file))
        if model.path:
            ensure_dir(model.path, shipped_weights)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.backend = backend or make_backend(cfg, model, seed)
        self.store = Store.connect(redis_url, run, retention_groups=retention_groups, retry_s=cfg.redis_retry_s)
        self.checkpoints = CheckpointManager(Path(run_dir) / "checkpoints", cfg.keep_checkpoints)
        self.weights = WeightSync(cfg.weight_push, self.store, Path(run_dir) / "weights")
        self.state = self.checkpoints.restore(self.backend)
        self.restored_step = self.state.step
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "trainer.pid").write_text(str(os.getpid()))  # for operators and tests
        self.loader = GroupLoader(self.store, CONSUMER, cfg, trained_stream_ids=self.state.trained_stream_ids)
        self.uncommitted: list[StepBatch] = []
        """Trained batches whose groups wait for the next checkpoint to be acknowledged."""
        self.stopping = asyncio.Event()
        self.band = build_loss(cfg.loss).band
        self._started = False
        self.prometheus = TrainerMetrics(lambda: self.state.step, lambda: self.state.weight_version)
        """Updated after every step (trainer/loop.py); served at `metrics_url`/metrics."""
        self.metrics_server = serve_metrics(self.prometheus, lambda: {"step": self.state.step,
                                                                      "weight_version": self.state.weight_version},
                                            cfg.metrics_host, cfg.metrics_port)
        self.metrics_url = self.metrics_server.url if self.metrics_server else None

    # The loop (trainer/loop.py) ----------------------------------------------------------------------
    async def run(self, total_steps: int) -> None:
        await train(self, total_steps)

    async def step(self, final: bool = False) -> Optional[dict[str, float]]:
        """One RL step (sync mode); None when a stop was requested while waiting for groups."""
        await self.start()
        return await rl_step(self, final)

    def request_stop(self) -> None:
        self.stopping.set()

    async def snapshot_files(self, path: str) -> Packed:
        """The files of weight snapshot `path`, for a restarting engine on a node without this disk."""
        snapshot = Path(path).resolve()
        if snapshot.parent != self.weights.weights_dir.resolve():
            raise ValueError(f"{path} is not a weight snapshot of this run ({self.weights.weights_dir})")
        return await asyncio.to_thread(pack_dir, snapshot)  # the loop keeps serving meanwhile

    # What the loop calls (trainer/loop.py LoopTrainer) -------------------------------------------------
    async def start(self) -> None:
        """Once, before the first step: say where /metrics is, publish the checkpoint's step record if the crash
        came before it was, and bring the engines to the checkpoint's weights."""
        if self._started:
            return
        self._started = True
        await self.announce()
        await self.publish_lost_record()
        await self.sync_engines()

    async def publish_lost_record(self) -> None:
        """The checkpoint's step record, if the trainer that wrote the checkpoint died before publishing it
        (the metrics stream would lack a step that the run did take), marked `republished`."""
        last = await self.store.last_metrics("trainer")
        if self.state.record and (last is None or last.get("step", 0) < self.state.step):
            await self.report({**self.state.record, "republished": 1.0})
            log.info("step %d: published its record, which the previous trainer did not", self.state.step)

    async def sync_engines(self) -> None:
        """If the engines serve a version this trainer's checkpoint does not hold (a push after the last
        checkpoint, then a crash), push the restored weights as a newer version, so versions only grow and
        no sample is labelled with weights that no longer exist."""
        served = (await self.store.weights()).served_version
        if served != self.state.weight_version:
            log.info("engines serve v%d, checkpoint holds v%d: pushing the restored weights", served,
                     self.state.weight_version)
            pushed = max(served, self.state.weight_version) + 1
            self.state.repushes.append([pushed, self.state.weight_version])
            await self.push_weights(pushed, reset_optimizer=False)

    async def announce(self) -> None:
        """Record where this trainer's /metrics is (`services` hash, key `trainer_metrics`)."""
        if self.metrics_url:
            await self.store.redis.hset(self.store.key("services"), METRICS_KEY, self.metrics_url)

    async def next_batch(self) -> Optional[StepBatch]:
        """The next step's batch, or None once a stop is requested (the loader takes its groups back)."""
        read = asyncio.ensure_future(self.loader.next_step(self.state.weight_version, self.state.lineage_version))
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if read.done():
            return read.result()
        read.cancel()
        await asyncio.gather(read, return_exceptions=True)
        return None

    async def train_step(self, batch: StepBatch) -> StepResult:
        result = await asyncio.to_thread(self.backend.train_step, batch.micro_batches,
                                         batch.normalizer(self.cfg.loss.aggregation))
        self.uncommitted.append(batch)
        await self.store.add_trained(trained_records(batch, result.samples, self.band, self.state.step + 1,
                                                     self.state.weight_version))
        return result

    async def push_weights(self, version: int, reset_optimizer: Optional[bool] = None) -> PushReport:
        report = await self.weights.push(self.backend, version, self.state.lineage_offset)
        self.state.weight_version = version
        if self.cfg.weight_push.reset_optimizer if reset_optimizer is None else reset_optimizer:
            self.backend.reset_optimizer()
        log.info("pushed weights v%d by %s to %d engines in %.3fs", version, report.method, report.engines,
                 report.total_s)
        return report

    async def checkpoint_and_commit(self) -> None:
        """Make the trained steps durable, then acknowledge their groups (never the other way round)."""
        if not self.uncommitted:
            return
        self.state.trained_stream_ids = [sid for batch in self.uncommitted for sid in batch.stream_ids]
        await asyncio.to_thread(self.checkpoints.save, self.backend, self.state)
        for batch in self.uncommitted:
            await self.loader.commit(batch)
        self.uncommitted.clear()

    async def report(self, metrics: dict[str, float]) -> None:
        await self.store.add_metrics("trainer", metrics)
        self.prometheus.observe(metrics)

    async def export_final(self) -> Path:
        """The trained weights as an HF checkpoint at <run_dir>/final (what `asyncrl eval` and users load)."""
        tensors = self.backend.hf_state_dict()
        dtype = tensors["model.embed_tokens.weight"].dtype
        path = await asyncio.to_thread(write_atomically, self.run_dir / "final",
                                       lambda tmp: save_tensors(tensors, self.backend.hf_config(), tmp, dtype))
        log.info("step %d: final weights (HF format) in %s", self.state.step, path)
        return path

    def resumed_from(self) -> int:
        return self.restored_step

    async def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
            try:  # unless a newer trainer has recorded its own URL meanwhile
                key = self.store.key("services")
                if await self.store.redis.hget(key, METRICS_KEY) == self.metrics_url.encode():
                    await self.store.redis.hdel(key, METRICS_KEY)
            except Exception as err:  # noqa: BLE001 - closing goes on without Redis
                log.warning("could not remove the trainer's metrics URL from Redis: %r", err)
        await self.weights.close()
        self.backend.close()
        await self.store.close()


def _log_to(path: Path) -> None:
    """Add a file handler to the root logger (once per path: a restarted actor constructs anew)."""
    root = logging.getLogger()
    if any(getattr(h, "baseFilename", None) == str(path.resolve()) for h in root.handlers):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per engine call of every push otherwise
