"""Run-level metrics: one time series in Redis (the `metrics` stream), mirrored to TensorBoard (and to
W&B when `wandb.enabled`, asyncrl_run/wandb_mirror.py, with the services' own /metrics).

Sources (the `source` field of a record; each source has one record shape, written by one writer):
* `trainer`: one record per step, appended by the trainer (trainer/loop.py step_metrics: reward, loss,
  masked fraction, staleness, tokens/s, weight version, time per phase, ...).
* `orchestrator`: one record every few seconds, appended by the orchestrator itself
  (orchestrator/runtime.py), shaped by orchestrator/run_record.py: totals, pause reasons, and each env's
  health, load and outcomes.
`asyncrl watch`, the TensorBoard event files under <run_dir>/tensorboard and the W&B run (mirrored by
the launcher's `Collector`, which also keeps the orchestrator's last /v1/status for the launcher's
progress line and summary, without writing it to the stream) and tests all read the same stream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional, Protocol

import httpx
from redis.exceptions import RedisError

from asyncrl.service_metrics import ServiceScraper
from asyncrl.store import Store

log = logging.getLogger("asyncrl_run.run_metrics")

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
SYSTEM_ORCHESTRATOR = ("paused", "pause/", "dispatch_overhead")
"""`orchestrator` record keys (and prefixes) that are about the orchestrator itself: system/orchestrator/<key>."""


def trainer_key(key: str) -> Optional[str]:
    """The panel key (TensorBoard tag, W&B key) of a `trainer` record's value: TRAINER_SCALARS' tag; a key
    with a "/" (`off_policy/<name>`, `env/<env>/<name>`) as it is; any other `train/<key>`. None for
    `step`, the x-axis."""
    if key == "step":
        return None
    return TRAINER_SCALARS.get(key) or (key if "/" in key else f"train/{key}")


def orchestrator_key(key: str) -> str:
    """The panel key of an `orchestrator` record's value: ORCHESTRATOR_SCALARS' tag; `env/<env>/...` as it
    is; `paused`, `pause/<reason>` and `dispatch_overhead_p99_ms` under system/orchestrator/; any other
    total `rollout/<key>`."""
    if key in ORCHESTRATOR_SCALARS:
        return ORCHESTRATOR_SCALARS[key]
    if key.startswith("env/"):
        return key
    if key.startswith(SYSTEM_ORCHESTRATOR):
        return f"system/orchestrator/{key}"
    return f"rollout/{key}"


def newer(records: list[tuple[str, str, dict[str, float]]], after: str) -> list[tuple[str, str, dict[str, float]]]:
    """The records past stream id `after` (ids are `<ms>-<seq>`)."""
    mark = _stream_id(after)
    return [r for r in records if _stream_id(r[0]) > mark]


def _stream_id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class TensorBoardMirror:
    """Appends every new metrics record of the run to TensorBoard event files (trainer values at their step,
    orchestrator values at their record's count), under the same keys as W&B."""

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
                for key, value in values.items():
                    if (tag := trainer_key(key)) is not None:
                        self.writer.add_scalar(tag, value, step)
            elif source == "orchestrator":
                self._orchestrator_ticks += 1
                for key, value in values.items():
                    self.writer.add_scalar(orchestrator_key(key), value, self._orchestrator_ticks)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Mirror(Protocol):
    """Where the Collector copies the stream: `after` is the stream id of the last record it holds."""

    after: str

    def write(self, records: list[tuple[str, str, dict[str, float]]]) -> None: ...

    def close(self) -> None: ...


class ScrapeSink(Protocol):
    """Where the services' scraped /metrics go (the W&B mirror; TensorBoard shows the stream only)."""

    def write_scraped(self, values: dict[str, float]) -> None: ...


class Collector:
    """Background thread: mirror the run's metrics stream to each of `mirrors` (TensorBoard, W&B), scrape
    the services' /metrics into `scrape_to` when given, and keep the orchestrator's last /v1/status
    (`status`) for the launcher. It closes the mirrors when it stops."""

    def __init__(self, redis_url: str, run: str, orchestrator_url: str, mirrors: list[Mirror],
                 interval_s: float = 5.0, headers: Optional[dict[str, str]] = None,
                 scrape_to: Optional[ScrapeSink] = None, gateway_headers: Optional[dict[str, str]] = None) -> None:
        """`headers`: the orchestrator's bearer token when it has one (else every poll is refused);
        `gateway_headers`: the gateway's, for its /metrics."""
        self.redis_url, self.run, self.orchestrator_url = redis_url, run, orchestrator_url
        self.mirrors, self.interval_s, self.headers = mirrors, interval_s, headers or {}
        self.scrape_to = scrape_to
        self.scraper = ServiceScraper(orchestrator_url, self.headers, gateway_headers or {})
        self.status: Optional[dict[str, Any]] = None
        """The orchestrator's last /v1/status (the launcher's progress line reads it)."""
        self.status_at = time.monotonic()
        """When `status` was read (time.monotonic)."""
        self._wake = threading.Condition()
        self._asked = self._done = 0
        """Rounds asked for by `collect_now` / the last of them the loop has finished."""
        self._stopping = False
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), name="metrics", daemon=True)

    def start(self) -> "Collector":
        self._thread.start()
        return self

    def collect_now(self, timeout_s: float = 15.0) -> None:
        """A round (poll, mirror, scrape) started after this call, waited for: the launcher's last scrape at
        the run's end, while every service still answers (a short run's only scrape may predate its first
        episode)."""
        with self._wake:
            self._asked += 1
            asked = self._asked
            self._wake.notify_all()
            self._wake.wait_for(lambda: self._done >= asked, timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """A last read of the stream, then the mirrors close. Called after the orchestrator stopped (its
        last record holds the final totals), so this read neither polls nor scrapes the services again."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
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
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                while True:
                    with self._wake:
                        asked = self._asked
                    await self._poll(http)
                    await self._tick(store, http)
                    with self._wake:
                        self._done = asked
                        self._wake.notify_all()
                        self._wake.wait_for(lambda: self._stopping or self._asked > self._done, self.interval_s)
                        stopping = self._stopping
                    if stopping:
                        await self._mirror(store)
                        return
        finally:
            for mirror in self.mirrors:
                try:
                    mirror.close()
                except Exception as err:  # noqa: BLE001 - the others still close
                    log.warning("closing %s failed: %r", type(mirror).__name__, err)
            await store.close()

    async def _poll(self, http: httpx.AsyncClient) -> None:
        """The orchestrator's /v1/status, for the launcher's progress line and summary (its `orchestrator`
        records in the stream are its own: one shape per source)."""
        status = await _get_json(http, f"{self.orchestrator_url}/v1/status", self.headers)
        if status is not None:
            self.status, self.status_at = status, time.monotonic()

    def status_age_s(self) -> float:
        """Seconds since `status` was read (since the start while none was)."""
        return time.monotonic() - self.status_at

    async def _tick(self, store: Store, http: httpx.AsyncClient) -> None:
        """Mirror the stream, then scrape the services; a Redis failure skips both (each mirror catches up
        from its `after` next time)."""
        if await self._mirror(store) and self.scrape_to is not None:
            try:
                self.scrape_to.write_scraped(await self.scraper.scrape(http, store))
            except (RedisError, OSError) as err:
                log.warning("metrics scrape skipped: Redis failed (%r)", err)

    async def _mirror(self, store: Store) -> bool:
        """The stream's new records to each mirror; False when Redis failed."""
        try:
            after = min((m.after for m in self.mirrors), key=_stream_id)
            records = await store.read_metrics(after=after, count=100_000)
            for mirror in self.mirrors:
                mirror.write(newer(records, mirror.after))
            return True
        except (RedisError, OSError) as err:
            log.warning("metrics poll skipped: Redis failed (%r)", err)
            return False


async def _get_json(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Optional[dict[str, Any]]:
    try:
        response = await http.get(url, headers=headers)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
