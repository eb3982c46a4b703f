"""The engine's Prometheus metrics under SGLang's names (docs/run.md): counters of finished requests and
the scheduler's load as gauges."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rollout.engine import Engine
from rollout.request import Req


class _LoadGauges(Collector):
    """The scheduler's load as SGLang's gauges, read once per scrape (Scheduler.loads walks the queue)."""

    def __init__(self, loads: Callable[[], dict[str, int]]) -> None:
        self.loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.loads()
        yield GaugeMetricFamily("sglang_num_running_reqs", "running requests", value=now["num_running_reqs"])
        yield GaugeMetricFamily("sglang_num_queue_reqs", "waiting requests", value=now["num_waiting_reqs"])
        yield GaugeMetricFamily("sglang_token_usage", "fraction of KV slots in use",
                                value=now["num_used_tokens"] / now["max_total_num_tokens"])


class EngineMetrics:
    """What /metrics serves; `finished` is called from the engine thread as each request ends."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("sglang_num_requests", "finished generate requests", ["finish"], registry=r)
        self.prompt_tokens = Counter("sglang_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("sglang_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("sglang_cached_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.spec_verify = Counter("sglang_spec_verify", "speculative decoding: verification forwards of finished "
                                   "requests (accept length = sglang_spec_tokens / this)", registry=r)
        self.spec_tokens = Counter("sglang_spec_tokens", "speculative decoding: tokens those forwards emitted",
                                   registry=r)
        self.e2e_latency = Histogram("sglang_e2e_request_latency_seconds", "request latency", registry=r,
                                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        r.register(_LoadGauges(engine.scheduler.loads))

    def finished(self, req: Req) -> None:
        self.requests.labels(req.finish_reason["type"]).inc()
        self.prompt_tokens.inc(len(req.prompt))
        self.generation_tokens.inc(len(req.output_ids))
        self.cached_tokens.inc(req.cached_tokens)
        if req.spec_verify_ct:
            self.spec_verify.inc(req.spec_verify_ct)
            self.spec_tokens.inc(len(req.output_ids))
        self.e2e_latency.observe(time.monotonic() - req.created)
