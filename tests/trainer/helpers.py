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


def on_policy(sample: Sample, model) -> Sample:
    """The sample with rollout log-probs = `model`'s teacher-forced log-probs of its generated tokens
    (what an engine serving exactly these weights records): every IS ratio starts at 1."""
    import torch

    ids = torch.as_tensor(sample.tokens, dtype=torch.long)
    with torch.no_grad():
        lp = model.token_logprobs(ids[:-1], torch.tensor([0, len(ids) - 1]), ids[1:], with_entropy=False).logprobs
    sample.rollout_logprobs = np.where(sample.loss_mask.astype(bool), np.r_[0.0, lp.numpy()], 0.0).astype(np.float32)
    return sample


def policy_groups(model, num_groups: int, group_size: int = 2, prompt_len: int = 5, gen_len: int = 6,
                  version: int = 0, seed: int = 0) -> list[list[Sample]]:
    """`num_groups` groups of on-policy samples with distinct rewards (non-zero advantages)."""
    groups = []
    for g in range(num_groups):
        samples = [on_policy(make_sample(f"g{g}-s{i}", group_id=f"g{g}", reward=float((i + g) % 3),
                                         prompt_len=prompt_len, gen_len=gen_len + (g + i) % 3, version=version,
                                         seed=seed * 10_000 + g * 100 + i), model)
                   for i in range(group_size)]
        groups.append(samples)
    return groups


async def write_groups(store, groups: Sequence[Sequence[Sample]]) -> list[str]:
    """Append the samples and one complete-group record per group; -> the groups' stream ids."""
    ids = []
    for samples in groups:
        refs = [await store.add_sample(s) for s in samples]
        ids.append(await store.add_group(GroupRecord(samples[0].group_id, "t", "arith", refs, len(samples))))
    return ids
