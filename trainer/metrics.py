"""The trainer's Prometheus endpoint: GET /metrics (`asyncrl_trainer_*`, docs/run.md "Metrics") and
GET /health, served from a daemon thread of the trainer process (http.server: the trainer runs no web
framework, and a scrape must not wait for the event loop, which a training step keeps busy).

The URL is recorded in the run's `services` hash as `trainer_metrics` (Trainer.announce), where
`asyncrl watch` and operators find it.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from asyncrl.network import http_url

log = logging.getLogger("trainer.metrics")

PREFIX = "asyncrl_trainer_"
PHASES = ("wait", "train", "push", "checkpoint", "step")
"""Phases of a step (seconds in the step record as <phase>_s): waiting for groups, forward/backward and
optimizer, weight push, checkpoint and acknowledgement, and the whole step."""
LAST_STEP = {"loss": "loss", "reward_mean": "reward_mean", "grad_norm": "grad_norm",
             "tokens_per_s": "tokens_per_second", "staleness_mean": "staleness_mean",
             "staleness_max": "staleness_max", "masked_fraction": "masked_fraction", "entropy": "entropy",
             "mismatch_kl": "mismatch_kl", "off_policy/max_abs_log_ratio": "max_abs_log_ratio",
             "off_policy/masked_low_fraction": "masked_low_fraction",
             "off_policy/masked_high_fraction": "masked_high_fraction", "off_policy/ess_fraction": "ess_fraction"}
"""Step-record key -> gauge name (after the prefix): the value of the last step."""


class TrainerMetrics:
    """`step` and `weight_version` are read from the trainer's state at scrape time; the rest is set by
    `observe(step record)` after every step."""

    def __init__(self, step: Callable[[], int], weight_version: Callable[[], int]) -> None:
        self.registry = r = CollectorRegistry()
        p = PREFIX
        Gauge(f"{p}step", "optimizer steps trained (restored ones included)", registry=r).set_function(step)
        Gauge(f"{p}weight_version", "weight version of the trainer's model (the last push)",
              registry=r).set_function(weight_version)
        self.last = {key: Gauge(f"{p}{name}", f"{key} of the last step", registry=r) for key, name in LAST_STEP.items()}
        self.last_phase = Gauge(f"{p}last_step_seconds", "seconds of each phase of the last step", ["phase"],
                                registry=r)
        self.phases = Counter(f"{p}phase_seconds", "seconds spent in each phase since this process started "
                              "(rate: the fraction of time in it)", ["phase"], registry=r)
        self.steps = Counter(f"{p}steps", "steps trained by this process", registry=r)
        self.tokens = Counter(f"{p}tokens", "tokens trained by this process", registry=r)
        self.push_failures = Counter(f"{p}push_failed_engines", "engines that did not take a weight push",
                                     registry=r)
        for phase in PHASES:  # every series exists from the start
            self.last_phase.labels(phase)
            self.phases.labels(phase)

    def observe(self, record: dict[str, float]) -> None:
        """One step record (trainer/loop.py step_metrics)."""
        for key, gauge in self.last.items():
            if key in record:
                gauge.set(record[key])
        for phase in PHASES:
            seconds = record.get(f"{phase}_s", 0.0)
            self.last_phase.labels(phase).set(seconds)
            self.phases.labels(phase).inc(seconds)
        self.steps.inc()
        self.tokens.inc(record.get("tokens", 0.0))
        self.push_failures.inc(record.get("push_failed_engines", 0.0))


class MetricsServer:
    """GET /metrics and GET /health on `host`:`port` (0: a free port) from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], dict], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/health":
                    self._reply(200, json.dumps({"status": "ok", **health()}).encode(), "application/json")
                else:
                    self._reply(404, json.dumps({"error": f"no route {path}"}).encode(), "application/json")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:  # one line per scrape otherwise
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = http_url(host, self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="trainer-metrics", daemon=True)
        self._thread.start()
        log.info("trainer metrics at %s/metrics", self.url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(metrics: TrainerMetrics, health: Callable[[], dict], host: str,
                  port: Optional[int]) -> Optional[MetricsServer]:
    """The endpoint, or None when `port` is None (off) or it cannot bind (logged: training goes on)."""
    if port is None:
        return None
    try:
        return MetricsServer(metrics.registry, health, host, port)
    except OSError as err:
        log.warning("trainer metrics endpoint not started: cannot bind %s:%s (%s)", host, port, err)
        return None
