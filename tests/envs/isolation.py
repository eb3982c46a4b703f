"""Whether the isolating sandbox works on this machine, decided once by the probe a service runs."""

from __future__ import annotations

import asyncio

import pytest

from envs.sdk.sandbox import SandboxConfig, SandboxUnavailable, make_sandbox_backend


def namespace_sandbox_available() -> bool:
    """The isolating sandbox works here: the same probe a service runs at start."""
    backend = make_sandbox_backend(SandboxConfig(type="namespace"))
    try:
        asyncio.run(backend.probe())
        return True
    except SandboxUnavailable:
        return False
    finally:
        asyncio.run(backend.close())


NAMESPACES = namespace_sandbox_available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="needs root and Linux namespaces (unshare)")
SANDBOX_ARGS = () if NAMESPACES else ("--unsafe-local-sandbox",)
"""Where namespaces are missing, env end-to-end tests still run, on the unsafe sandbox (chosen explicitly)."""
