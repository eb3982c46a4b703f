"""asyncrl_gateway_added_latency_seconds is a turn's latency minus the engine's own time: behind a stand-in
engine that takes 0.4 s per call (bench/standin_engine.py), turns take >= 0.4 s while what the gateway adds
stays far below it, and is not clamped to zero either. It splits exactly into the gateway's own time
(asyncrl_gateway_own_latency_seconds: the turn less its engine calls' wall time) and the engine hop
(asyncrl_gateway_engine_hop_seconds: each call's wall time less the engine's own)."""

from __future__ import annotations

import re

import httpx

from tests.gateway.conftest import start_gateway
from tests.services import ServiceProcess

ENGINE_S = 0.4


def histogram(text: str, name: str, labels: str = '{api="chat"}') -> tuple[float, float]:
    """(sum, count) of a histogram's series (api="chat" unless other `labels`) in Prometheus text."""
    values = [float(re.search(rf'^{name}_{part}{re.escape(labels)} (\S+)$', text, re.M).group(1))
              for part in ("sum", "count")]
    return values[0], values[1]


def test_added_latency_excludes_engine_time(redis_server, run_name, tmp_path):
    engine = ServiceProcess("bench.standin_engine", ["--ttft-s", str(ENGINE_S), "--decode-s-per-token", "0"], tmp_path,
                            name="standin")
    gateway = start_gateway(tmp_path, [engine], redis_server.url, run_name)
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            for i in range(3):
                sid = http.post("/sessions", json={}).json()["session_id"]
                reply = http.post(f"/sessions/{sid}/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8})
                assert reply.status_code == 200, reply.text
                assert float(reply.headers["x-engine-latency-s"]) >= ENGINE_S
            text = http.get("/metrics").text
    finally:
        gateway.stop()
        engine.stop()
    turn_sum, turns = histogram(text, "asyncrl_gateway_turn_latency_seconds")
    added_sum, added = histogram(text, "asyncrl_gateway_added_latency_seconds")
    assert turns == added == 3
    assert turn_sum >= 3 * ENGINE_S
    assert 0 < added_sum < 3 * 0.1, added_sum
    own_sum, own = histogram(text, "asyncrl_gateway_own_latency_seconds")
    hop_sum, hops = histogram(text, "asyncrl_gateway_engine_hop_seconds", labels="")
    assert own == hops == 3 and 0 < own_sum < added_sum and hop_sum > 0
    assert abs(own_sum + hop_sum - added_sum) < 1e-6, (own_sum, hop_sum, added_sum)
