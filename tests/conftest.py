"""Shared test harness: real services started by the fixture that owns them, stopped by its handle."""

from __future__ import annotations

import uuid

import pytest

from asyncrl.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server (AOF on) for the session; tests isolate themselves by run name."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def run_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"
