"""The cyclic garbage collector's pauses on every service's /metrics.

A collection stops the event loop for as long as it walks the objects of its generations, so a service
holding many objects shows its full collections as latency spikes (the gateway's p99 was those pauses:
bench/results/control_plane_scale.md). `<prefix>gc_pause_seconds{generation}` times every collection;
`<prefix>gc_frozen_objects` counts what asyncrl.gc_policy put beyond the collector's reach. One gc
callback per process feeds every registry that asks (tests build many apps in one process).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from asyncrl.gc_policy import frozen_objects

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
GENERATIONS = 3


class _Pauses:
    """Per generation: cumulative-able bucket counts and the sum of pause seconds."""

    def __init__(self) -> None:
        self.counts = [[0] * len(BUCKETS) for _ in range(GENERATIONS)]
        self.sums = [0.0] * GENERATIONS
        self._started = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause, generation = time.perf_counter() - self._started, info["generation"]
        self.sums[generation] += pause
        self.counts[generation][next(i for i, le in enumerate(BUCKETS) if pause <= le)] += 1


_PAUSES = _Pauses()
gc.callbacks.append(_PAUSES.on_gc)


class GcCollector(Collector):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def collect(self) -> Iterator:
        pauses = HistogramMetricFamily(f"{self.prefix}gc_pause_seconds", "cyclic GC collections: the event loop "
                                       "stops for each", labels=["generation"])
        for generation in range(GENERATIONS):
            counts, cumulative = _PAUSES.counts[generation], []
            for le, n in zip(BUCKETS, counts):
                cumulative.append((str(le) if le != math.inf else "+Inf", (cumulative[-1][1] if cumulative else 0) + n))
            pauses.add_metric([str(generation)], cumulative, _PAUSES.sums[generation])
        yield pauses
        yield GaugeMetricFamily(f"{self.prefix}gc_frozen_objects", "objects frozen (gc.freeze) at start or at the "
                                "last sweep (asyncrl/gc_policy.py): no collection walks them, a sweep does",
                                value=frozen_objects())


def register_gc_metrics(registry: CollectorRegistry, prefix: str) -> None:
    """`prefix`: the component's (asyncrl_gateway_), per docs/run.md's naming."""
    registry.register(GcCollector(prefix))
