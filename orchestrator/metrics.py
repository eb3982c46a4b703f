"""Prometheus metrics of the orchestrator (`asyncrl_orchestrator_*`, docs/run.md "Metrics") and the
recent scheduling-overhead samples behind /v1/status."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncrl.gc_metrics import register_gc_metrics

PREFIX = "asyncrl_orchestrator_"
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
EPISODE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
PAUSE_REASONS = ("operator", "unconsumed_groups", "staleness")
"""Why new groups can be held back (Orchestrator.pause_reasons); each has a series from the start."""


class _PausedGauge(Collector):
    """`asyncrl_orchestrator_paused{reason}`: 1 while that reason holds new groups back, read at scrape time."""

    def __init__(self, reasons: Callable[[], list[str]]) -> None:
        self.reasons = reasons

    def collect(self) -> Iterator[GaugeMetricFamily]:
        active = set(self.reasons())
        family = GaugeMetricFamily(f"{PREFIX}paused", "1 while new groups are held back, by reason", labels=["reason"])
        for reason in sorted(set(PAUSE_REASONS) | active):
            family.add_metric([reason], float(reason in active))
        yield family


class OrchestratorMetrics:
    def __init__(self, overhead_window: int = 100_000, pause_reasons: Callable[[], list[str]] = list) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        register_gc_metrics(r, p)
        self.episodes = Counter(f"{p}episodes", "Episodes finished, by env and final status (completed, truncated, "
                                "given_up)", ["env", "status"], registry=r)
        self.retries = Counter(f"{p}retries", "Re-dispatches, by env and reason (a failure's reason, or refused, "
                               "session_lost, restart)", ["env", "reason"], registry=r)
        self.outcomes = Counter(f"{p}outcomes", "Attempts that ended, by env, outcome class and reason (model "
                                "outcomes once per member, failures once per failed attempt)",
                                ["env", "outcome", "reason"], registry=r)
        self.groups = Counter(f"{p}groups_completed", "GroupRecords appended", ["env"], registry=r)
        self.filtered = Counter(f"{p}groups_filtered", "Complete groups with equal rewards not appended (dynamic "
                                "sampling; their samples deleted)", ["env"], registry=r)
        self.passed = Counter(f"{p}groups_passed_uninformative", "Groups with equal rewards appended anyway (dynamic "
                              "sampling's guard: max_filtered_batches in a row were filtered)", ["env"], registry=r)
        self.filtered_fraction = Gauge(f"{p}filtered_fraction", "Fraction of the latest complete groups (64 or 4 x "
                                       "groups_per_step) that dynamic sampling filtered", registry=r)
        self.in_flight = Gauge(f"{p}in_flight", "Episodes running at env services", ["env"], registry=r)
        self.queued = Gauge(f"{p}queued", "Episodes of accepted groups waiting for a slot", registry=r)
        self.healthy = Gauge(f"{p}services_healthy", "Healthy services", ["env"], registry=r)
        r.register(_PausedGauge(pause_reasons))
        self.overhead = Histogram(f"{p}dispatch_overhead_seconds", "From episode ready to its POST written to the "
                                  "socket", buckets=OVERHEAD_BUCKETS, registry=r)
        self.duration = Histogram(f"{p}episode_seconds", "Episode wall time at the env service", ["env"],
                                  buckets=EPISODE_BUCKETS, registry=r)
        self.deadline = Gauge(f"{p}episode_deadline_seconds", "Deadline of the env's next episodes: sized from "
                              "its episode durations (orchestrator/deadlines.py) once it has them", ["env"], registry=r)
        self.groups_lost = Gauge(f"{p}groups_lost_to_redis", "Group records Redis acknowledged and lost in a restart "
                                 "from its AOF (appendfsync everysec, a host crash) in this run", registry=r)
        self.reward = Histogram(f"{p}reward", "Rewards of usable episodes", ["env"],
                                buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self._overheads = np.zeros((overhead_window, 2))
        """Ring buffer of (unix time, seconds) of the latest dispatches (percentiles without sorting lists)."""
        self._overhead_count = 0
        self._finishes: deque[float] = deque()

    def dispatched(self, overhead_s: float) -> None:
        self.overhead.observe(overhead_s)
        row = self._overhead_count % len(self._overheads)
        self._overheads[row, 0], self._overheads[row, 1] = time.time(), overhead_s
        self._overhead_count += 1

    def finished(self, now: float) -> None:
        self._finishes.append(now)

    def episodes_per_s(self, window_s: float) -> float:
        now = time.monotonic()
        while self._finishes and self._finishes[0] < now - window_s:
            self._finishes.popleft()
        return len(self._finishes) / window_s

    def overhead_summary(self, since: float = 0.0) -> dict[str, float]:
        """Percentiles of the recent dispatches made after unix time `since`."""
        recent = self._overheads[:min(self._overhead_count, len(self._overheads))]
        values = recent[recent[:, 0] >= since, 1]
        if not len(values):
            return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        p50, p99 = np.percentile(values, [50, 99], method="higher")
        return {"count": int(len(values)), "p50_ms": 1000 * p50, "p99_ms": 1000 * p99, "max_ms": 1000 * values.max()}
