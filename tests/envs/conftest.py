"""Fixtures of the env tests: one scripted LLM server for the session, env services as real processes."""

from __future__ import annotations

import pytest

from tests.envs.scripted_llm import ScriptedLLM
from tests.envs.service_process import ServiceProcess


@pytest.fixture(scope="session")
def scripted_llm():
    server = ScriptedLLM().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="module")
def start_services(service_dir):
    """start_services(("envs.tasks.ArithmeticEnv", "--capacity", "2"), ...) -> running ServiceProcesses,
    started in parallel (each process spends seconds importing)."""
    started = []

    def start(*specs: tuple[str, ...]) -> list[ServiceProcess]:
        services = [ServiceProcess(env, service_dir, *args).spawn() for env, *args in specs]
        started.extend(services)
        return [service.wait_ready() for service in services]

    yield start
    for service in started:
        service.terminate()
    for service in started:
        service.stop()
