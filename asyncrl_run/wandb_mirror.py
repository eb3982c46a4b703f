"""The run's metrics mirrored to Weights & Biases (`wandb.enabled`, docs/run.md "Weights & Biases").

One W&B run per run dir: its id is kept in <run_dir>/wandb.json with how far the stream was logged,
so a re-run that resumes the run dir continues the same W&B run where the last one stopped
(resume="allow"), and resume=false (which moves the file aside with the rest) starts a new one.
Offline unless credentials exist (mode `auto`): the files under <dir>/wandb are uploaded later with
`wandb sync`, so an air-gapped cluster logs the same way.

The x-axis is the trainer step: each `trainer` record is logged at its step, everything else (the
`orchestrator` records, the services' scraped /metrics) at the latest trainer step seen, so the
history has one row per trainer step. W&B wants a non-decreasing step: steps trained again after a
trainer restart are not logged again (W&B keeps the first; TensorBoard shows both).
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncrl.config import WandbConfig
from asyncrl_run.run_metrics import orchestrator_key, trainer_key

log = logging.getLogger("asyncrl_run.wandb_mirror")

STATE_FILE = "wandb.json"
"""In the run dir: {"run_id", "after" (the last stream id logged), "step" (the last step logged to)}."""
DEFAULT_HOST = "https://api.wandb.ai"


def resolve_mode(mode: str) -> str:
    """`auto` -> $WANDB_MODE when set, else `online` with credentials, else `offline`; others as they are."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


def has_credentials() -> bool:
    """$WANDB_API_KEY (or $WANDB_IDENTITY_TOKEN_FILE), or a netrc entry for the W&B host ($WANDB_BASE_URL),
    which is where `wandb login` stores the key."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbMirror:
    """Logs the run's `metrics` stream (`write`, as TensorBoardMirror) and the services' scraped /metrics
    (`write_scraped`) to one W&B run, with the resolved run config (secrets left out)."""

    def __init__(self, cfg: WandbConfig, run_name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.state_path = Path(run_dir) / STATE_FILE
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.run_id: str = state.get("run_id") or secrets.token_hex(4)
        self.after: str = state.get("after", "0-0")
        self.logged: int = state.get("step", 0)
        """The last step logged to (0: none)."""
        self.step = self.logged + 1
        """The step new values go to (the latest trainer step); a resumed W&B run starts past the rows it holds."""
        self.skipped = 0
        directory = Path(cfg.dir) if cfg.dir else Path(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.mode = resolve_mode(cfg.mode)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags),
                              name=cfg.name or run_name, id=self.run_id, resume="allow", dir=str(directory),
                              mode=self.mode, config=config,
                              # the launcher's output is in launcher.log; W&B's capture would wrap its stdout
                              settings=wandb.Settings(console="off"))
        self._save()
        log.info("W&B run %s (project %s, %s) in %s%s%s", self.run_id, cfg.project, self.mode, directory / "wandb",
                 f", resumed after step {self.logged}" if self.logged else "",
                 f"; upload it with `wandb sync {directory / 'wandb'}`" if self.mode == "offline" else "")

    def write(self, records: list[tuple[str, str, dict[str, float]]]) -> None:
        for stream_id, source, values in records:
            self.after = stream_id
            if source == "trainer":
                step = int(values.get("step", 0))
                if step < self.step:  # trained again after a restart: W&B's history cannot go back
                    self.skipped += 1
                    continue
                self.step = step
                self._log({tag: v for k, v in values.items() if (tag := trainer_key(k)) is not None})
            elif source == "orchestrator":
                self._log({orchestrator_key(k): v for k, v in values.items()})
        self._save()

    def write_scraped(self, values: dict[str, float]) -> None:
        """The services' /metrics (asyncrl/service_metrics.py), at the latest trainer step."""
        self._log(values)

    def close(self) -> None:
        import wandb

        self._save()
        if self.skipped:
            log.info("W&B: %d trainer records of steps trained again after a restart not logged (the first "
                     "ones are)", self.skipped)
        self.run.finish()
        wandb.teardown()  # stops W&B's service process (the launcher ends with os._exit: no atexit)

    def _log(self, values: dict[str, float]) -> None:
        if values:
            self.run.log(values, step=self.step)
            self.logged = self.step

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "after": self.after, "step": self.logged}) + "\n")
        tmp.replace(self.state_path)
