"""Prometheus metrics of the gateway (GET /metrics): `asyncrl_gateway_*` (docs/run.md "Metrics")."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.gc_metrics import register_gc_metrics

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ADDED_LATENCY_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015,
                         0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
"""Finer below 5 ms, where the gateway's own share of a turn should be (bench/results/control_plane_scale.md)."""
PREFIX = "asyncrl_gateway_"


class GatewayMetrics:
    def __init__(self, active_sessions: Callable[[], int], healthy_engines: Callable[[], int]) -> None:
        self.registry = r = CollectorRegistry()
        p = PREFIX
        Gauge(f"{p}sessions_active", "sessions open (not finished)", registry=r).set_function(active_sessions)
        Gauge(f"{p}engines_healthy", "engines routed to", registry=r).set_function(healthy_engines)
        self.sessions_created = Counter(f"{p}sessions_created", "sessions created", registry=r)
        self.sessions_finished = Counter(f"{p}sessions_finished", "sessions finished", ["status"], registry=r)
        self.samples_written = Counter(f"{p}samples_written", "segments appended to Redis", registry=r)
        self.turns = Counter(f"{p}turns", "turns generated", ["api", "finish_reason"], registry=r)
        self.new_segments = Counter(f"{p}new_segments", "segments opened because history was edited", registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "tokens appended to sessions (mask 0)", registry=r)
        self.cached_prompt_tokens = Counter(f"{p}cached_prompt_tokens", "turn prompt tokens the engines served from "
                                            "their prefix cache", registry=r)
        self.generated_tokens = Counter(f"{p}generated_tokens", "model tokens recorded (mask 1)", registry=r)
        self.engine_errors = Counter(f"{p}engine_errors", "failed engine calls (failed over)", ["engine"],
                                     registry=r)
        self.engine_interruptions = Counter(f"{p}engine_interruptions",
                                            "engine calls that ended by abort and were continued", registry=r)
        self.client_disconnects = Counter(f"{p}client_disconnects", "turns aborted by a client disconnect",
                                          registry=r)
        self.turn_latency = Histogram(f"{p}turn_latency_seconds", "turn latency, engine time included",
                                      ["api"], buckets=LATENCY_BUCKETS, registry=r)
        self.added_latency = Histogram(f"{p}added_latency_seconds", "turn latency minus the engines' own "
                                       "e2e_latency: gateway work, the engine hop's HTTP, failover and waits",
                                       ["api"], buckets=ADDED_LATENCY_BUCKETS, registry=r)
        self.own_latency = Histogram(f"{p}own_latency_seconds", "turn latency minus the wall time of its engine "
                                     "calls as the gateway saw them: gateway work, failover and waits, not the "
                                     "engine hop", ["api"], buckets=ADDED_LATENCY_BUCKETS, registry=r)
        self.engine_hop = Histogram(f"{p}engine_hop_seconds", "an engine call's wall time minus the engine's own "
                                    "e2e_latency: HTTP both ways, the gateway's client encoding the request and "
                                    "parsing the reply, the engine server's work outside its scheduler "
                                    "(non-streamed calls)", buckets=ADDED_LATENCY_BUCKETS, registry=r)
        register_gc_metrics(r, p)
        self.engine_latency = Histogram(f"{p}engine_latency_seconds", "engine call latency",
                                        buckets=LATENCY_BUCKETS, registry=r)
