"""Trainer checkpoints: everything a restarted trainer needs to continue as if nothing happened.

    <run_dir>/checkpoints/step-00000010/
        model/, optimizer.pt      the backend's state (TrainerBackend.save_checkpoint)
        trainer_state.json        TrainerState: step, weight version, groups trained since the last checkpoint,
                                  the step's metrics record

Each checkpoint directory appears atomically (trainer/atomic_dir.py). The commit protocol with the
group stream (trainer/data.py):

1. groups are read and trained; their stream ids are remembered, not acknowledged;
2. a checkpoint is written with those ids in `trained_stream_ids` and made durable;
3. only then are the groups acknowledged (XACK).

A crash before 2 re-delivers the groups to the restarted trainer, which resumes from the previous
checkpoint and trains them again (their first training died with the process: each group reaches
the surviving weights once). A crash between 2 and 3 re-delivers groups the checkpoint already holds:
the restarted loader gets `trained_stream_ids` and acknowledges them without training them again.
The step's metrics record is published after 2, so the checkpoint holds it too (`TrainerState.record`):
a crash between 2 and its publication is made good by the restarted trainer (Trainer.publish_lost_record).
The position in the stream itself lives in Redis (the consumer group's pending list and
last-delivered id), so it needs no copy here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from trainer.atomic_dir import prune, write_atomically
from trainer.backends.base import TrainerBackend

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer steps taken."""
    weight_version: int = 0
    """Version of the last weights this trainer pushed (0: the initial weights the engines start with)."""
    trained_stream_ids: list[str] = field(default_factory=list)
    """Groups trained since the previous checkpoint: acknowledged once this checkpoint is durable."""
    repushes: list[list[int]] = field(default_factory=list)
    """[pushed, restored] for each restart that pushed the checkpoint's weights under a new version
    (Trainer.start: versions only grow): version `pushed` serves the weights of version `restored`."""
    record: dict[str, float] = field(default_factory=dict)
    """The metrics record of `step` (trainer/loop.py), published after this checkpoint is durable: a restart
    publishes it if a crash came in between (Trainer.start), so every durable step has its record."""

    @property
    def lineage_offset(self) -> int:
        """Versions pushed without training: served version - this = trained pushes (the orchestrator's
        staleness budget, WeightsState.lineage_offset)."""
        return sum(pushed - restored for pushed, restored in self.repushes)

    def lineage_version(self, version: int) -> int:
        """`version` renumbered into the line of weights served now, so that staleness (now - version) counts
        optimizer steps: a group generated at the checkpoint's version before a restart is as fresh as the
        weights pushed again after it, not `pushed - restored` versions old (it was delivered, and must be
        trained again, not dropped as stale). Versions of weights the restart threw away land ahead of now."""
        for pushed, restored in self.repushes:
            if version < pushed:
                version += pushed - restored
        return version


class CheckpointManager:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(self, backend: TrainerBackend, state: TrainerState) -> Path:
        """Write and make durable a checkpoint of `backend` at `state.step`; prune old ones."""
        def write(tmp: Path) -> None:
            backend.save_checkpoint(tmp)
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))

        path = write_atomically(self.root / f"step-{state.step:08d}", write)
        prune(self.root, "step-*", self.keep)
        log.info("checkpoint %s (weight version %d, %d groups)", path, state.weight_version,
                 len(state.trained_stream_ids))
        return path

    def latest(self) -> Optional[Path]:
        found = sorted(self.root.glob("step-*"))
        return found[-1] if found else None

    def restore(self, backend: TrainerBackend) -> TrainerState:
        """Load the newest checkpoint into `backend`; a fresh TrainerState when there is none."""
        path = self.latest()
        if path is None:
            return TrainerState()
        backend.load_checkpoint(path)
        state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
        log.info("resumed from %s: step %d, weight version %d", path, state.step, state.weight_version)
        return state
