"""The dashboard tests' fixtures: a headless Chromium (tests/driver/dashboard/browser.py)."""

from tests.driver.dashboard.browser import browser  # noqa: F401
