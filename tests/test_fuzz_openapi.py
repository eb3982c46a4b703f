"""Schema-driven fuzzing of every service's published API: schemathesis generates valid and invalid
bodies, queries and paths for each operation in a service's /openapi.json, and no answer may be a 5xx.
A service must stay healthy afterwards. The budget per operation is small (CI runs all four services
in a few minutes); FUZZ_EXAMPLES raises it for a longer local run.

A route that joins a torch.distributed rendezvous may keep its caller waiting for a peer that never
comes (a generated address that resolves, "0" say): that is its contract, so there a call that times
out is no finding, but the engine must go on serving meanwhile (checked after the fuzzing)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.envs.service_process import ServiceProcess as EnvProcess
from tests.gateway.conftest import start_gateway
from tests.orchestrator.conftest import Orchestrator
from tests.rollout.conftest import start_engine

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
CALL_TIMEOUT_S = 20.0
RENDEZVOUS_ROUTES = {"/init_weights_update_group": 2.0}
"""path -> how long to wait for its answer; a timeout there is expected (see above)."""


@dataclass
class Findings:
    """What one service answered: counts per operation and every 5xx or hung call, reproducible."""

    calls: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def report(self) -> str:
        return "\n".join(self.failures[:30])


def fuzz(base_url: str, headers: dict[str, str] | None = None, examples: int = EXAMPLES) -> Findings:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers or {})
    found = Findings()
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(operation, mode, label, headers or {}, examples, found)
    print(f"fuzzed {base_url}: {sum(found.calls.values())} calls over {len(found.calls)} operations, "
          f"{len(found.failures)} findings")  # shown with -s (bench/results/hardening.md)
    return found


def _fuzz_operation(operation, mode, label: str, headers: dict[str, str], examples: int, found: Findings) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        found.calls[label] = found.calls.get(label, 0) + 1
        timeout = RENDEZVOUS_ROUTES.get(operation.path)
        try:
            response = case.call(headers=headers, timeout=timeout or CALL_TIMEOUT_S)
        except requests.Timeout:
            if timeout is None:
                found.failures.append(f"{label} timed out: {case.as_curl_command(headers)}")
            return
        except Exception as err:  # a hang or a dropped connection is a finding, not a crash of the fuzzer
            found.failures.append(f"{label} {type(err).__name__}: {case.as_curl_command(headers)}")
            return
        if response.status_code >= 500:
            found.failures.append(f"{label} -> {response.status_code} {response.text[:200]}: "
                                  f"{case.as_curl_command(headers)}")

    try:
        run()
    except Unsatisfiable:  # no parameters and no body: there is no invalid input to make
        assert mode is GenerationMode.NEGATIVE, label


def assert_healthy(url: str, headers: dict[str, str] | None = None) -> None:
    reply = httpx.get(url + "/health", headers=headers, timeout=5)
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("fuzz-engine"))
    yield proc
    assert proc.stop() == 0, proc.log()


def test_engine_answers_no_5xx_to_schema_driven_input(engine):
    found = fuzz(engine.url)
    assert not found.failures, found.report()
    httpx.post(engine.url + "/continue_generation", timeout=10)  # the fuzzer may have paused it
    httpx.post(engine.url + "/resume_memory_occupation", json={}, timeout=30)
    assert_healthy(engine.url)
    reply = httpx.post(engine.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 4, reply.text


def test_gateway_answers_no_5xx_to_schema_driven_input(engine, redis_server, tmp_path):
    gateway = start_gateway(tmp_path, [engine], redis_server.url, "fuzz-gateway")
    try:
        found = fuzz(gateway.url)
        assert not found.failures, found.report()
        assert_healthy(gateway.url)
    finally:
        assert gateway.stop() == 0, gateway.log()


def test_orchestrator_answers_no_5xx_to_schema_driven_input(redis_server, tmp_path):
    orchestrator = Orchestrator(tmp_path, redis_server.url, "fuzz-orchestrator")
    try:
        found = fuzz(orchestrator.url)
        assert not found.failures, found.report()
        assert_healthy(orchestrator.url)
    finally:
        assert orchestrator.stop() == 0, orchestrator.proc.log()


def test_env_service_answers_no_5xx_to_schema_driven_input(tmp_path):
    service = EnvProcess("envs.tasks.envs.ArithmeticEnv", tmp_path).start()
    try:
        found = fuzz(service.url)
        assert not found.failures, found.report()
        assert_healthy(service.url)
    finally:
        service.terminate()
        service.stop()
