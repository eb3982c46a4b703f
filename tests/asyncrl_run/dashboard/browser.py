"""A real headless Chromium for the dashboard's browser tests (selenium driving Debian's chromium through its
chromedriver; `make browser` installs both). Tests skip, saying so, only when those are missing.
Screenshots go to $ASYNCRL_TEST_ARTIFACTS, else test-artifacts/ in the checkout (gitignored)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.services import ROOT

CHROMIUM = os.environ.get("ASYNCRL_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("ASYNCRL_CHROMEDRIVER", "/usr/bin/chromedriver")


def missing() -> str:
    """Why no browser test can run here ("" when it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() or shutil.which(path)):
            return f"{path} is missing (make browser: apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return ""


def artifacts_dir() -> Path:
    path = Path(os.environ.get("ASYNCRL_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser():
    why = missing()
    if why:
        pytest.skip(f"no headless browser: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,1000", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.25):
    """Poll `predicate` (a browser query) until truthy; its value. Fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as err:  # an element replaced between find and read: ask again
            last_error = err
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error!r})")


def points(driver, chart: str) -> int:
    return int(driver.find_element("id", chart).get_attribute("data-points") or 0)


def log_in(driver, base_url: str, token: str) -> None:
    driver.get(f"{base_url}/")
    wait_for(lambda: driver.find_elements("id", "token"), 30, "the login page")
    driver.find_element("id", "token").send_keys(token)
    driver.find_element("id", "login").click()
    wait_for(lambda: driver.find_elements("id", "chart-reward"), 30, "the dashboard after logging in")


def open_first_sample(driver, base_url: str) -> str:
    """Open the Trajectories tab and the newest sample in it; its stream id once its tokens are shown."""
    driver.find_element("css selector", "nav a[data-tab=samples]").click()
    row = wait_for(lambda: driver.find_elements("css selector", "#samples tbody tr.sample-row"), 60, "a sample row")[0]
    ref = row.get_attribute("data-ref")
    row.click()
    try:
        wait_for(lambda: driver.find_element("id", "sample").get_attribute("data-ref") == ref
                 and driver.find_elements("css selector", "#tokens .tok"), 60, f"sample {ref} opened")
    except AssertionError as err:  # what the page shows instead says why
        box = driver.find_element("id", "sample")
        raise AssertionError(f"{err}; page at {driver.current_url}, #sample (data-ref "
                             f"{box.get_attribute('data-ref')!r}) shows {box.text[:500]!r}") from None
    return ref


def shown_as_trained(driver) -> int:
    """Tokens the token view colours as trained (loss mask 1)."""
    return len(driver.find_elements("css selector", "#tokens .tok.loss"))
