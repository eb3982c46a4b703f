"""Offline W&B runs read back with W&B's own reader of its .wandb transaction log (`wandb leet inspect
--json`, wandb-core's record printer: one JSON object per protobuf Record), not by grepping files."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OfflineRun:
    path: Path
    """The .wandb file."""
    run: dict = field(default_factory=dict)
    """The RunRecord: run_id, project, entity, run_group, tags, display_name, config."""
    history: list[dict] = field(default_factory=list)
    """One dict per history row: the logged values, with `_step`."""
    exit_code: int | None = None

    @property
    def steps(self) -> list[int]:
        return [int(row["_step"]) for row in self.history]

    @property
    def keys(self) -> set[str]:
        return {k for row in self.history for k in row if not k.startswith("_")}

    def config(self) -> dict:
        """The run's config as logged ({key: value}, W&B's own `_wandb` left out)."""
        update = self.run.get("config", {}).get("update", {})
        return {k: v for k, v in update.items() if k != "_wandb"}


def read_offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under `wandb_dir` (<dir>/wandb), oldest first."""
    return [read_offline_run(p) for p in sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb"))]


def read_offline_run(path: Path) -> OfflineRun:
    wandb = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb), "leet", "inspect", "--json", str(path)], capture_output=True, text=True,
                         timeout=120, check=True)
    run = OfflineRun(path)
    for line in out.stdout.splitlines():
        record = json.loads(line)
        if record["type"] == "run":
            run.run = record["run"]
        elif record["type"] == "history":
            run.history.append(record["history"]["item"])
        elif record["type"] == "exit":
            run.exit_code = record["exit"].get("exit_code", 0)
    return run
