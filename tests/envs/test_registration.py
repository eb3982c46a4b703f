"""Self-registration and heartbeats against a recording orchestrator, and a clean SIGTERM."""

import asyncio
import socket

import httpx
import pytest

from asyncrl.protocols.orchestrator import RegisterRequest
from envs.sdk.registration import Registrar
from envs.tasks import ArithmeticEnv
from tests.envs.recording_orchestrator import RecordingOrchestrator
from tests.envs.scripted_llm import say
from tests.envs.service_process import ServiceProcess, episode_request, run_episode

TOKEN = "s3cret-token"


@pytest.fixture
def orchestrator():
    server = RecordingOrchestrator(token=TOKEN).start()
    yield server
    server.stop()


async def test_service_registers_heartbeats_and_deregisters_on_sigterm(orchestrator, scripted_llm, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("ASYNCRL_ORCHESTRATOR_TOKEN", TOKEN)  # the token travels by environment, not argv
    service = ServiceProcess("envs.tasks.ArithmeticEnv", tmp_path, "--orchestrator", orchestrator.url,
                             "--capacity", "3", "--weight", "2.5", "--drain-grace-s", "3").start()
    try:
        (register,) = orchestrator.wait_for(orchestrator.registrations)
        assert register.authorization == f"Bearer {TOKEN}"
        assert register.body == {"name": "arithmetic", "domain": "tasks", "url": service.url, "capacity": 3,
                                 "weight": 2.5, "heartbeat": "push"}
        orchestrator.wait_for(lambda: len(orchestrator.of("POST", "/heartbeat")) >= 3)
        assert {c.path for c in orchestrator.of("POST", "/heartbeat")} == {"/v1/envs/env-1/heartbeat"}
        assert orchestrator.of("POST", "/heartbeat")[0].body == {"in_flight": 0, "healthy": True}

        answer = ArithmeticEnv().problem("arith-00000").answers[0]
        url, _ = scripted_llm.script(say(answer, delay_s=30))
        async with httpx.AsyncClient() as client:
            running = asyncio.create_task(run_episode(client, service.url, "arith-00000", url))
            await asyncio.to_thread(orchestrator.wait_for,
                                    lambda: [c for c in orchestrator.of("POST", "/heartbeat") if c.body["in_flight"] == 1])
            service.terminate()  # SIGTERM mid-episode: deregister, refuse new work, grace 3 s, abort, exit 0
            await asyncio.to_thread(orchestrator.wait_for, lambda: orchestrator.of("DELETE"))
            refused = await client.post(f"{service.url}/episodes", json=episode_request("arith-00001", url))
            result = await running
        assert service.wait_exit(30) == 0
    finally:
        service.stop()
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
    assert result["status"] == "aborted"
    (deregister,) = orchestrator.of("DELETE")
    assert deregister.path == "/v1/envs/env-1" and deregister.authorization == f"Bearer {TOKEN}"
    assert all(c.at <= deregister.at for c in orchestrator.of("POST", "/heartbeat"))  # no beats after leaving


def registrar_for(url: str, token=TOKEN, in_flight=lambda: 0) -> Registrar:
    info = RegisterRequest(name="probe", domain="test", url="http://127.0.0.1:1", capacity=1, weight=1.0)
    return Registrar(url, info, in_flight, token=token, retry_s=0.05, max_retry_s=0.2)


async def test_registers_again_when_the_orchestrator_forgets(orchestrator):
    registrar = registrar_for(orchestrator.url, in_flight=lambda: 7)
    registrar.start()
    try:
        await asyncio.to_thread(orchestrator.wait_for, lambda: len(orchestrator.of("POST", "/heartbeat")) >= 2)
        orchestrator.forget("env-1")  # e.g. restarted without its state
        await asyncio.to_thread(orchestrator.wait_for, lambda: "env-2" in orchestrator.registered)
        await asyncio.to_thread(orchestrator.wait_for, lambda: orchestrator.of("POST", "/v1/envs/env-2/heartbeat"))
    finally:
        await registrar.stop()
    assert orchestrator.of("POST", "/v1/envs/env-2/heartbeat")[0].body == {"in_flight": 7, "healthy": True}
    assert [c.path for c in orchestrator.of("DELETE")] == ["/v1/envs/env-2"]


async def test_waits_for_an_orchestrator_that_starts_later():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    registrar = registrar_for(f"http://127.0.0.1:{port}")
    registrar.start()
    await asyncio.sleep(0.5)  # several refused attempts
    late = RecordingOrchestrator(token=TOKEN, port=port).start()
    try:
        await asyncio.wait_for(registrar.registered.wait(), 10)
        assert registrar.env_id == "env-1"
    finally:
        await registrar.stop()
        late.stop()


async def test_wrong_token_is_reported_not_retried(orchestrator, caplog):
    registrar = registrar_for(orchestrator.url, token="wrong")
    registrar.start()
    await asyncio.sleep(1.0)
    await registrar.stop()
    assert len(orchestrator.registrations()) == 1 and registrar.env_id is None
    assert "rejected the registration: 401" in caplog.text


async def test_heartbeats_and_episodes_are_logged_at_debug_only(orchestrator, scripted_llm, tmp_path, monkeypatch):
    """At INFO a service logs its start, its registration and its stop, not every heartbeat (httpx's
    request lines included) or every episode: that was ~470 KB in two minutes."""
    monkeypatch.setenv("ASYNCRL_ORCHESTRATOR_TOKEN", TOKEN)
    quiet, verbose = (ServiceProcess("envs.tasks.ArithmeticEnv", tmp_path, "--orchestrator", orchestrator.url,
                                     *level).spawn() for level in ((), ("--log-level", "DEBUG")))
    try:
        for service in (quiet, verbose):
            service.wait_ready()
        orchestrator.wait_for(lambda: len(orchestrator.of("POST", "/heartbeat")) >= 40)  # 20+ beats each
        answer = ArithmeticEnv().problem("arith-00000").answers[0]
        async with httpx.AsyncClient() as client:
            for service in (quiet, verbose):
                for _ in range(3):
                    url, _ = scripted_llm.script(say(answer))
                    assert (await run_episode(client, service.url, "arith-00000", url))["reward"] == 1.0
    finally:
        assert quiet.stop() == 0 and verbose.stop() == 0
    quiet_log, verbose_log = (service.log_path.read_text() for service in (quiet, verbose))
    assert "registered name=arithmetic" in quiet_log and "env arithmetic stopped" in quiet_log
    for noise in ("heartbeat env_id", "/heartbeat", "HTTP Request", "episode="):
        assert noise not in quiet_log, quiet_log
        assert noise in verbose_log  # the same lines exist, one level down
    assert len(quiet_log.splitlines()) <= 20, quiet_log
    assert verbose_log.count("DEBUG envs.registration heartbeat") >= 20
