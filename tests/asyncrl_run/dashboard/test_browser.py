"""The dashboard in a real headless Chromium.

Against hand-written records (seconds): the login form, the curves drawn, the services table, and a sample
with the trainer's record opened: as many tokens shown as trained as the sample's loss mask holds, as many
shown masked by the IS band as its record says.

Against a live short tiny_demo run (`python -m asyncrl_run.train`, the run's orchestrator token set; a few
minutes): the dashboard, started with the run's token in its environment as the launcher's services have
it, refuses a request without it, loads after logging in, its curves get new points as steps land
(data-points of the reward chart grows between two steps), the engine and the env service show healthy,
a recorded sample opens with its loss-mask sum shown as trained; after the run the same page reads the
run's Redis data (replayed); a sample the trainer trained shows its record's kept and band-masked tokens.
Screenshots: test-artifacts/ (or $ASYNCRL_TEST_ARTIFACTS); docs/dashboard.png and docs/dashboard_trajectory.png
are the live run's (see STEPS)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.store import Store
from asyncrl_run.redis_server import EmbeddedRedis
from tests.asyncrl_run.dashboard.browser import (artifacts_dir, log_in, missing, open_first_sample, points,
                                     shown_as_trained, wait_for)
from tests.asyncrl_run.dashboard.samples import agent_sample, trained_record
from tests.asyncrl_run.dashboard.test_api import _write_run
from tests.services import ROOT, ServiceProcess

TOKEN = "dashboard-test-token"


def test_the_page_against_hand_written_records(browser, tmp_path, run_name):
    """The trainer's record of a sample here is hand-written (tests/asyncrl_run/dashboard/samples.py trained_record)."""
    redis = EmbeddedRedis(tmp_path / "redis").start()
    dashboard = None
    try:
        refs = asyncio.run(_write_run(redis.url, run_name, steps=12))
        dashboard = ServiceProcess("asyncrl_run.dashboard.server", ["--redis-url", redis.url, "--run", run_name,
                                                                "--auth-token", TOKEN], tmp_path, name="dashboard")
        log_in(browser, dashboard.url, TOKEN)
        wait_for(lambda: points(browser, "chart-reward") == 12, 30, "12 points on the reward chart")
        assert points(browser, "chart-staleness") == 12
        env_choices = [o.get_attribute("value") for o in browser.find_elements("css selector", "#filters select option")]
        assert env_choices == ["", "calc", "other"]  # the run's envs, from its orchestrator record
        browser.get(f"{dashboard.url}/#services")
        wait_for(lambda: browser.find_elements("css selector", "#engines tbody tr"), 30, "the engine row")
        assert "engine-0" in browser.find_element("id", "engines").text
        browser.get(f"{dashboard.url}/#sample={refs[1]}")  # trained at step 1, every 5th loss token masked
        wait_for(lambda: browser.find_elements("css selector", "#tokens .tok"), 30, "the sample's tokens")
        sample = agent_sample(1)
        record = trained_record(refs[1], sample, step=1)
        assert shown_as_trained(browser) == int(sample.loss_mask.sum())
        assert int(browser.find_element("id", "trained-count").text) == int(sample.loss_mask.sum())
        masked = len(browser.find_elements("css selector", "#tokens .tok.band-masked"))
        assert masked == int(sample.loss_mask.sum() - record.kept.sum()) > 0
        assert "tool call add" in browser.find_element("id", "sample").text
        browser.save_screenshot(str(artifacts_dir() / "dashboard_handwritten_sample.png"))
    finally:
        if dashboard is not None:
            assert dashboard.stop() == 0, dashboard.log()
        redis.stop()


# The live run ----------------------------------------------------------------------------------------
STEPS = int(os.environ.get("ASYNCRL_DASHBOARD_TEST_STEPS", "12"))
WARMUP = int(os.environ.get("ASYNCRL_DASHBOARD_TEST_WARMUP", "5"))
"""A short run by default; docs/dashboard*.png were taken with ASYNCRL_DASHBOARD_TEST_STEPS=30 and
ASYNCRL_DASHBOARD_TEST_WARMUP=100 (tiny_demo's own warm-up), where the reward visibly rises."""


class LiveRun:
    def __init__(self, tmp_path: Path) -> None:
        self.run_dir, self.log = tmp_path / "dash_live", tmp_path / "dash_live.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl_run.train", "experiment=tiny_demo", f"name={self.run_dir.name}",
             f"run_dir={self.run_dir}", f"total_steps={STEPS}", f"warmup.steps={WARMUP}", "trainer.groups_per_step=4",
             f"orchestrator.auth_token={TOKEN}"], cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        self.dashboard: ServiceProcess | None = None
        wait_for(lambda: (self.run_dir / "redis.url").is_file() or self.proc.poll() is not None, 300,
                 "the run's redis.url")
        assert self.proc.poll() is None, self.log.read_text()[-4000:]
        self.redis_url = (self.run_dir / "redis.url").read_text()
        # The run's token in its environment, as the launcher's services have it.
        self.dashboard = ServiceProcess("asyncrl_run.dashboard.server", ["--run-dir", str(self.run_dir)], tmp_path,
                                        name="dashboard", env={"ASYNCRL_ORCHESTRATOR_TOKEN": TOKEN})

    def api(self, path: str) -> dict:
        response = httpx.get(f"{self.dashboard.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def finished(self) -> None:
        assert self.proc.wait(600) == 0, self.log.read_text()[-4000:]

    def stop(self) -> None:
        if self.dashboard is not None:
            assert self.dashboard.stop() == 0, self.dashboard.log()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if missing():  # a module fixture starts before `browser` skips: no run for tests that cannot look at it
        pytest.skip(f"no headless browser: {missing()}")
    run = LiveRun(tmp_path_factory.mktemp("live"))
    try:
        yield run
    finally:
        run.stop()


async def _sample(url: str, run: str, ref: str):
    store = Store.connect(url, run)
    try:
        [sample] = await store.get_samples([ref])
        return sample
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dashboard_of_a_live_run(browser, live):
    url = live.dashboard.url
    assert httpx.get(f"{url}/api/overview").status_code == 401
    log_in(browser, url, TOKEN)
    # The services first: they serve from before the first step to after the last, however fast the steps go.
    browser.get(f"{url}/#services")
    wait_for(lambda: "healthy" in browser.find_element("id", "engines").text, 600, "a healthy engine")
    wait_for(lambda: "healthy" in browser.find_element("id", "env-services").text, 60,
             "a healthy env service (the orchestrator's /v1/envs, with the run's token)")
    browser.save_screenshot(str(artifacts_dir() / "dashboard_services.png"))
    browser.get(f"{url}/#run")
    first = wait_for(lambda: points(browser, "chart-reward"), 600, "the first step's point")
    assert first < STEPS, "the run trained every step before the page saw one: nothing to see grow"
    wait_for(lambda: points(browser, "chart-reward") > first, 300, f"a point after the first {first}")
    ref = open_first_sample(browser, url)
    sample = asyncio.run(_sample(live.redis_url, live.run_dir.name, ref))
    assert shown_as_trained(browser) == int(sample.loss_mask.sum()) > 0
    assert int(browser.find_element("id", "trained-count").text) == int(sample.loss_mask.sum())
    browser.save_screenshot(str(artifacts_dir() / "dashboard_live_sample.png"))
    browser.get(f"{url}/#run")
    wait_for(lambda: points(browser, "chart-reward") >= STEPS - 1 or live.proc.poll() is not None, 900,
             "the last steps")
    time.sleep(2.5)  # one more poll: the other charts catch up
    browser.save_screenshot(str(artifacts_dir() / "dashboard.png"))
    live.finished()
    # The run's Redis is gone: the page goes on from a replay of its data.
    wait_for(lambda: browser.find_element("id", "run-state").text == "finished", 60, "the finished badge")
    wait_for(lambda: points(browser, "chart-reward") == STEPS, 60, "every step on the chart")
    assert live.api("/api/overview")["state"] == "replayed"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_live_runs_trained_sample_shows_the_trust_band(browser, live):
    """A sample the run's trainer trained: its record's kept tokens and the band-masked ones are what the page
    colours so (the trainer's log-probs beside the rollout's): the trainer writes a `trained` record per
    sample it trains (Store.add_trained, trainer/actor.py)."""
    live.finished()
    found = next((s for step in range(STEPS, 0, -1) for s in live.api(f"/api/samples?step={step}&count=1")["samples"]),
                 None)
    assert found is not None, "the run's trainer wrote no `trained` record"
    log_in(browser, live.dashboard.url, TOKEN)
    browser.get(f"{live.dashboard.url}/#sample={found['ref']}")
    wait_for(lambda: browser.find_elements("css selector", "#tokens .tok"), 60, "the trained sample's tokens")
    detail = live.api(f"/api/samples/{found['ref']}")
    assert shown_as_trained(browser) == sum(detail["tokens"]["loss_mask"]) > 0
    assert len(browser.find_elements("css selector", "#tokens .tok.kept")) == detail["trained"]["kept_tokens"]
    masked = len(browser.find_elements("css selector", "#tokens .tok.band-masked"))
    assert masked == detail["trained"]["band_masked_tokens"]
    assert len(detail["tokens"]["trainer_logprobs"]) == len(detail["tokens"]["ids"])
    browser.save_screenshot(str(artifacts_dir() / "dashboard_trajectory.png"))
