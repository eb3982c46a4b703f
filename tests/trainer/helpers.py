"""Builders of samples and groups for the trainer tests (real asyncrl types, no mocks)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from asyncrl.types import GroupRecord, Sample, TrainingGroup


def make_sample(sample_id: str, *, group_id: str = "g0", session_id: Optional[str] = None, status: str = "completed",
                reward: float = 0.0, version: int = 10, prompt_len: int = 4, gen_len: int = 4,
                versions: Optional[Sequence[int]] = None, seed: int = 0) -> Sample:
    """`prompt_len` prompt tokens then `gen_len` generated ones, all generated under `version`
    (or the per-generated-token `versions`)."""
    rng = np.random.default_rng(seed)
    n = prompt_len + gen_len
    mask = np.r_[np.zeros(prompt_len), np.ones(gen_len)].astype(np.uint8)
    gen_versions = np.full(gen_len, version) if versions is None else np.asarray(versions)
    return Sample(
        sample_id=sample_id, session_id=session_id or f"sess-{sample_id}", group_id=group_id, task_id="t",
        env="arith", status=status, reward=reward, tokens=rng.integers(1, 1000, n),
        loss_mask=mask, rollout_logprobs=np.where(mask, -rng.random(n), 0.0),
        weight_versions=np.r_[np.full(prompt_len, -1), gen_versions],
    )


def make_group(samples: Sequence[Sample], group_size: Optional[int] = None, stream_id: str = "1-0") -> TrainingGroup:
    group_id = samples[0].group_id if samples else "g0"
    size = len({s.session_id for s in samples}) if group_size is None else group_size
    record = GroupRecord(group_id, "t", "arith", [f"ref-{s.sample_id}" for s in samples], size)
    return TrainingGroup(stream_id, record, list(samples))
