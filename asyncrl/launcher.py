"""Runs a composed RunConfig: embedded Redis when no URL is given, then the components.

Components are wired by dotted path (never imported statically by asyncrl). Until every component
has landed, `run` starts what exists and names what is missing, exiting non-zero.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from asyncrl.config import RunConfig
from asyncrl.redis_server import EmbeddedRedis

log = logging.getLogger("asyncrl.launcher")

# component -> module that must exist for a full run
COMPONENTS = {
    "rollout engine": "rollout.actor",
    "gateway": "gateway.server",
    "orchestrator": "orchestrator.server",
    "env services": "envs.sdk.app",
    "trainer": "trainer.actor",
}


def missing_components() -> list[str]:
    missing = []
    for name, module in COMPONENTS.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            missing.append(f"{name} ({module})")
    return missing


def run(cfg: RunConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    redis = None
    if cfg.redis.url is None:
        redis = EmbeddedRedis(cfg.redis.data_dir or run_dir / "redis", aof=cfg.redis.aof).start()
        log.info("embedded redis-server at %s (AOF %s, data in %s)", redis.url, cfg.redis.aof, redis.data_dir)
    try:
        missing = missing_components()
        if missing:
            log.error("cannot run %s end to end yet; missing components: %s", cfg.name, ", ".join(missing))
            return 3
        return 0
    finally:
        if redis is not None:
            redis.stop()
