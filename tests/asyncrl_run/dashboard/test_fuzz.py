"""The dashboard's published API fuzzed as every service's is (tests/test_fuzz_openapi.py): schemathesis's
valid and invalid queries and paths for each operation, against a run of hand-written records; no answer
may be a 5xx, and it stays healthy."""

from __future__ import annotations

import asyncio

import pytest

from tests.asyncrl_run.dashboard.test_api import _write_run
from tests.services import ServiceProcess
from tests.test_fuzz_openapi import assert_healthy, fuzz

pytestmark = pytest.mark.timeout(600)


def test_dashboard_answers_no_5xx_to_schema_driven_input(redis_server, run_name, tmp_path):
    asyncio.run(_write_run(redis_server.url, run_name))
    dashboard = ServiceProcess("asyncrl_run.dashboard.server", ["--redis-url", redis_server.url, "--run", run_name,
                                                            "--log-level", "WARNING"], tmp_path, name="dashboard")
    try:
        found = fuzz(dashboard.url)
        assert not found.failures, found.report()
        assert set(found.calls) >= {"GET /api/samples", "GET /api/samples/{ref}", "GET /api/curves"}
        assert_healthy(dashboard.url)
    finally:
        assert dashboard.stop() == 0, dashboard.log()
