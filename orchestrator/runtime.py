"""Start and stop an orchestrator: lease, restore from Redis, the background loops, clean shutdown.

    start: take the run's lease -> read the ledger -> restore (recover running episodes) ->
           loops: ledger writer, dispatch, health monitor, backpressure poll, lease renewal, metrics
    stop:  stop the loops and the attempts (their state stays in Redis), flush, release the lease
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import resource
import signal

from asyncrl.config import OrchestratorConfig
from orchestrator.run_record import orchestrator_record
from asyncrl.store import Store
from orchestrator.core import Orchestrator
from orchestrator.health import HealthMonitor
from orchestrator.lease import Lease
from orchestrator.recovery import restore

log = logging.getLogger("orchestrator.runtime")

METRICS_INTERVAL_S = 5.0


class Runtime:
    def __init__(self, cfg: OrchestratorConfig, redis_url: str, run: str) -> None:
        self.cfg = cfg
        self.store = Store.connect(redis_url, run)
        self.lease = Lease(self.store, cfg.lease_ttl_s)
        self.orch: Orchestrator
        self._loops: list[asyncio.Task] = []

    async def start(self) -> Orchestrator:
        raise_open_files_limit()
        await self.lease.acquire()
        self.orch = Orchestrator(self.cfg, self.store)
        loop_of = lambda coro, name: asyncio.create_task(coro, name=name)  # noqa: E731
        self._loops.append(loop_of(self.orch.ledger.write_forever(), "ledger"))
        await restore(self.orch, await self.orch.ledger.load())
        await self.orch.backpressure.refresh()
        self._loops += [loop_of(self.orch.dispatch_forever(), "dispatch"),
                        loop_of(HealthMonitor(self.orch).run_forever(), "health"),
                        loop_of(self.orch.backpressure.refresh_forever(), "backpressure"),
                        loop_of(self._keep_lease(), "lease"),
                        loop_of(self._publish_metrics(), "metrics")]
        for task in self._loops:
            task.add_done_callback(_crash_if_failed)
        gc.freeze()  # modules and startup state never die: later collections do not scan them again
        return self.orch

    async def stop(self) -> None:
        log.info("stopping: no new dispatches; running episodes stay recorded as running for the next start")
        writer, loops = self._loops[0], self._loops[1:]
        for task in loops:
            task.cancel()
        await _bounded("stopping the loops", asyncio.gather(*loops, return_exceptions=True))
        await _bounded("stopping the attempts", self.orch.close())
        await _bounded("flushing state to Redis", self.orch.ledger.sync())
        await _bounded("writing the final metrics record", self._publish_once())
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await _bounded("releasing the lease", self.lease.release())
        await self.store.close()
        log.info("stopped; %d open groups stay in Redis for the next start", len(self.orch.groups))

    async def _keep_lease(self) -> None:
        await self.lease.keep()

    async def _publish_metrics(self) -> None:
        """A record in the run's metrics stream every few seconds (`asyncrl watch`, TensorBoard, W&B): the
        whole status in the one `orchestrator` shape (orchestrator/run_record.py), totals, pause
        reasons and every env's health, load and outcomes in each record. The first at start, and `stop`
        writes a last one: a run shorter than the interval (an async tiny run takes ~3 s) still ends its
        stream with its final totals and every env it served."""
        while True:
            await self._publish_once()
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def _publish_once(self) -> None:
        try:
            await self.store.add_metrics("orchestrator", orchestrator_record(self.orch.status().model_dump()))
        except Exception as err:  # noqa: BLE001 - metrics must not take the orchestrator down
            log.warning("publishing metrics failed: %r", err)


async def _bounded(step: str, awaitable, timeout_s: float = 10.0) -> None:
    """Shutdown must end: a step that hangs is logged and skipped (what it left is recovered on restart)."""
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on Python 3.11 it can lose a cancellation
            await awaitable
    except TimeoutError:
        log.error("shutdown: %s took over %.0fs; skipped", step, timeout_s)


def _crash_if_failed(task: asyncio.Task) -> None:
    """A background loop that dies (lost lease, bug) stops the process: a half-working orchestrator
    would silently stop dispatching."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("%s loop failed: %r; exiting", task.get_name(), task.exception())
        os.kill(os.getpid(), signal.SIGTERM)


def raise_open_files_limit() -> None:
    """Every running episode holds a connection: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
