"""Shared test harness: real services started by the fixture that owns them, stopped by its handle."""

from __future__ import annotations

import uuid

import pytest

from asyncrl_run.redis_server import EmbeddedRedis
from tests.envs.service_process import ServiceProcess


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server (AOF on) for the session; tests isolate themselves by run name."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def run_name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def local_ray():
    """A fresh local Ray instance for one test module (never the cluster a stale /tmp/ray file names);
    its workers import this checkout."""
    import ray

    from tests.services import ROOT

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_arch():
    from asyncrl.config import load_model_section

    return load_model_section("tiny").arch


def save_tiny_checkpoint(path, arch, seed: int):
    from asyncrl.model.io import save_pretrained
    from asyncrl.model.model import Glm5ForCausalLM

    save_pretrained(Glm5ForCausalLM.from_config(arch, seed=seed), path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_arch):
    """A random tiny GLM-5 in HF format (seed 0)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-seed0"), tiny_arch, seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint_b(tmp_path_factory, tiny_arch):
    """The same architecture with other weights (seed 1): a 'new version' for weight updates."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-seed1"), tiny_arch, seed=1)


@pytest.fixture(autouse=True)
def _no_env_service_outlives_its_test():
    """Stops the env services a test spawned and did not stop (it failed before its stop()); those of
    session fixtures (spawned before the test) stay."""
    before = set(ServiceProcess.live)
    yield
    for service in ServiceProcess.live - before:
        service.stop()
