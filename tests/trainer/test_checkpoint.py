"""Atomic checkpoint directories and the trainer state they carry."""

import pytest
import torch

from asyncrl.config import TrainerConfig
from trainer.atomic_dir import prune, write_atomically
from trainer.backends.base import make_backend
from trainer.checkpoint import CheckpointManager, TrainerState


def test_a_write_that_dies_leaves_the_previous_directory_and_is_swept(tmp_path):
    final = tmp_path / "step-1"
    write_atomically(final, lambda d: (d / "a").write_text("old"))

    def crash(d):
        (d / "a").write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomically(final, crash)
    assert (final / "a").read_text() == "old" and len(list(tmp_path.glob(".tmp-step-1-*"))) == 1
    write_atomically(final, lambda d: (d / "a").write_text("new"))
    assert (final / "a").read_text() == "new" and not list(tmp_path.glob(".tmp-*"))


def test_prune_keeps_the_newest(tmp_path):
    for step in (3, 10, 7, 1):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / ".tmp-step-00000011-1").mkdir()
    prune(tmp_path, "step-*", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-00000011-1", "step-00000007", "step-00000010"]


def test_restore_returns_the_newest_state_and_weights(tiny_section, tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    fresh = make_backend(TrainerConfig(), tiny_section, seed=0)
    assert manager.restore(fresh) == TrainerState()  # nothing yet: start from scratch
    saved = make_backend(TrainerConfig(), tiny_section, seed=5)
    for step in (2, 4, 6):
        manager.save(saved, TrainerState(step=step, weight_version=step // 2, trained_stream_ids=[f"{step}-0"]))
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-00000004", "step-00000006"]
    assert manager.restore(fresh) == TrainerState(6, 3, ["6-0"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), saved.model.state_dict().values()))
