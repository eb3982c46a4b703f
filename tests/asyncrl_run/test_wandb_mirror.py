"""W&B logging (asyncrl_run/wandb_mirror.py, asyncrl/service_metrics.py): the panel keys of the stream's
records, the services' /metrics scraped from real HTTP servers, and real offline W&B runs read back
with W&B's own reader: every WandbConfig field reaches the run, a resumed run dir continues the same
W&B run past the rows it holds. Never online: WANDB_MODE=offline and mode offline."""

from __future__ import annotations

import json
import threading
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asyncrl.config import WandbConfig
from asyncrl.service_metrics import ServiceScraper
from asyncrl.store import Store
from asyncrl_run.run_metrics import newer, orchestrator_key, trainer_key
from asyncrl_run.wandb_mirror import STATE_FILE, WandbMirror, resolve_mode
from tests.asyncrl.test_config import load
from tests.wandb_files import read_offline_runs


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test here may reach a W&B server, nor read this machine's credentials or settings."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


# Panel keys ---------------------------------------------------------------------------------------
def test_trainer_keys_go_to_their_panels():
    assert trainer_key("reward_mean") == "rollout/reward_mean"  # TRAINER_SCALARS, as TensorBoard
    assert trainer_key("loss") == "train/loss"
    assert trainer_key("wait_s") == "train/wait_s"  # not in the table: train/<key>
    assert trainer_key("off_policy/ratio_mean") == "off_policy/ratio_mean"  # a "/" passes through
    assert trainer_key("env/arithmetic/reward_mean") == "env/arithmetic/reward_mean"
    assert trainer_key("step") is None  # the x-axis


def test_orchestrator_keys_go_to_their_panels():
    assert orchestrator_key("episodes_per_s") == "throughput/episodes_per_s"  # ORCHESTRATOR_SCALARS
    assert orchestrator_key("completed") == "rollout/episodes_completed"
    assert orchestrator_key("settling") == "rollout/settling"
    assert orchestrator_key("outcome_model") == "rollout/outcome_model"
    assert orchestrator_key("env/arithmetic/in_flight") == "env/arithmetic/in_flight"
    assert orchestrator_key("pause/staleness") == "system/orchestrator/pause/staleness"
    assert orchestrator_key("paused") == "system/orchestrator/paused"
    assert orchestrator_key("dispatch_overhead_p99_ms") == "system/orchestrator/dispatch_overhead_p99_ms"


def test_newer_compares_stream_ids_as_numbers():
    records = [("9-0", "trainer", {}), ("10-0", "trainer", {}), ("10-2", "trainer", {})]
    assert [r[0] for r in newer(records, "9-5")] == ["10-0", "10-2"]
    assert [r[0] for r in newer(records, "0-0")] == ["9-0", "10-0", "10-2"]


# Scrape -------------------------------------------------------------------------------------------
class MetricsServers:
    """Real HTTP: /<name>/metrics serves that registry (`/gateway` wants a bearer token), and the
    orchestrator's /v1/envs lists the env service replicas."""

    def __init__(self, registries: dict[str, CollectorRegistry], envs: list[dict], token: str) -> None:
        servers = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                name, _, rest = self.path.strip("/").partition("/")
                if name == "gateway" and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._reply(401, b"{}")
                if rest == "v1/envs":
                    return self._reply(200, json.dumps([{**e, "url": servers.url + e["url"]} for e in envs]).encode())
                if rest == "metrics" and name in registries:
                    return self._reply(200, generate_latest(registries[name]))
                self._reply(404, b"{}")

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def env_registry(in_flight: float, rewards: list[float]) -> CollectorRegistry:
    r = CollectorRegistry()
    episodes = Counter("asyncrl_env_episodes", "", ["env", "status"], registry=r)
    episodes.labels("arithmetic", "completed").inc(len(rewards))
    Gauge("asyncrl_env_in_flight", "", ["env"], registry=r).labels("arithmetic").set(in_flight)
    reward = Histogram("asyncrl_env_reward", "", ["env"], buckets=(0.5, 1.0), registry=r).labels("arithmetic")
    for value in rewards:
        reward.observe(value)
    return r


async def test_the_scrape_reads_every_service_and_survives_one_that_fails(redis_server, run_name, caplog):
    gateway = CollectorRegistry()
    Counter("asyncrl_gateway_turns", "", ["api", "finish_reason"], registry=gateway).labels("chat", "stop").inc(7)
    Histogram("asyncrl_gateway_turn_latency_seconds", "", ["api"], registry=gateway).labels("chat").observe(0.25)
    orchestrator = CollectorRegistry()
    Counter("asyncrl_orchestrator_outcomes", "", ["env", "outcome", "reason"],
            registry=orchestrator).labels("arithmetic", "model", "correct").inc(3)
    Gauge("asyncrl_orchestrator_queued", "", registry=orchestrator).set(5)
    engine = CollectorRegistry()
    Gauge("sglang_num_running_reqs", "", registry=engine).set(4)
    trainer = CollectorRegistry()
    Counter("asyncrl_trainer_steps", "", registry=trainer).inc(2)
    registries = {"gateway": gateway, "orchestrator": orchestrator, "engine": engine, "trainer": trainer,
                  "env0": env_registry(2, [0.0, 1.0]), "env1": env_registry(3, [1.0])}
    envs = [{"name": "arithmetic", "url": url, "healthy": url != "/gone"}  # /gone: not scraped, no failure logged
            for url in ("/env0", "/env1", "/gone")]
    servers = MetricsServers(registries, envs, token="gw-secret")
    store = Store.connect(redis_server.url, run_name)
    try:
        await store.redis.hset(store.key("services"), mapping={
            "gateway": f"{servers.url}/gateway", "trainer_metrics": f"{servers.url}/trainer"})
        await store.register_engine("engine-0", f"{servers.url}/engine")
        await store.register_engine("engine-1", "http://127.0.0.1:9")  # nothing serves there
        scraper = ServiceScraper(f"{servers.url}/orchestrator", {}, {"Authorization": "Bearer gw-secret"})
        async with httpx.AsyncClient(timeout=10) as http:
            values = await scraper.scrape(http, store)
            again = await scraper.scrape(http, store)
    finally:
        await store.close()
        servers.close()
    assert values["system/gateway/turns_total/api=chat/finish_reason=stop"] == 7
    assert values["system/gateway/turn_latency_seconds_count/api=chat"] == 1
    assert values["system/gateway/turn_latency_seconds_mean/api=chat"] == pytest.approx(0.25)
    assert values["env/arithmetic/orchestrator/outcomes_total/outcome=model/reason=correct"] == 3
    assert values["system/orchestrator/queued"] == 5
    assert values["system/engine/engine-0/num_running_reqs"] == 4
    assert values["system/trainer/steps_total"] == 2
    # two replicas of one env service: summed, the histogram by its sums and counts
    assert values["env/arithmetic/service/episodes_total/status=completed"] == 3
    assert values["env/arithmetic/service/in_flight"] == 5
    assert values["env/arithmetic/service/reward_count"] == 3
    assert values["env/arithmetic/service/reward_mean"] == pytest.approx(2 / 3)
    assert not [k for k in values if "engine-1" in k or "_created" in k or "_bucket" in k]
    assert again == values
    failures = [r.message for r in caplog.records if "not scraped" in r.message]
    assert len(failures) == 1 and "engine engine-1" in failures[0]  # once, not at every scrape


async def test_the_gateway_scrape_needs_its_token(redis_server, run_name, caplog):
    gateway = CollectorRegistry()
    Gauge("asyncrl_gateway_sessions_active", "", registry=gateway).set(1)
    servers = MetricsServers({"gateway": gateway}, [], token="gw-secret")
    store = Store.connect(redis_server.url, run_name)
    try:
        await store.redis.hset(store.key("services"), "gateway", f"{servers.url}/gateway")
        async with httpx.AsyncClient(timeout=10) as http:
            values = await ServiceScraper(f"{servers.url}/orchestrator", {}, {}).scrape(http, store)
    finally:
        await store.close()
        servers.close()
    assert values == {}
    assert any("gateway metrics not scraped (HTTP 401)" in r.message for r in caplog.records)


# Offline W&B runs ---------------------------------------------------------------------------------
def trainer(step: int) -> dict[str, float]:
    return {"step": step, "loss": 0.1 * step, "reward_mean": 0.5, "wait_s": 1.0, "off_policy/ratio_mean": 1.0}


ORCHESTRATOR = {"completed": 8.0, "env/arithmetic/completed": 8.0, "pause/staleness": 1.0}


def varied_config(tmp_path: Path) -> WandbConfig:
    """Every field other than its default (the check below fails on a field added later, unset here)."""
    cfg = WandbConfig(enabled=True, project="p-varied", entity="e-varied", mode="offline", group="g-varied",
                      tags=["t1", "t2"], name="n-varied", dir=str(tmp_path / "elsewhere"))
    default = WandbConfig()
    assert all(getattr(cfg, f.name) != getattr(default, f.name) for f in fields(WandbConfig))
    return cfg


def test_every_setting_reaches_the_offline_run_and_a_resume_continues_it(tmp_path):
    cfg, run_dir = varied_config(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    mirror = WandbMirror(cfg, "myrun", run_dir, {"total_steps": 4, "trainer": {"lr": 0.5}})
    mirror.write([("1-0", "orchestrator", ORCHESTRATOR), ("2-0", "trainer", trainer(1)),
                  ("3-0", "orchestrator", ORCHESTRATOR), ("4-0", "trainer", trainer(2))])
    mirror.write_scraped({"system/gateway/turns_total": 3.0})
    mirror.close()

    (first,) = read_offline_runs(tmp_path / "elsewhere" / "wandb")  # wandb.dir
    run = first.run
    assert (run["project"], run["entity"], run["run_group"], run["tags"], run["display_name"]) == (
        "p-varied", "e-varied", "g-varied", ["t1", "t2"], "n-varied")
    assert run["run_id"] == mirror.run_id and first.exit_code == 0 and run["telemetry"]["feature"]["offline"]
    assert first.config() == {"total_steps": 4, "trainer": {"lr": 0.5}}
    assert first.steps == [1, 2]  # the orchestrator's first record merged into step 1's row
    assert {"train/loss", "rollout/reward_mean", "train/wait_s", "off_policy/ratio_mean", "rollout/episodes_completed",
            "env/arithmetic/completed", "system/orchestrator/pause/staleness",
            "system/gateway/turns_total"} == first.keys
    assert first.history[1]["system/gateway/turns_total"] == 3  # at the latest trainer step

    # The re-run of the run dir: the trainer resumed from its step-1 checkpoint and trains step 2 again.
    resumed = WandbMirror(cfg, "myrun", run_dir, {"total_steps": 4})
    assert (resumed.run_id, resumed.after) == (mirror.run_id, "4-0")
    resumed.write([("5-0", "orchestrator", ORCHESTRATOR), ("6-0", "trainer", trainer(2)),
                   ("7-0", "trainer", trainer(3)), ("8-0", "trainer", trainer(4))])
    resumed.close()
    first_again, second = read_offline_runs(tmp_path / "elsewhere" / "wandb")
    assert second.run["run_id"] == mirror.run_id and second.run.get("resume") is True
    assert second.steps == [3, 4]  # past the rows the W&B run holds; step 2 is not logged twice
    assert second.history[0]["rollout/episodes_completed"] == 8  # the orchestrator record, at the next row
    assert resumed.skipped == 1
    assert (run_dir / STATE_FILE).exists() and not (run_dir / "wandb").exists()


def test_a_new_run_dir_is_a_new_wandb_run_under_the_run_dir(tmp_path):
    cfg = WandbConfig(enabled=True, mode="offline")
    one = WandbMirror(cfg, "one", tmp_path / "one", {})
    one.close()
    two = WandbMirror(cfg, "two", tmp_path / "two", {})
    two.close()
    assert one.run_id != two.run_id
    (run,) = read_offline_runs(tmp_path / "one" / "wandb")  # dir None: <run_dir>/wandb
    assert (run.run["display_name"], run.run["project"], run.history) == ("one", "asyncrl", [])


def test_online_mode_reaches_wandb_and_fails_at_once_without_credentials(tmp_path, monkeypatch):
    """wandb.init's mode wins over $WANDB_MODE (offline here): without a key it refuses before any request."""
    import wandb

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were a request made: nothing listens there
    with pytest.raises(wandb.errors.UsageError, match="No API key configured"):
        WandbMirror(WandbConfig(enabled=True, mode="online"), "run", tmp_path / "run", {})


def test_auto_mode_is_online_only_with_credentials(tmp_path, monkeypatch):
    assert resolve_mode("offline") == "offline" and resolve_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"  # the user's W&B environment wins
    monkeypatch.delenv("WANDB_MODE")
    assert resolve_mode("auto") == "offline"  # no key, no netrc
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login user password x\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert resolve_mode("auto") == "offline"  # an entry for another host
    netrc.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")  # `wandb login`
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.internal.example")
    assert resolve_mode("auto") == "offline"  # a key for wandb.ai, not for this server
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode("auto") == "online"


def test_the_config_switch_and_a_wrong_value_naming_the_field():
    assert load().wandb == WandbConfig()  # off by default
    cfg = load("wandb.enabled=true", "wandb.mode=offline", "wandb.tags=[a,b]", "wandb.project=x")
    assert (cfg.wandb.enabled, cfg.wandb.mode, cfg.wandb.tags, cfg.wandb.project) == (True, "offline", ["a", "b"], "x")
    with pytest.raises(Exception) as info:
        load("wandb.mode=cloud")
    assert "wandb.mode must be one of auto, offline, online, got 'cloud'" in str(info.value) + str(info.value.__cause__)
    with pytest.raises(Exception) as info:
        load("wandb.projekt=x")
    assert "projekt" in str(info.value) + str(info.value.__cause__)
