"""The dashboard tests' fixtures: a headless Chromium (tests/asyncrl_run/dashboard/browser.py)."""

from tests.asyncrl_run.dashboard.browser import browser  # noqa: F401
