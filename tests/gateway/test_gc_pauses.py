"""What keeps the control plane's GC pauses short, on the real gateway and orchestrator processes: the startup
heap and then every collection's survivors are frozen and swept every gc_sweep_s (asyncrl.gc_policy; the
setting reaches both, and a bad value stops them by name), every collection is timed on /metrics
(asyncrl/gc_metrics.py), and a finished session keeps only its JSON record, which reads back exactly as the
live ledger did."""

from __future__ import annotations

import gc
import re
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from asyncrl.gc_metrics import register_gc_metrics
from asyncrl.gc_policy import frozen_objects
from tests.gateway.conftest import start_gateway
from tests.services import ServiceProcess


def value(text: str, series: str) -> float:
    return float(re.search(rf"^{re.escape(series)} (\S+)$", text, re.M).group(1))


def test_collections_are_timed_per_generation():
    registry = CollectorRegistry()
    register_gc_metrics(registry, "asyncrl_test_")
    count = 'asyncrl_test_gc_pause_seconds_count{generation="2"}'
    before = value(generate_latest(registry).decode(), count)
    gc.collect()
    text = generate_latest(registry).decode()
    assert value(text, count) == before + 1
    assert value(text, 'asyncrl_test_gc_pause_seconds_bucket{generation="2",le="+Inf"}') == before + 1
    assert value(text, "asyncrl_test_gc_frozen_objects") == frozen_objects()


def test_the_gateway_freezes_its_startup_heap_and_compacts_finished_sessions(redis_server, run_name, tmp_path):
    engine = ServiceProcess("bench.standin_engine", ["--ttft-s", "0.01", "--decode-s-per-token", "0"], tmp_path,
                            name="standin")
    gateway = start_gateway(tmp_path, [engine], redis_server.url, run_name, "--gc-sweep-s", "0.5")
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            sid = http.post("/sessions", json={}).json()["session_id"]
            messages = [{"role": "user", "content": "hi"}]
            for _ in range(2):
                reply = http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
                assert reply.status_code == 200, reply.text
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
            live = http.get(f"/sessions/{sid}").json()
            finish = http.post(f"/sessions/{sid}/finish", json={"reward": 1.0})
            assert finish.status_code == 200, finish.text
            closed = http.get(f"/sessions/{sid}").json()
            again = http.post(f"/sessions/{sid}/finish", json={"reward": 0.0})
            turn = http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
            wait_for_sweeps(gateway, 2)
            text = http.get("/metrics").text
    finally:
        gateway.stop()
        engine.stop()
    assert value(text, "asyncrl_gateway_gc_frozen_objects") > 100_000  # modules, app, tokenizer: ~250,000
    assert value(text, 'asyncrl_gateway_gc_pause_seconds_count{generation="0"}') > 0
    assert value(text, 'asyncrl_gateway_gc_pause_seconds_count{generation="2"}') >= 3  # startup, two sweeps
    assert len(live["segments"][0]["tokens"]) > 10
    assert closed == {**live, "status": "completed", "sample_refs": finish.json()["sample_refs"]}
    assert again.json() == finish.json()  # idempotent: the first reply, from its stored JSON
    assert turn.status_code == 409, turn.text


def wait_for_sweeps(service: ServiceProcess, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while service.log().count("gc sweep:") < n:
        assert time.monotonic() < deadline, service.log()
        time.sleep(0.1)


def test_the_orchestrator_sweeps_as_configured_and_refuses_a_bad_interval(redis_server, tmp_path):
    args = ["--redis-url", redis_server.url, "--run", "gc-policy", "--llm-url", "http://127.0.0.1:9/v1"]
    orchestrator = ServiceProcess("orchestrator.server", [*args, "--gc-sweep-s", "0.3"], tmp_path)
    try:
        wait_for_sweeps(orchestrator, 2)
    finally:
        assert orchestrator.stop() == 0, orchestrator.log()
    with pytest.raises(RuntimeError, match="gc_sweep_s must be >= 0"):
        ServiceProcess("orchestrator.server", [*args, "--gc-sweep-s", "-1"], tmp_path, name="refused")
