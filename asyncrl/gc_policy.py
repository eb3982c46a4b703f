"""How a serving process uses CPython's cyclic garbage collector, which stops the event loop while it walks
the objects of the generations it collects (~1.4 us an object on the busy benchmark cores).

Every service freezes its startup heap (modules, the app, a tokenizer's vocabulary) before serving:
`freeze_startup_heap`. The control plane (gateway, orchestrator) also holds thousands of long-lived small
objects (open sessions, idle keep-alive connections, episodes in flight) whose collections were its latency
tail: 46 ms middle-generation and 0.3 s full collections at 4,096 episodes in flight
(bench/results/control_plane_scale_gc_thresholds.md). For those, `SurvivorFreezer` freezes whatever survives
a collection, so each collection walks only what was allocated since the last one (~1 ms), and the frozen
objects are still freed by reference counting like any other. What this gives up: a reference cycle that
becomes garbage after it was frozen waits for the next sweep (`gc.unfreeze(); gc.collect()`), every
`gc_sweep_s` seconds (GatewayConfig, OrchestratorConfig), which is one pause of a full collection (0.2 s on
the gateway at 4,096 episodes). Few cycles die that way: a sweep after ten minutes of that benchmark freed
30 objects.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("asyncrl.gc_policy")

GC_THRESHOLDS = (700, 100, 10)
"""gc.set_threshold for a service: CPython's young collections (700) as they are, the middle generation
collected every 100th young collection rather than every 10th. A service's middle generation holds what
outlived one young collection (open sessions, idle keep-alive connections, requests in flight), so each
of its collections stopped the gateway's loop ~18 ms, 0.65 s a minute; collected 10x less often, most of
those objects are freed by refcount first, and full collections (every 10th middle one) come 10x rarer."""

_frozen_counted = 0


def frozen_objects() -> int:
    """Objects frozen as of the startup freeze or the last sweep. Counting them walks every one (a few ms with
    the control plane's heap frozen), which a /metrics scrape must not do on the event loop."""
    return _frozen_counted


def _count_frozen() -> int:
    global _frozen_counted
    _frozen_counted = gc.get_freeze_count()
    return _frozen_counted


def freeze_startup_heap() -> None:
    """Move everything built so far out of the cyclic GC's reach: it lives as long as the process (the
    gateway's 250,000 objects, 0.13 s of every full collection), then GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    _count_frozen()


class SurvivorFreezer:
    """Freezes what survives each collection; `sweep_forever` collects the frozen heap every `sweep_s`."""

    def __init__(self, sweep_s: float) -> None:
        self.sweep_s = sweep_s
        self.sweeps = 0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        gc.callbacks.remove(self._on_collection)

    @staticmethod
    def _on_collection(phase: str, info: dict) -> None:
        if phase == "stop":
            gc.freeze()  # O(1): the generations' lists are appended to the permanent one

    def sweep(self) -> int:
        """One full collection over everything, frozen objects included; returns the objects it freed."""
        started = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()  # _on_collection freezes the survivors again
        pause = time.perf_counter() - started
        self.sweeps += 1
        log.info("gc sweep: %d unreachable objects freed in %.3f s; %d frozen", freed, pause, _count_frozen())
        return freed

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.sweep()
