"""`python -m trainer.run [hydra overrides]`: the trainer alone, against a run's Redis.

    python -m trainer.run redis.url=redis://127.0.0.1:6379 name=myrun total_steps=100 trainer.lr=1e-5
    torchrun --nproc_per_node 4 -m trainer.run redis.url=... name=myrun      # data parallel

The run config is composed exactly as `python -m asyncrl_run.train` composes it (configs/, validated);
the trainer reads its own sections (trainer, model) plus redis.url, name, run_dir, seed, total_steps.
Rank 0 runs the RL loop; other ranks follow it (TrainerBackend.follow). SIGTERM: the step in
progress finishes, a checkpoint is written, its groups are acknowledged, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING, Optional

from asyncrl.config import CONFIG_DIR, RunConfig, register_configs, to_dataclass

if TYPE_CHECKING:
    from trainer.backends.base import TrainerBackend


def load_config(overrides: list[str]) -> RunConfig:
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return to_dataclass(compose("config", overrides=overrides))


def build_trainer(cfg: RunConfig, backend: Optional["TrainerBackend"] = None):
    from trainer.actor import Trainer

    return Trainer(cfg.trainer, cfg.model, cfg.redis.url, cfg.name, cfg.run_dir, cfg.seed, backend=backend,
                   retention_groups=cfg.redis.retention_groups)


async def serve(trainer, total_steps: int) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.request_stop)
    try:
        await trainer.run(total_steps)
    finally:
        await trainer.close()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(argv)
    if cfg.redis.url is None:
        raise SystemExit("trainer.run: set redis.url (the trainer joins a running run's Redis)")
    from trainer.backends.base import make_backend  # torch and the model: only once the config is valid

    backend = make_backend(cfg.trainer, cfg.model, cfg.seed)
    if not backend.is_leader:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun signals every rank; the leader decides when to stop
        backend.follow()
        backend.close()
        return 0
    asyncio.run(serve(build_trainer(cfg, backend), cfg.total_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
