"""The dashboard's JSON API against a real redis-server holding hand-written records: the run's progress and
curves, the trajectory browser's filters, paging and one opened sample (turns, tool call, per-token arrays,
the trainer's record), 4xx naming a bad parameter, the token (401 without it, the login cookie), a finished
run read from a replay of its Redis data, and the command serving and stopping cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from asyncrl.store import Store
from asyncrl_run.dashboard.app import build_app
from asyncrl_run.redis_server import EmbeddedRedis
from asyncrl_run.watch import Target
from tests.asyncrl_run.dashboard.samples import agent_sample, trained_record
from tests.services import ServiceProcess

pytestmark = pytest.mark.timeout(120)


def run_sync(coro):
    return asyncio.run(coro)


async def _write_run(url: str, run: str, steps: int = 3) -> list[str]:
    """A run's records: the services hash, `steps` trainer records, one orchestrator record, six samples
    (two envs, rewards 0 / 1, one failed), the first four trained at steps 1 and 2."""
    store = Store.connect(url, run)
    try:
        await store.redis.hset(store.key("services"), mapping={
            "total_steps": "10", "mode": "async", "started_at": str(time.time() - 60),
            "orchestrator": "http://127.0.0.1:9", "gateway": "http://127.0.0.1:9"})
        for step in range(1, steps + 1):
            await store.add_metrics("trainer", trainer_record(step))
        await store.add_metrics("orchestrator", {"in_flight": 4.0, "episodes_per_s": 2.5, "completed": 12.0,
                                                 "env/calc/healthy_services": 1.0, "env/calc/in_flight": 3.0,
                                                 "env/calc/outcome_model": 10.0, "env/other/healthy_services": 0.0})
        await store.register_engine("engine-0", "http://127.0.0.1:9")
        samples = [agent_sample(0, reward=1.0), agent_sample(1, reward=0.0), agent_sample(2, env="other", reward=1.0),
                   agent_sample(3, reward=0.0), agent_sample(4, status="failed", outcome="infrastructure",
                                                             reason="deadline_exceeded", reward=0.0),
                   agent_sample(5, reward=1.0)]
        refs = [await store.add_sample(s) for s in samples]
        await store.add_trained([trained_record(refs[i], samples[i], step=1 + i // 2) for i in range(4)])
        return refs
    finally:
        await store.close()


def trainer_record(step: int) -> dict[str, float]:
    return {"step": float(step), "reward_mean": 0.1 * step, "response_len_mean": 20.0 + step, "staleness_mean": 0.5,
            "staleness_max": 1.0, "masked_fraction": 0.01, "tokens_per_s": 900.0, "weight_version": float(step)}


@pytest.fixture
def run(redis_server, run_name):
    refs = run_sync(_write_run(redis_server.url, run_name))
    return redis_server.url, run_name, refs


@pytest.fixture
def client(run):
    url, name, _ = run
    with TestClient(build_app(Target(url, name, None))) as c:
        yield c


def test_overview_and_curves_follow_the_metrics_stream(client, run):
    url, name, _ = run
    o = client.get("/api/overview").json()
    assert (o["state"], o["run"], o["step"], o["total_steps"], o["mode"]) == ("live", name, 3, 10, "async")
    assert o["rollout"]["episodes_per_s"] == 2.5 and o["elapsed_s"] >= 59 and o["envs"] == ["calc", "other"]
    curves = client.get("/api/curves?after=0").json()
    assert [r["step"] for r in curves["trainer"]] == [1, 2, 3] and curves["next"] == 3
    assert curves["trainer"][2]["reward_mean"] == pytest.approx(0.3)

    async def one_more():
        store = Store.connect(url, name)
        await store.add_metrics("trainer", trainer_record(4))
        await store.close()
    run_sync(one_more())
    time.sleep(1.1)  # the source re-reads the stream at most once a second
    curves = client.get("/api/curves?after=3").json()
    assert [r["step"] for r in curves["trainer"]] == [4] and curves["next"] == 4
    assert client.get("/api/curves?after=99").json()["reset"] is True


def test_services_report_what_does_not_answer(client):
    s = client.get("/api/services").json()
    assert [(e["id"], e["healthy"]) for e in s["engines"]] == [("engine-0", False)]
    assert s["orchestrator"]["reachable"] is False and s["gateway"]["healthy"] is False
    assert [(e["env"], e["healthy_services"]) for e in s["envs"]] == [("calc", 1.0), ("other", 0.0)]
    assert s["envs"][0]["outcomes"] == {"model": 10.0}


def test_the_trajectory_list_filters_and_pages(client, run):
    _, _, refs = run
    listed = client.get("/api/samples").json()
    assert [s["ref"] for s in listed["samples"]] == refs[::-1] and listed["next"] is None
    assert {s["ref"] for s in client.get("/api/samples?env=other").json()["samples"]} == {refs[2]}
    assert {s["ref"] for s in client.get("/api/samples?min_reward=0.5").json()["samples"]} == {refs[0], refs[2], refs[5]}
    assert {s["ref"] for s in client.get("/api/samples?max_reward=0.5&env=calc").json()["samples"]} == {
        refs[1], refs[3], refs[4]}
    assert [s["ref"] for s in client.get("/api/samples?outcome=failed").json()["samples"]] == [refs[4]]
    assert [s["ref"] for s in client.get("/api/samples?outcome=deadline_exceeded").json()["samples"]] == [refs[4]]
    assert {s["ref"] for s in client.get("/api/samples?step=2").json()["samples"]} == {refs[2], refs[3]}
    first = client.get("/api/samples?count=2").json()
    assert [s["ref"] for s in first["samples"]] == [refs[5], refs[4]] and first["next"] == refs[4]
    second = client.get(f"/api/samples?count=2&before={first['next']}").json()
    assert [s["ref"] for s in second["samples"]] == [refs[3], refs[2]]
    row = first["samples"][1]
    assert (row["status"], row["outcome"], row["reason"], row["trained_step"]) == (
        "failed", "infrastructure", "deadline_exceeded", None)


def test_an_opened_sample_has_its_turns_tool_call_tokens_and_trained_record(client, run):
    _, _, refs = run
    d = client.get(f"/api/samples/{refs[1]}").json()
    sample = agent_sample(1)
    assert [t["kind"] for t in d["turns"]] == ["context", "model", "context", "model"]
    assert d["turns"][1]["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 1}}]
    assert d["turns"][3]["content"] == "The answer is 3." and "what is 2 + 1?" in d["turns"][0]["text"]
    assert "<tool_response>3</tool_response>" in d["turns"][2]["text"]
    t = d["tokens"]
    assert t["ids"] == sample.tokens.tolist() and sum(t["loss_mask"]) == int(sample.loss_mask.sum()) == d["loss_tokens"]
    assert len(t["text"]) == len(t["ids"]) and "".join(t["text"]).startswith("[gMASK]<sop>")
    assert t["rollout_logprobs"] == pytest.approx(sample.rollout_logprobs.tolist(), abs=1e-5)
    assert set(t["weight_versions"]) == {-1, 3}
    record = trained_record(refs[1], sample, step=1)
    assert d["trained"] == {"step": 1, "weight_version": 0, "kept_tokens": int(record.kept.sum()),
                            "band_masked_tokens": int(sample.loss_mask.sum() - record.kept.sum())}
    assert t["kept"] == record.kept.tolist()
    assert t["trainer_logprobs"] == pytest.approx(record.trainer_logprobs.tolist(), abs=1e-5)
    untrained = client.get(f"/api/samples/{refs[5]}").json()
    assert "trained" not in untrained and "kept" not in untrained["tokens"]


@pytest.mark.parametrize("query,named", [("count=0", "count"), ("count=abc", "count"), ("min_reward=high", "min_reward"),
                                         ("step=-1", "step"), ("before=yesterday", "before"), ("scan=0", "scan"),
                                         (f"before={2 ** 64}-0", "before")])
def test_a_bad_query_parameter_is_a_400_naming_it(client, query, named):
    response = client.get(f"/api/samples?{query}")
    assert response.status_code == 400 and named in response.json()["error"], response.text


def test_a_bad_or_unknown_sample_ref(client):
    assert client.get("/api/samples/not-a-ref").status_code == 400
    assert client.get(f"/api/samples/{2 ** 64}-0").status_code == 400
    assert client.get("/api/samples?before=0-0").json() == {"samples": [], "next": None, "scanned": 0}
    missing = client.get("/api/samples/1-0")
    assert missing.status_code == 404 and "1-0" in missing.json()["error"]
    assert client.get("/api/curves?after=-1").status_code == 400


def test_with_a_token_every_route_but_health_wants_it(run):
    url, name, _ = run
    with TestClient(build_app(Target(url, name, None), auth_token="s3cret"), follow_redirects=False) as c:
        for path in ("/api/overview", "/api/curves", "/api/services", "/api/samples", "/static/dashboard.js"):
            assert c.get(path).status_code == 401, path
        assert c.get("/api/overview", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/overview", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        page = c.get("/")
        assert page.status_code == 303 and page.headers["location"] == "/login"
        assert c.get("/health").status_code == 200 and c.get("/login").status_code == 200
        assert c.post("/login", data={"token": "wrong"}).status_code == 401
        assert c.get("/api/overview").status_code == 401  # a failed login sets nothing
        login = c.post("/login", data={"token": "s3cret"})
        assert login.status_code == 303 and "s3cret" not in login.headers["set-cookie"]
        assert "httponly" in login.headers["set-cookie"].lower()
        assert c.get("/api/overview").status_code == 200 and c.get("/").status_code == 200


def test_a_finished_run_is_read_from_a_replay_of_its_redis_data(tmp_path, run_name):
    run_dir = tmp_path / run_name
    redis = EmbeddedRedis(run_dir / "redis", appendfsync="always").start()
    (run_dir / "redis.url").write_text(redis.url)
    refs = run_sync(_write_run(redis.url, run_name, steps=10))
    redis.stop()  # the run ended, its embedded Redis with it
    with TestClient(build_app(Target(redis.url, None, run_dir))) as c:
        o = c.get("/api/overview").json()
        assert (o["state"], o["run"], o["step"], o["finished"]) == ("replayed", run_name, 10, True)
        assert len(c.get("/api/curves").json()["trainer"]) == 10
        assert c.get(f"/api/samples/{refs[0]}").json()["num_turns"] == 2
        assert c.get("/api/services").json()["live"] is False


def test_a_read_as_the_run_ends_is_answered_from_the_replay(tmp_path, run_name, monkeypatch):
    """The run's Redis stops between the source's last refresh and a read (the page open at the run's end):
    the read is answered from the replay of its data, not dropped as an unhandled connection error."""
    from asyncrl_run.dashboard import source

    run_dir = tmp_path / run_name
    redis = EmbeddedRedis(run_dir / "redis", appendfsync="always").start()
    (run_dir / "redis.url").write_text(redis.url)
    refs = run_sync(_write_run(redis.url, run_name, steps=2))
    with TestClient(build_app(Target(redis.url, None, run_dir))) as c:
        assert c.get("/api/overview").json()["state"] == "live"
        assert c.get(f"/api/samples/{refs[0]}").status_code == 200
        monkeypatch.setattr(source, "REFRESH_MIN_S", 3600.0)  # the reads below come before the next refresh
        redis.stop()
        opened = c.get(f"/api/samples/{refs[1]}")
        assert opened.status_code == 200, opened.text
        assert opened.json()["ref"] == refs[1]
        assert [s["ref"] for s in c.get("/api/samples").json()["samples"]] == refs[::-1]
        assert c.get("/api/overview").json()["state"] == "replayed"


def test_a_run_whose_redis_is_gone_with_no_data_to_replay_is_a_503(tmp_path, run_name, monkeypatch):
    from asyncrl_run.dashboard import source

    run_dir = tmp_path / run_name
    redis = EmbeddedRedis(tmp_path / "elsewhere", appendfsync="always").start()  # its data not in the run dir
    run_dir.mkdir()
    (run_dir / "redis.url").write_text(redis.url)
    refs = run_sync(_write_run(redis.url, run_name, steps=2))
    with TestClient(build_app(Target(redis.url, None, run_dir))) as c:
        assert c.get(f"/api/samples/{refs[0]}").status_code == 200
        monkeypatch.setattr(source, "REFRESH_MIN_S", 3600.0)
        redis.stop()
        for path in (f"/api/samples/{refs[1]}", "/api/samples"):
            gone = c.get(path)
            assert gone.status_code == 503 and "cannot reach the run's Redis" in gone.json()["error"], gone.text
        assert c.get("/api/services").status_code == 200


def test_a_replayed_run_whose_redis_comes_back_is_read_live_again(tmp_path, run_name, monkeypatch):
    from asyncrl_run.dashboard import source

    monkeypatch.setattr(source, "LIVE_RECHECK_S", 0.0)
    monkeypatch.setattr(source, "REFRESH_MIN_S", 0.0)
    run_dir = tmp_path / run_name
    redis = EmbeddedRedis(run_dir / "redis", appendfsync="always").start()
    (run_dir / "redis.url").write_text(redis.url)
    run_sync(_write_run(redis.url, run_name, steps=2))
    redis.stop()
    with TestClient(build_app(Target(redis.url, None, run_dir))) as c:
        assert c.get("/api/overview").json()["state"] == "replayed"
        again = EmbeddedRedis(run_dir / "redis", port=redis.port, appendfsync="always").start()  # the run resumed
        try:
            async def step_3():
                store = Store.connect(again.url, run_name)
                await store.add_metrics("trainer", trainer_record(3))
                await store.close()
            run_sync(step_3())
            o = c.get("/api/overview").json()
            assert (o["state"], o["step"]) == ("live", 3)
        finally:
            again.stop()


def test_the_command_serves_and_stops_cleanly_on_sigterm(tmp_path, run):
    url, name, _ = run
    proc = ServiceProcess("asyncrl_run.dashboard.server", ["--redis-url", url, "--run", name, "--auth-token", "t0k"],
                          tmp_path, name="dashboard")
    try:
        assert proc.url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
        assert httpx.get(f"{proc.url}/health").status_code == 200
        assert httpx.get(f"{proc.url}/api/overview").status_code == 401
        overview = httpx.get(f"{proc.url}/api/overview", headers={"Authorization": "Bearer t0k"}).json()
        assert overview["step"] == 3
        assert "asyncrl_dashboard_requests_total" in httpx.get(f"{proc.url}/metrics").text
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_wrong_run_dir_is_exit_2(tmp_path):
    import subprocess
    import sys

    from tests.services import ROOT

    done = subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "dashboard", "--run-dir", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "no run directory" in done.stderr


def test_the_token_is_the_flag_else_the_dashboards_else_the_runs_orchestrator_token(monkeypatch):
    from asyncrl_run.dashboard.access import resolve_token

    monkeypatch.delenv("ASYNCRL_DASHBOARD_TOKEN", raising=False)
    monkeypatch.delenv("ASYNCRL_ORCHESTRATOR_TOKEN", raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv("ASYNCRL_ORCHESTRATOR_TOKEN", "orch")
    assert resolve_token(None) == "orch"
    monkeypatch.setenv("ASYNCRL_DASHBOARD_TOKEN", "dash")
    assert resolve_token(None) == "dash" and resolve_token("flag") == "flag"
