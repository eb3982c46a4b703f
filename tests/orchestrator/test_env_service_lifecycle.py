"""A self-registered env service and a real orchestrator that dies or is replaced: the service registers
again with an orchestrator that does not know it (404 on its heartbeat), and exits (status 3, one
clear log line) when no orchestrator answers for --orchestrator-gone-s."""

import time

from tests.envs.service_process import ServiceProcess as EnvProcess
from tests.orchestrator.conftest import Orchestrator
from tests.services import wait_until

ARITHMETIC = "envs.tasks.ArithmeticEnv"
IDLE = ("--max-groups", "0")
"""The orchestrators here dispatch nothing: only registration and heartbeats are at stake."""


def wait_for(predicate, timeout_s: float, what: str, log=lambda: ""):
    return wait_until(predicate, timeout_s, lambda: f"waiting for {what}\n{log()}")


def registered_urls(orch: Orchestrator) -> list[str]:
    return [r["url"] for r in orch.envs()]


def test_service_exits_once_the_orchestrator_stays_unreachable(orchestrators, tmp_path):
    orch = orchestrators(*IDLE)
    service = EnvProcess(ARITHMETIC, tmp_path, "--orchestrator", orch.url, "--orchestrator-gone-s", "4").start()
    try:
        wait_for(lambda: service.url in registered_urls(orch), 30, "registration", service.log)
        time.sleep(1.0)  # heartbeats flowing (every 0.3 s): contact is fresh when the orchestrator dies
        orch.kill()
        killed = time.monotonic()
        code = service.wait_exit(30)
        waited = time.monotonic() - killed
    finally:
        service.stop()
    log = service.log_path.read_text()
    assert code == 3, log
    # The bound counts from the last accepted heartbeat (<= 0.3 s before the kill), plus one beat's lag.
    assert 3.5 <= waited <= 4.0 + 3.0, (waited, log)
    assert "CRITICAL" in log and "exiting (status 3): no answer from the orchestrator" in log
    assert "--orchestrator-gone-s 4" in log
    assert "env arithmetic stopped" in log  # a clean stop: drain, close, release


def test_service_registers_again_with_a_new_orchestrator_on_its_url(orchestrators, tmp_path, redis_server):
    first = orchestrators(*IDLE)
    service = EnvProcess(ARITHMETIC, tmp_path, "--orchestrator", first.url, "--orchestrator-gone-s", "60").start()
    try:
        wait_for(lambda: service.url in registered_urls(first), 30, "registration", service.log)
        # the service knows it is registered (a loaded machine can lose the first reply: it then
        # registers again, and the kill below must come after that)
        wait_for(lambda: "registered name=arithmetic" in service.log_path.read_text(), 30, "registered", service.log)
        first.kill()
        time.sleep(1.0)  # a few heartbeats fail
        # A new orchestrator where the old one was, without its state (another run): it has never heard
        # of the service, answers its heartbeat 404, and gets a registration.
        second = Orchestrator(tmp_path, redis_server.url, "fresh-run", *IDLE, name="orchestrator-new",
                              port=first.port)
        try:
            (record,) = wait_for(second.envs, 30, "re-registration", service.log)
            assert (record["url"], record["name"], record["domain"], record["healthy"]) == (
                service.url, "arithmetic", "tasks", True)
            beat = record["last_heartbeat"]
            wait_for(lambda: second.envs()[0]["last_heartbeat"] > beat, 10, "heartbeats to the new one")
            assert service.proc.poll() is None  # still serving
        finally:
            assert second.stop() == 0, second.proc.log()
    finally:
        service.stop()
    log = service.log_path.read_text()
    assert "no longer knows env_id" in log and log.count("registered name=arithmetic") == 2, log
    assert "reachable again" in log
