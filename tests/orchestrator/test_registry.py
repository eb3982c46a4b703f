"""The env registry over HTTP and the CLI: self-registration with heartbeats, operator registration
with /health probes, listing, removal, bearer tokens, and errors that name what is wrong
(docs/protocols/orchestrator.md)."""

import os
import subprocess
import sys
import time

from tests.orchestrator.conftest import ROOT_DIR, journal, start_envs
from tests.services import unpublished_bodies

TOKEN = "orch-secret"


def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    env.pop("ASYNCRL_ORCHESTRATOR_TOKEN", None)
    if token:
        env["ASYNCRL_ORCHESTRATOR_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "asyncrl_run.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT_DIR, timeout=60)


def test_self_registered_service_heartbeats_gets_episodes_and_deregisters(orchestrators, tmp_path, run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "3")
    (service,) = start_envs(tmp_path, 1, "--name", "selfreg", "--capacity", "4", "--option", "sleep_s=0.1",
                            "--option", f"journal={tmp_path}", "--orchestrator", orch.url)
    first = orch.wait(lambda s: len(orch.envs()) == 1, what="registration")
    (record,) = orch.envs()
    assert {k: record[k] for k in ("name", "domain", "url", "capacity", "heartbeat", "healthy")} == {
        "name": "selfreg", "domain": "test", "url": service.url, "capacity": 4, "heartbeat": "push", "healthy": True}
    orch.wait_done(3)
    assert first is not None and len(journal(tmp_path, run_name)) == 12  # 6 starts, 6 ends
    beat = record["last_heartbeat"]
    time.sleep(1.0)
    assert orch.envs()[0]["last_heartbeat"] > beat  # heartbeats keep coming (every 0.3 s here)
    assert service.stop() == 0  # SIGTERM: the service deregisters itself
    orch.wait(lambda s: orch.envs() == [], what="deregistration")


def test_cli_registers_lists_probes_and_removes_a_service(orchestrators, tmp_path, run_name):
    (service,) = start_envs(tmp_path, 1, "--name", "byhand", "--capacity", "6", "--option", "sleep_s=0.1",
                            "--option", f"journal={tmp_path}")
    orch = orchestrators("--group-size", "2", "--max-groups", "2", "--auth-token", TOKEN, token=TOKEN)

    refused = cli("env", "register", "--orchestrator", orch.url, "--url", service.url)
    assert refused.returncode != 0 and "401" in refused.stderr
    done = cli("env", "register", "--orchestrator", orch.url, "--url", service.url, token=TOKEN)
    assert done.returncode == 0, done.stderr
    env_id = done.stdout.strip()
    listed = cli("env", "list", "--orchestrator", orch.url, token=TOKEN)
    assert listed.returncode == 0 and env_id in listed.stdout and "byhand" in listed.stdout
    (record,) = orch.envs()
    # name, domain and capacity came from the service's /info; the orchestrator probes its /health
    assert (record["name"], record["domain"], record["capacity"], record["heartbeat"]) == ("byhand", "test", 6, "probe")
    orch.wait_done(2)
    assert len([e for e in journal(tmp_path, run_name) if e["event"] == "start"]) == 4

    service.proc.kill()
    service.proc.wait()
    orch.wait(lambda s: not orch.envs()[0]["healthy"], timeout_s=30, what="failed probes")
    removed = cli("env", "remove", "--orchestrator", orch.url, env_id, token=TOKEN)
    assert removed.returncode == 0 and f"removed {env_id}" in removed.stdout
    assert orch.envs() == []
    service.stop()


def test_registry_errors_name_the_problem(orchestrators):
    orch = orchestrators()
    bad = orch.http.post("/v1/envs", json={"name": "x", "domain": "d", "url": "http://127.0.0.1:1", "capacity": 0})
    assert bad.status_code == 400 and "capacity" in bad.json()["error"]
    missing = orch.http.post("/v1/envs", json={"domain": "d", "url": "http://127.0.0.1:1", "capacity": 1})
    assert missing.status_code == 400 and "name" in missing.json()["error"]
    unknown = orch.http.post("/v1/envs/env-nope/heartbeat", json={"in_flight": 0})
    assert unknown.status_code == 404 and "env-nope" in unknown.json()["error"]
    assert orch.http.delete("/v1/envs/env-nope").status_code == 404
    env_id = orch.register("http://127.0.0.1:1/", name="a")
    assert orch.register("http://127.0.0.1:1", name="a") == env_id  # same URL: same entry
    clash = orch.http.post("/v1/envs", json={"name": "b", "domain": "d", "url": "http://127.0.0.1:1", "capacity": 1})
    assert clash.status_code == 400 and "already registered" in clash.json()["error"]
    assert orch.http.get("/health").json() == {"status": "ok"}


BAD_FIELDS = [
    ({"url": "file:///etc/passwd"}, "url"), ({"url": "not a url"}, "url"), ({"url": "http://"}, "url"),
    ({"url": "http://127.0.0.1:99999"}, "url"), ({"url": "http://h/" + "x" * 500_000}, "url"),
    ({"url": 7}, "url"), ({"name": "../etc"}, "name"), ({"name": "a\nforged log line"}, "name"),
    ({"name": "n" * 129}, "name"), ({"domain": "d d"}, "domain"), ({"capacity": "4"}, "capacity"),
    ({"capacity": True}, "capacity"), ({"capacity": 10 ** 7}, "capacity"), ({"weight": 0}, "weight"),
    ({"weight": 1e7}, "weight"), ({"heartbeat": "pull"}, "heartbeat"),
]


def test_registration_fields_are_checked_for_type_and_range(orchestrators):
    """Every field of a registration: a 400 naming it; nothing registered, and the log never echoes the
    long URL (a 5 MB one once went into every log line about the service); a body over 1 MiB is a 413,
    unread."""
    orch = orchestrators()
    good = {"name": "ok", "domain": "d", "url": "http://127.0.0.1:1", "capacity": 1}
    for change, field in BAD_FIELDS:
        reply = orch.http.post("/v1/envs", json={**good, **change})
        assert reply.status_code == 400 and reply.json()["error"].startswith(f"{field}:"), (change, reply.text[:300])
        assert len(reply.text) < 2000
    for body, field in [({"in_flight": -1}, "in_flight"), ({"in_flight": "3"}, "in_flight"),
                        ({"healthy": "yes"}, "healthy"), ({"healthy": 1}, "healthy")]:
        reply = orch.http.post("/v1/envs/env-nope/heartbeat", json=body)
        assert reply.status_code == 400 and reply.json()["error"].startswith(f"{field}:"), reply.text
    long_id = orch.http.delete("/v1/envs/" + "e" * 5000)
    assert long_id.status_code == 400 and "env_id" in long_id.text and len(long_id.text) < 2000
    assert orch.http.get("/v1/status", params={"overhead_since": "-1"}).status_code == 400
    huge = orch.http.post("/v1/envs", json={**good, "url": "http://h/" + "x" * 5_000_000})
    assert huge.status_code == 413 and "exceeds" in huge.json()["error"], huge.text[:300]
    assert orch.envs() == []
    assert orch.register("https://env.example:8443/base", name="ok.v2_a-1") and len(orch.envs()) == 1
    assert "x" * 1000 not in orch.proc.log()


def test_openapi_publishes_every_request_body(orchestrators):
    openapi = orchestrators().http.get("/openapi.json").json()
    assert unpublished_bodies(openapi, frozenset({"POST /v1/pause", "POST /v1/resume"})) == []
    body = openapi["paths"]["/v1/envs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["required"]) == {"name", "url", "capacity"} and body["properties"]["url"]["maxLength"] == 2048


def test_episodes_draining_at_a_removed_service_count_in_its_env(orchestrators, tmp_path):
    """A removed service's running episodes finish and count: in the total in flight and in its env's
    (the env's figure once summed only the services still in its queue, and read 0 while the total
    read 9: `asyncrl watch`'s env table)."""
    (service,) = start_envs(tmp_path, 1, "--name", "draining", "--capacity", "4", "--option", "sleep_s=30")
    orch = orchestrators("--group-size", "2", "--max-in-flight", "4")
    env_id = orch.register(service.url, name="draining", capacity=4)
    orch.wait(lambda s: s["in_flight"] == 4, what="4 episodes running")
    assert orch.http.delete(f"/v1/envs/{env_id}").json()["draining"] == 4
    status = orch.status()
    assert status["in_flight"] == 4 and status["by_env"]["draining"]["in_flight"] == 4
    assert status["by_env"]["draining"]["healthy_services"] == 0
    service.stop()
