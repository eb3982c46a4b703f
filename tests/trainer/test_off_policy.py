"""The off-policy health metrics (trainer/off_policy.py) on hand-made cases, and against the loss and the
torch backend they summarise."""

import math

import numpy as np
import pytest
import torch

from asyncrl.config import LossConfig, TrainerConfig
from asyncrl.model.model import Glm5ForCausalLM
from tests.trainer.helpers import make_group, make_sample, policy_groups
from trainer.advantages import FilterStats, score_group
from trainer.backends.base import SampleTokens, make_backend
from trainer.data import StepBatch
from trainer.losses import TrustBand, build_loss, direct_double_sided_is_loss
from trainer.off_policy import (band_sides, effective_sample_size, mismatch_kl, outcome_label, step_health,
                                trained_records)
from trainer.packing import pack

IS_BAND = TrustBand(0.8, 1.28)


def test_effective_sample_size_of_equal_one_dominant_and_hand_weights():
    assert effective_sample_size(np.full(7, 0.3)) == pytest.approx(7.0)
    assert effective_sample_size(np.r_[1e6, np.full(9, 1e-6)]) == pytest.approx(1.0)
    assert effective_sample_size(np.array([1.0, 2.0, 3.0])) == pytest.approx(36 / 14)
    assert effective_sample_size(np.zeros(0)) == 0.0


def test_mismatch_kl_is_zero_on_policy_and_the_k3_value_off_it():
    assert mismatch_kl(np.zeros(5)) == 0.0
    assert mismatch_kl(np.array([math.log(2.0), -math.log(2.0)])) == pytest.approx(((2 - math.log(2) - 1)
                                                                                    + (0.5 + math.log(2) - 1)) / 2)


def test_band_sides_follow_the_open_is_band_and_the_closed_icepop_band():
    below, above = band_sides(np.array([0.7, 0.8, 0.81, 1.0, 1.279, 1.28, 1.5], np.float32), IS_BAND)
    assert below.tolist() == [True, True, False, False, False, False, False]   # open: 0.8 itself is out
    assert above.tolist() == [False, False, False, False, False, True, True]
    below, above = band_sides(np.array([0.49, 0.5, 2.0, 2.01], np.float32), TrustBand(0.5, 2.0, closed=True))
    assert below.tolist() == [True, False, False, False] and above.tolist() == [False, False, False, True]
    below, above = band_sides(np.array([0.01, 100.0], np.float32), None)  # a loss with no band masks nothing
    assert not below.any() and not above.any()


def sample_with(sample_id, env, rollout, trainer, *, status="completed", versions=None, session=None, reward=0.0):
    """Two prompt tokens, then generated tokens with these rollout log-probs; the trainer's are `trainer`."""
    n = len(rollout)
    s = make_sample(sample_id, prompt_len=2, gen_len=n, status=status, versions=versions, session_id=session,
                    reward=reward)
    s.env = env
    s.rollout_logprobs = np.r_[0.0, 0.0, rollout].astype(np.float32)
    # the trainer's forward covers targets t[1..]: t[1] is a prompt token (its value is never read)
    return s, SampleTokens(np.r_[-5.0, trainer].astype(np.float32), np.full(n + 1, 0.5, np.float32))


def hand_batch():
    """env a: one exact token, one the trainer likes 1.5x, one it likes 0.5x; env b: two exact tokens and a
    failed member. Weight version 12; a's sample is 2 versions old, b's 0."""
    a, ta = sample_with("a", "a", [-1.0, -1.0, -1.0], [-1.0, -1.0 + math.log(1.5), -1.0 + math.log(0.5)],
                        versions=[10, 11, 11], reward=1.0)
    b, tb = sample_with("b", "b", [-2.0, -2.0], [-2.0, -2.0], versions=[12, 12], session="sess-b")
    b2, _ = sample_with("b2", "b", [-2.0], [-2.0], status="failed", session="sess-b2")
    b2.metadata["info"] = {"outcome": "environment", "reason": "env_error"}
    groups = [make_group([a]), make_group([b, b2], stream_id="2-0")]
    batch = StepBatch(0, 12, [], groups, FilterStats(), 64)
    return batch, {"a": ta, "b": tb}


def test_step_health_on_a_hand_made_step_whole_and_per_env():
    batch, trained = hand_batch()
    m = step_health(batch, trained, IS_BAND, step_s=2.0)
    k3 = [0.0, 1.5 - math.log(1.5) - 1, 0.5 - math.log(0.5) - 1]
    assert m["env/a/off_policy/mismatch_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert m["off_policy/mismatch_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert m["off_policy/max_abs_log_ratio"] == pytest.approx(math.log(2), rel=1e-5)
    assert m["off_policy/masked_high_fraction"] == pytest.approx(1 / 5)   # 1.5 >= 1.28
    assert m["off_policy/masked_low_fraction"] == pytest.approx(1 / 5)    # 0.5 <= 0.8
    assert m["env/b/off_policy/masked_low_fraction"] == 0.0
    assert m["env/a/off_policy/ess_fraction"] == pytest.approx(effective_sample_size(np.array([1, 1.5, 0.5])) / 3,
                                                                rel=1e-5)
    assert m["env/b/off_policy/ess_fraction"] == pytest.approx(1.0)
    assert m["off_policy/entropy"] == pytest.approx(0.5)
    assert (m["off_policy/staleness/0"], m["off_policy/staleness/2"]) == (1.0, 1.0)  # oldest token of a: v10
    assert "env/a/off_policy/staleness/0" not in m and m["env/a/off_policy/staleness/2"] == 1.0
    assert (m["rollout/episodes"], m["rollout/episodes_per_s"]) == (3.0, 1.5)   # the failed member counts
    assert m["rollout/generated_tokens_per_s"] == pytest.approx(6 / 2.0)
    assert (m["rollout/outcome/completed"], m["rollout/outcome/env_failure"]) == (2.0, 1.0)
    assert m["env/b/rollout/outcome/env_failure"] == 1.0 and "env/a/rollout/outcome/env_failure" not in m
    assert m["env/a/rollout/reward_mean"] == 1.0 and m["env/b/rollout/reward_mean"] == 0.0  # trained samples only
    assert "rollout/reward_mean" not in m  # the whole step's is the record's reward_mean
    assert m["env/a/rollout/response_len_mean"] == 3.0 and m["env/a/rollout/episode_len_mean"] == 5.0


def test_agent_metrics_are_per_sample_means_of_the_gateways_and_the_envs_counts():
    batch, trained = hand_batch()
    a, b = batch.groups[0].samples[0], batch.groups[1].samples[0]
    a.metadata.update(tool_calls=3, tool_call_parse_failures=1, info={"tools": {"calls": 3, "errors": 2}})
    b.metadata.update(tool_calls=1, tool_call_parse_failures=0, info={"tools": {"calls": 1, "errors": 0}})
    m = step_health(batch, trained, IS_BAND, step_s=2.0)
    assert (m["rollout/tool_calls_mean"], m["rollout/tool_call_parse_failures_mean"]) == (2.0, 0.5)
    assert m["rollout/tool_errors_mean"] == 1.0 and m["env/a/rollout/tool_errors_mean"] == 2.0
    b.metadata["segment"] = 1  # a later segment of its episode: the episode's tool errors count once, on segment 0
    assert step_health(batch, trained, IS_BAND, step_s=2.0)["env/b/rollout/tool_calls_mean"] == 1.0
    assert step_health(batch, trained, IS_BAND, step_s=2.0)["rollout/tool_errors_mean"] == 1.0
    b.metadata["info"]["tools"]["errors"] = 4
    assert step_health(batch, trained, IS_BAND, step_s=2.0)["rollout/tool_errors_mean"] == 1.0


def test_outcome_labels():
    failed = make_sample("f", status="failed")
    assert outcome_label(failed) == "failed"
    failed.metadata["info"] = {"outcome": "infrastructure", "reason": "deadline_exceeded"}
    assert outcome_label(failed) == "infra_failure"
    assert outcome_label(make_sample("t", status="truncated")) == "truncated"


def test_trained_records_align_with_the_sample_and_keep_what_the_band_keeps():
    batch, trained = hand_batch()
    records = {r.sample_ref: r for r in trained_records(batch, trained, IS_BAND, step=7, weight_version=3)}
    assert set(records) == {"ref-a", "ref-b"}   # the failed member was not trained: no record
    a = records["ref-a"]
    assert (a.step, a.weight_version) == (7, 3)
    np.testing.assert_allclose(a.trainer_logprobs, [0, 0, -1.0, -1.0 + math.log(1.5), -1.0 + math.log(0.5)],
                               rtol=1e-6)
    assert a.kept.tolist() == [0, 0, 1, 0, 0] and records["ref-b"].kept.tolist() == [0, 0, 1, 1]


@pytest.fixture(scope="module")
def model(tiny_section):
    return Glm5ForCausalLM.from_config(tiny_section.arch, seed=0)


def test_the_records_mask_exactly_the_tokens_the_loss_masked(model):
    """Off-policy samples (rollout log-probs shifted at random) through the IS loss and trained_records."""
    rng = np.random.default_rng(0)
    groups = policy_groups(model, num_groups=3, group_size=3)
    for group in groups:
        for s in group:
            s.rollout_logprobs = np.where(s.loss_mask, s.rollout_logprobs + rng.normal(0, 0.3, s.num_tokens), 0)
    training = [make_group(g, stream_id=f"{i}-0") for i, g in enumerate(groups)]
    mbs = pack([s for g in training for s in score_group(g, 0, 100, "group_mean").samples], 4096)
    mb = mbs[0]
    out = model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.targets, with_entropy=False)
    _, metrics = direct_double_sided_is_loss(out.logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                             0.2, 0.28)
    from trainer.backends.base import sample_tokens

    batch = StepBatch(0, 0, mbs, training, FilterStats(), 4096)
    records = trained_records(batch, sample_tokens(mb, out.logprobs, None), IS_BAND, 1, 0)
    masked = int(metrics.masked_tokens)
    assert 0 < masked < int(metrics.loss_tokens)      # the shift put some tokens outside the band
    assert sum(int(r.kept.sum()) for r in records) == int(metrics.loss_tokens) - masked


def test_the_torch_backends_step_reports_every_samples_pre_update_logprobs(tiny_section, model):
    backend = make_backend(TrainerConfig(lr=1e-2, loss=LossConfig()), tiny_section, seed=0)
    training = [make_group(g, stream_id=f"{i}-0") for i, g in enumerate(policy_groups(model, num_groups=2))]
    mbs = pack([s for g in training for s in score_group(g, 0, 100, "group_mean").samples], 32)
    before = {sid: lp for mb in mbs for sid, lp in
              zip(mb.sample_ids, torch.tensor_split(backend.logprobs(mb), mb.cu_seqlens[1:-1].tolist()))}
    norm = sum(mb.num_loss_tokens for mb in mbs)
    first = backend.train_step(mbs, norm)
    assert first.samples.keys() == before.keys()
    for sid, tokens in first.samples.items():
        np.testing.assert_allclose(tokens.logprobs, before[sid].numpy(), atol=1e-5)
        assert tokens.entropy is not None and (tokens.entropy >= 0).all()
    second = backend.train_step(mbs, norm)  # after one update the policy has moved off the rollout's
    health = step_health(StepBatch(1, 0, mbs, training, FilterStats(), 32), second.samples,
                         build_loss(LossConfig()).band, 1.0)
    assert health["off_policy/mismatch_kl"] == pytest.approx(second.metrics["mismatch_kl"], rel=1e-4)
    assert health["off_policy/mismatch_kl"] > 0
    assert health["off_policy/masked_low_fraction"] + health["off_policy/masked_high_fraction"] == \
        pytest.approx(second.metrics["masked_fraction"])
    assert health["off_policy/entropy"] == pytest.approx(second.metrics["entropy"], rel=1e-4)
