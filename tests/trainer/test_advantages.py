import numpy as np
import pytest

from tests.trainer.helpers import make_group, make_sample
from trainer.advantages import FilterStats, is_stale, score_group
from trainer.checkpoint import TrainerState

W_NOW, TAU = 10, 2


def score(samples, method="group_mean", group_size=None):
    return score_group(make_group(samples, group_size), W_NOW, TAU, method)


def ids(scored):
    return [s.sample.sample_id for s in scored.samples]


def advantages(scored):
    return [s.advantage for s in scored.samples]


def test_group_mean_advantages_and_per_token_layout():
    scored = score([make_sample(f"s{i}", reward=r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])])
    assert advantages(scored) == [0.5, -0.5, -0.5, 0.5]
    per_token = scored.samples[0].token_advantages()
    np.testing.assert_array_equal(per_token, [0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])  # loss tokens only
    assert per_token.dtype == np.float32
    assert scored.stats == FilterStats(groups_kept=1)


def test_group_norm_advantages():
    scored = score([make_sample(f"s{i}", reward=r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])], "group_norm")
    std = np.sqrt(0.75 * 0.25)  # population std of [1, 0, 0, 0]
    np.testing.assert_allclose(advantages(scored), np.array([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    flat = score([make_sample(f"s{i}", reward=1.0) for i in range(4)], "group_norm")
    assert advantages(flat) == [0.0] * 4  # equal rewards: zero, not NaN
    with pytest.raises(ValueError, match="trainer.advantage 'ppo' not in"):
        score(flat.group.samples, "ppo")


def test_staleness_is_measured_on_the_oldest_generated_token():
    assert not is_stale([make_sample("a", version=8)], W_NOW, TAU)  # 10 - 8 = 2, not > tau
    assert is_stale([make_sample("a", version=7)], W_NOW, TAU)
    assert is_stale([make_sample("a", versions=[9, 7, 9, 10])], W_NOW, TAU)  # multi-version sample: w0 = 7
    assert not is_stale([make_sample("a", gen_len=0)], W_NOW, TAU)  # no generated token, nothing is stale


def test_staleness_after_a_restart_counts_steps_along_the_restored_line():
    """Checkpoint at v15, engines at v17 when the trainer died: the restored trainer pushes its v15 weights as
    v18 (versions only grow). A group generated at v15 is as fresh as v18 (the weights are the same) and,
    delivered before the crash, must be trained again, not dropped as 3 versions stale; at v20 (two steps
    on) it is 2 steps old. v16-v17 (weights the restart threw away) land ahead of now, not stale."""
    state = TrainerState(step=15, weight_version=18, repushes=[[18, 15]])
    assert [state.lineage_version(v) for v in (12, 15, 16, 17, 18, 20)] == [15, 18, 19, 20, 18, 20]
    assert not is_stale([make_sample("a", version=15)], 18, TAU, state.lineage_version)
    assert is_stale([make_sample("a", version=15)], 18, 0, lambda v: v)  # by raw version numbers: 3 stale
    assert not is_stale([make_sample("a", version=15)], 20, TAU, state.lineage_version)
    assert is_stale([make_sample("a", version=14)], 20, TAU, state.lineage_version)  # 3 steps along the line
    scored = score_group(make_group([make_sample(f"s{i}", version=15) for i in range(2)]), 18, 0, "group_mean",
                         state.lineage_version)
    assert scored.stats.stale == 0 and len(scored.samples) == 2
    # a second restart from a checkpoint of the new line (v20 = step 17), engines at v23: pushed as v24
    state.repushes.append([24, 20])
    assert [state.lineage_version(v) for v in (15, 20, 22, 24)] == [22, 24, 26, 24]


def test_stale_member_dropped_and_group_padded_deterministically():
    rewards = [1.0, 0.0, 0.0, 0.0]
    samples = [make_sample(f"s{i}", reward=r, version=v) for i, (r, v) in enumerate(zip(rewards, [9, 3, 10, 8]))]
    scored = score(samples)
    # s1 is stale (10 - 3 > 2): 3 of 4 valid (> half) -> padded by repeating valid members in order
    assert ids(scored) == ["s0", "s2", "s3", "s0"]
    assert [s.padding_copy for s in scored.samples] == [False, False, False, True]
    # advantages over the padded group, exactly as for a complete group: rewards [1, 0, 0, 1]
    assert advantages(scored) == [0.5, -0.5, -0.5, 0.5]
    assert scored.stats == FilterStats(groups_kept=1, groups_padded=1, stale=1, padding_copies=1)
    assert score(samples).samples == scored.samples  # deterministic


def test_padding_cycles_through_valid_members_for_larger_gaps():
    samples = [make_sample(f"s{i}", reward=float(i), status="failed" if i >= 5 else "completed") for i in range(8)]
    scored = score(samples)
    assert ids(scored) == ["s0", "s1", "s2", "s3", "s4", "s0", "s1", "s2"]
    assert scored.stats.failed == 3 and scored.stats.padding_copies == 3
    assert sum(advantages(scored)) == pytest.approx(0.0)


@pytest.mark.parametrize("statuses,versions", [
    (["completed", "failed", "completed", "failed"], [10] * 4),   # exactly half valid
    (["failed", "completed", "failed", "failed"], [10] * 4),      # fewer than half
    (["completed", "failed", "completed", "completed"], [10, 10, 1, 10]),  # failed + stale together
])
def test_group_without_a_valid_majority_is_dropped(statuses, versions):
    samples = [make_sample(f"s{i}", status=st, version=v, reward=1.0)
               for i, (st, v) in enumerate(zip(statuses, versions))]
    scored = score(samples)
    assert scored.samples == []
    assert scored.stats.groups_dropped == 1 and scored.stats.groups_kept == 0


def test_missing_members_count_as_invalid():
    samples = [make_sample(f"s{i}", reward=float(i)) for i in range(3)]
    padded = score(samples, group_size=4)
    assert ids(padded) == ["s0", "s1", "s2", "s0"] and padded.stats.missing == 1
    assert score(samples[:2], group_size=4).stats.groups_dropped == 1


def test_aborted_samples_are_dropped_and_counted():
    samples = [make_sample(f"s{i}", status="aborted" if i == 0 else "completed") for i in range(4)]
    scored = score(samples)
    assert ids(scored) == ["s1", "s2", "s3", "s1"] and scored.stats.aborted == 1


def test_segments_of_one_episode_share_its_advantage_and_its_fate():
    seg = dict(group_id="g0", session_id="episode-a", reward=1.0)
    samples = [make_sample("a0", version=9, **seg), make_sample("a1", version=10, **seg),
               make_sample("b", reward=0.0, version=10)]
    scored = score(samples)
    assert ids(scored) == ["a0", "a1", "b"] and advantages(scored) == [0.5, 0.5, -0.5]
    # the episode's oldest segment is stale -> the whole episode (both segments) is invalid
    samples[0] = make_sample("a0", version=6, **seg)
    assert score(samples + [make_sample("c", reward=0.0)]).stats.stale == 1
