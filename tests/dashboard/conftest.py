"""The dashboard tests' fixtures: a headless Chromium (tests/dashboard/browser.py)."""

from tests.dashboard.browser import browser  # noqa: F401
