"""The supervisor every service runs under (asyncrl/supervisor.py): a dead service comes back where its
clients look, and one that cannot come back is given up with the reason, for the launcher to stop the run."""

import os
import signal
import socket
import time

import httpx

from asyncrl.config import EnvServiceConfig
from asyncrl.supervisor import RESTART_ATTEMPTS, ServiceActor
from asyncrl_run.launcher import env_service_args


def arithmetic_service(tmp_path, check_interval_s: float = 0.5) -> ServiceActor:
    env = EnvServiceConfig(name="arithmetic", target="envs.tasks.ArithmeticEnv")
    return ServiceActor("env-arithmetic-0", "envs.serve", env_service_args(tmp_path, env, None),
                        str(tmp_path / "services"), check_interval_s=check_interval_s)


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def test_a_service_started_on_a_free_port_comes_back_on_it(tmp_path):
    service = arithmetic_service(tmp_path)
    try:
        url, pid = service.url(), service.process.pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: service.restarts == 1 and service.status()["serving"])
        assert service.url() == url and service.process.pid != pid
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        service.shutdown()


def test_a_service_whose_port_is_taken_is_given_up_with_the_reason(tmp_path):
    service = arithmetic_service(tmp_path, check_interval_s=2.0)  # the port is taken well within one tick
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        port = service.port
        os.kill(service.process.pid, signal.SIGKILL)
        service.process.wait()
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        failure = wait_for(lambda: service.status()["failure"], timeout_s=120)
        assert failure.startswith(f"could not be restarted ({RESTART_ATTEMPTS} attempts): env-arithmetic-0 exited "
                                  "with 1 while starting (OSError: [Errno 98] Address already in use"), failure
        assert service.failed_restarts == RESTART_ATTEMPTS and not service.status()["serving"]
    finally:
        squatter.close()
        service.shutdown()
