"""Run-level metrics: one time series in Redis (the `metrics` stream), mirrored to TensorBoard.

Sources: the trainer appends a `trainer` record per step (reward, loss, masked fraction, staleness,
tokens/s, weight version, ...); the launcher's collector appends an `orchestrator` record every few
seconds from GET /v1/status (episodes/s, in flight, env health). `asyncrl watch`, the TensorBoard
event files under <run_dir>/tensorboard and tests all read the same stream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Optional

import httpx
from redis.exceptions import RedisError

from asyncrl.store import Store

log = logging.getLogger("asyncrl.run_metrics")

TRAINER_SCALARS = {
    "reward_mean": "rollout/reward_mean", "response_len_mean": "rollout/response_length",
    "staleness_mean": "rollout/staleness_mean", "staleness_max": "rollout/staleness_max",
    "loss": "train/loss", "grad_norm": "train/grad_norm", "masked_fraction": "train/masked_fraction",
    "mean_ratio": "train/mean_ratio", "mismatch_kl": "train/mismatch_kl", "entropy": "train/entropy",
    "tokens_per_s": "throughput/train_tokens_per_s", "weight_version": "train/weight_version",
    "push_s": "train/weight_push_s", "filter_groups_filtered": "rollout/groups_filtered_per_step",
}
ORCHESTRATOR_SCALARS = {
    "episodes_per_s": "throughput/episodes_per_s", "in_flight": "rollout/in_flight", "queued": "rollout/queued",
    "completed": "rollout/episodes_completed", "failed": "rollout/episodes_failed", "retried": "rollout/episodes_retried",
    "groups_filtered": "rollout/groups_filtered", "groups_passed": "rollout/groups_passed_uninformative",
    "filtered_fraction": "rollout/filtered_fraction",
}


def orchestrator_record(status: dict[str, Any]) -> dict[str, float]:
    """Flatten /v1/status into scalars: totals plus per-env health (healthy services, in flight) and
    attempts per outcome class (model, environment, infrastructure)."""
    record = {k: float(status[k]) for k in ORCHESTRATOR_SCALARS if isinstance(status.get(k), (int, float))}
    for env, stats in (status.get("by_env") or {}).items():
        record[f"env/{env}/healthy_services"] = float(stats.get("healthy_services", 0))
        record[f"env/{env}/in_flight"] = float(stats.get("in_flight", 0))
        for cls, reasons in (stats.get("outcomes") or {}).items():
            record[f"env/{env}/outcome_{cls}"] = float(sum(reasons.values()))
    return record


class TensorBoardMirror:
    """Appends every new metrics record of the run to TensorBoard event files."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        self.after = "0-0"
        self._orchestrator_ticks = 0

    def write(self, records: list[tuple[str, str, dict[str, float]]]) -> None:
        for stream_id, source, values in records:
            self.after = stream_id
            if source == "trainer":
                step = int(values.get("step", 0))
                for key, tag in TRAINER_SCALARS.items():
                    if key in values:
                        self.writer.add_scalar(tag, values[key], step)
            elif source == "orchestrator":
                self._orchestrator_ticks += 1
                for key, value in values.items():
                    self.writer.add_scalar(ORCHESTRATOR_SCALARS.get(key, key), value, self._orchestrator_ticks)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Collector:
    """Background thread: poll the orchestrator into the stream, mirror the stream to TensorBoard."""

    def __init__(self, redis_url: str, run: str, orchestrator_url: str, log_dir: Path, interval_s: float = 5.0,
                 headers: Optional[dict[str, str]] = None) -> None:
        """`headers`: the orchestrator's bearer token when it has one (else every poll is refused)."""
        self.redis_url, self.run, self.orchestrator_url = redis_url, run, orchestrator_url
        self.log_dir, self.interval_s, self.headers = log_dir, interval_s, headers or {}
        self.status: Optional[dict[str, Any]] = None
        """The orchestrator's last /v1/status (the launcher's progress line reads it)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), name="metrics", daemon=True)

    def start(self) -> "Collector":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def final_status(self) -> Optional[dict[str, Any]]:
        """/v1/status now (the run's end), else the last one polled."""
        try:
            response = httpx.get(f"{self.orchestrator_url}/v1/status", headers=self.headers, timeout=10)
            if response.status_code == 200:
                self.status = response.json()
        except (httpx.HTTPError, ValueError) as err:
            log.warning("final orchestrator status unavailable (%r): the summary uses the last poll", err)
        return self.status

    async def _loop(self) -> None:
        store = Store.connect(self.redis_url, self.run)
        mirror = TensorBoardMirror(self.log_dir)
        try:
            async with httpx.AsyncClient(timeout=10, headers=self.headers) as http:
                while True:
                    await self._tick(store, mirror, http)
                    if self._stop.wait(self.interval_s):
                        await self._tick(store, mirror, http)
                        return
        finally:
            mirror.close()
            await store.close()

    async def _tick(self, store: Store, mirror: TensorBoardMirror, http: httpx.AsyncClient) -> None:
        """One poll; a Redis failure skips it (the mirror catches up from `mirror.after` next time)."""
        status = await _get_json(http, f"{self.orchestrator_url}/v1/status")
        self.status = status or self.status
        try:
            if status is not None:
                await store.add_metrics("orchestrator", orchestrator_record(status))
            mirror.write(await store.read_metrics(after=mirror.after, count=100_000))
        except (RedisError, OSError) as err:
            log.warning("metrics poll skipped: Redis failed (%r)", err)


async def _get_json(http: httpx.AsyncClient, url: str) -> Optional[dict[str, Any]]:
    try:
        response = await http.get(url)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
