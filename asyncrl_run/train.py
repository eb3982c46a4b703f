"""`python -m asyncrl_run.train experiment=...`: compose the run config (Hydra) and run it.

Hydra flags work as usual: `--cfg job` prints the resolved config, `--help` lists the groups.
The config is validated against asyncrl.config.RunConfig before anything starts.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from asyncrl.config import RunConfig, register_configs, to_dataclass

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run_cfg: RunConfig = to_dataclass(cfg)
    except ValueError as err:  # e.g. ModelConfig consistency checks, which name the field
        sys.exit(f"asyncrl: invalid config: {err}")
    from hydra.core.hydra_config import HydraConfig

    from asyncrl_run.launcher import run  # heavy imports only once the config is valid

    code = run(run_cfg, experiment=HydraConfig.get().runtime.choices.get("experiment"))
    # Everything the run started is stopped and its files are flushed by now. Skip the interpreter's
    # finalization: after a Ctrl-C that interrupted a Ray call, Ray's C++ core worker holds the exit for
    # ~10 s in its destructors (no Python frame left).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
