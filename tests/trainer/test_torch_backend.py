"""The torch backend on real data: what a step changes and what it must not (frozen indexer),
micro-batch and data-parallel invariance, IcePop, checkpoints, optimizer reset, bf16, NaN guard."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from asyncrl.config import LossConfig, TrainerConfig
from asyncrl.model.model import Glm5ForCausalLM
from tests.rollout.conftest import recorded_routing
from tests.services import ROOT, free_port
from tests.trainer.conftest import SUBPROCESS_ENV
from tests.trainer.helpers import make_group, policy_groups
from trainer.advantages import score_group
from trainer.backends.base import BACKENDS, make_backend
from trainer.backends.data_parallel import shard_by_tokens
from trainer.packing import pack

pytestmark = pytest.mark.timeout(120)


def step_inputs(groups, budget: int):
    """Packed micro-batches of on-policy groups and the step's token normalizer."""
    samples = [s for g in groups for s in score_group(make_group(g), 0, 100, "group_mean").samples]
    mbs = pack(samples, budget)
    return mbs, sum(mb.num_loss_tokens for mb in mbs)


@pytest.fixture(scope="module")
def groups(tiny_section):
    return policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), num_groups=4)


def backend(section, **overrides):
    return make_backend(TrainerConfig(lr=1e-3, **overrides), section, seed=0)


def weights(b) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.model.state_dict().items()}


def grads(b) -> dict[str, torch.Tensor]:
    """The step's (clipped) gradients: they stay on the parameters until the next step zeroes them."""
    return {k: p.grad.detach().clone() for k, p in b.model.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0 if atol == 0 else 1e-5, msg=k)


def test_on_policy_step_trains_and_keeps_the_indexer_bit_identical(tiny_section, groups):
    b = backend(tiny_section)
    before = weights(b)
    indexer = {k for k, _ in b.model.named_parameters() if ".indexer." in k}
    assert indexer and all(not p.requires_grad for k, p in b.model.named_parameters() if k in indexer)
    in_optimizer = {id(p) for group in b.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for k, p in b.model.named_parameters() if k in indexer}
    mbs, norm = step_inputs(groups, 64)
    for _ in range(3):
        result = b.train_step(mbs, norm)
    after = weights(b)
    for k in before:
        if ".indexer." in k:
            assert torch.equal(before[k], after[k]), k
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "lm_head.weight" in changed and any(".mlp.experts." in k for k in changed)
    assert result.num_tokens == sum(mb.num_tokens for mb in mbs) and result.grad_norm > 0


def test_first_on_policy_step_has_unit_ratios_and_nothing_masked(tiny_section, groups):
    mbs, norm = step_inputs(groups, 64)
    result = backend(tiny_section).train_step(mbs, norm)
    assert result.metrics["mean_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["masked_fraction"] == 0.0 and result.metrics["mismatch_kl"] == pytest.approx(0, abs=1e-6)
    assert result.metrics["loss_tokens"] == norm


def test_unfrozen_indexer_learns_from_its_kl_loss_only(tiny_section, groups):
    b = backend(tiny_section, freeze_indexer=False)
    before = weights(b)
    result = b.train_step(*step_inputs(groups, 64))
    assert result.metrics["indexer_kl"] > 0
    assert any(not torch.equal(before[k], v) for k, v in weights(b).items() if ".indexer." in k)


def test_micro_batch_split_does_not_change_the_step(tiny_section, groups):
    one, many = backend(tiny_section), backend(tiny_section)
    mbs_one, norm = step_inputs(groups, 4096)
    mbs_many, norm_many = step_inputs(groups, 24)
    assert len(mbs_one) == 1 and len(mbs_many) > 3 and norm == norm_many
    r1, r2 = one.train_step(mbs_one, norm), many.train_step(mbs_many, norm)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5) and r1.grad_norm == pytest.approx(r2.grad_norm, rel=1e-5)
    assert_same(grads(one), grads(many), atol=1e-7)


def test_icepop_equals_is_on_policy(tiny_section, groups):
    """On-policy, pi_train_old = pi_rollout = pi_theta: rho = r = 1, so both losses have the gradient
    -A / N per token (their values differ: -A lp vs -A r)."""
    mbs, norm = step_inputs(groups, 64)
    is_backend = backend(tiny_section)
    icepop = backend(tiny_section, loss=LossConfig(type="icepop_ppo"))
    r_is, r_ice = is_backend.train_step(mbs, norm), icepop.train_step(mbs, norm)
    assert r_ice.metrics["clip_fraction"] == 0 and r_ice.metrics["masked_fraction"] == 0
    assert r_ice.grad_norm == pytest.approx(r_is.grad_norm, rel=1e-5)
    assert_same(grads(is_backend), grads(icepop), atol=1e-7)


def test_gradient_checkpointing_gives_the_same_step(tiny_section, groups):
    mbs, norm = step_inputs(groups, 64)
    plain, ckpt = backend(tiny_section), backend(tiny_section, grad_checkpointing=True)
    assert plain.train_step(mbs, norm).loss == pytest.approx(ckpt.train_step(mbs, norm).loss, rel=1e-6)
    assert_same(grads(plain), grads(ckpt), atol=1e-7)


def test_bf16_autocast_step_is_close_to_fp32(tiny_section, groups):
    mbs, norm = step_inputs(groups, 64)
    fp32 = backend(tiny_section).train_step(mbs, norm)
    bf16 = make_backend(TrainerConfig(lr=1e-3), replace(tiny_section, dtype="bfloat16"), seed=0)
    result = bf16.train_step(mbs, norm)
    assert result.loss == pytest.approx(fp32.loss, rel=0.05) and result.metrics["masked_fraction"] < 0.1
    assert bf16.model.lm_head.weight.dtype == torch.float32  # master weights stay fp32
    pushed = bf16.hf_state_dict()
    assert pushed["lm_head.weight"].dtype == torch.bfloat16
    assert pushed["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays fp32


def test_non_finite_gradient_skips_the_update(tiny_section, groups):
    b = backend(tiny_section)
    mbs, norm = step_inputs(groups, 64)
    mbs[0].advantages[mbs[0].loss_mask] = float("nan")
    before = weights(b)
    result = b.train_step(mbs, norm)
    assert result.metrics["skipped_step"] == 1.0
    assert_same(before, weights(b))


def test_checkpoint_restores_model_and_optimizer_exactly(tiny_section, groups, tmp_path):
    mbs, norm = step_inputs(groups, 64)
    a = backend(tiny_section)
    a.train_step(mbs, norm)
    a.save_checkpoint(tmp_path / "ckpt")
    a.train_step(mbs, norm)
    resumed = backend(tiny_section)
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.train_step(mbs, norm)
    assert_same(weights(a), weights(resumed))  # bit-identical: Adam moments and step count came back


def test_reset_optimizer_drops_the_moments(tiny_section, groups):
    mbs, norm = step_inputs(groups, 64)
    kept, reset = backend(tiny_section), backend(tiny_section)
    for b in (kept, reset):
        b.train_step(mbs, norm)
    reset.reset_optimizer()
    assert reset.optimizer.state == {} and len(kept.optimizer.state) > 0
    kept.train_step(mbs, norm)
    reset.train_step(mbs, norm)
    kept_w, reset_w = weights(kept), weights(reset)
    assert any(not torch.equal(kept_w[k], reset_w[k]) for k in kept_w)
    assert all(state["step"] == 1 for state in reset.optimizer.state.values())


def test_registry_imports_only_the_chosen_backend(tiny_section):
    assert set(BACKENDS) == {"torch", "megatron"}
    backend(tiny_section)
    assert "trainer.backends.megatron.backend" not in sys.modules
    with pytest.raises(ValueError, match="trainer.backend 'jax' not in"):
        make_backend(TrainerConfig(backend="jax"), tiny_section)


def test_shard_by_tokens_balances_and_keeps_everything():
    sizes = [40, 10, 30, 20, 5]
    mbs = [type("MB", (), {"num_tokens": n})() for n in sizes]
    shards = shard_by_tokens(mbs, 2)
    assert sorted(id(m) for s in shards for m in s) == sorted(id(m) for m in mbs)
    assert [sum(m.num_tokens for m in s) for s in shards] == [55, 50]  # 40+10+5 | 30+20
    assert shard_by_tokens(mbs[:1], 3)[1:] == [[], []]  # a rank may get nothing


def test_two_ranks_step_equals_one_rank(tiny_section, groups, tmp_path):
    """Two real processes (gloo, environment as torchrun sets it) against the in-process single rank:
    two steps with an optimizer reset between them, the micro-batches split across the ranks."""
    mbs, norm = step_inputs(groups, 24)
    torch.save({"mbs": mbs, "norm": norm}, tmp_path / "step.pt")
    single = backend(tiny_section)
    results = [single.train_step(mbs, norm)]
    single.reset_optimizer()
    results.append(single.train_step(mbs, norm))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.trainer.dp_worker", str(tmp_path)], cwd=ROOT,
                              env={**os.environ, **SUBPROCESS_ENV, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    report = json.loads((tmp_path / "result.json").read_text())
    assert all(len(shard) > 0 for shard in shard_by_tokens(mbs, 2))
    for ours, theirs in zip(results, report["steps"]):
        assert theirs["loss"] == pytest.approx(ours.loss, rel=1e-5)
        assert theirs["grad_norm"] == pytest.approx(ours.grad_norm, rel=1e-5)
        assert theirs["num_tokens"] == ours.num_tokens
        assert theirs["samples"].keys() == ours.samples.keys()  # every rank's samples reach the leader
        for sid, tokens in ours.samples.items():
            np.testing.assert_allclose(theirs["samples"][sid], tokens.logprobs, atol=1e-6)
    assert_same(grads(single), torch.load(tmp_path / "grads.pt"), atol=1e-7)
    # Adam divides by |g|: float-order noise on near-zero gradients moves weights by << lr
    assert_same(weights(single), torch.load(tmp_path / "weights.pt"), atol=1e-4)



def test_dense_and_sparse_attention_give_the_same_step(tiny_section):
    """Sequences longer than index_topk (64): the indexer's selection matters; the dense path masks
    with it, the sparse one gathers it; the gradients agree."""
    long_groups = policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), num_groups=1, gen_len=90)
    mbs, norm = step_inputs(long_groups, 4096)
    assert mbs[0].max_seqlen > tiny_section.arch.index_topk
    dense, sparse = backend(tiny_section), backend(tiny_section, dense_attention_up_to=0)
    assert dense.train_step(mbs, norm).loss == pytest.approx(sparse.train_step(mbs, norm).loss, rel=1e-5)
    assert_same(grads(dense), grads(sparse), atol=1e-6)


def with_routing(sample, routing):
    """The sample carrying `routing` [T - 1, layers, k] as the gateway stores it (flat rows, -1 last row)."""
    rows = np.full((sample.num_tokens, routing.shape[1] * routing.shape[2]), -1, np.int16)
    rows[:-1] = routing.flatten(1).numpy()
    return replace(sample, routed_experts=rows)


def test_routing_replay_trains_with_the_rollouts_experts(tiny_section, groups):
    """R3: replaying the routing the model itself chooses is the plain step exactly; replaying other
    experts (as an engine whose router drifted would report) changes the step, and a micro-batch mixing
    samples with and without routing replays only the former."""
    model = Glm5ForCausalLM.from_config(tiny_section.arch, seed=0)
    own = [[with_routing(s, recorded_routing(model, s.tokens[:-1].tolist())) for s in g] for g in groups]
    n_experts = tiny_section.arch.n_routed_experts
    shifted = [[replace(s, routed_experts=np.where(s.routed_experts >= 0, (s.routed_experts + 1) % n_experts, -1))
                for s in g] for g in own]
    plain, replayed, other = backend(tiny_section), backend(tiny_section), backend(tiny_section)
    mbs, norm = step_inputs(groups, 4096)
    own_mbs, _ = step_inputs(own, 4096)
    assert own_mbs[0].routed_experts is not None and mbs[0].routed_experts is None
    torch.testing.assert_close(replayed.logprobs(own_mbs[0]), plain.logprobs(mbs[0]), atol=0, rtol=0)
    r_plain, r_own = plain.train_step(mbs, norm), replayed.train_step(own_mbs, norm)
    assert r_own.loss == pytest.approx(r_plain.loss, rel=1e-6)
    assert_same(grads(plain), grads(replayed), atol=1e-7)
    shifted_mb, free_mb = step_inputs(shifted, 4096)[0][0], step_inputs(groups, 4096)[0][0]
    free_lp = other.logprobs(free_mb)  # `other` has not trained: the initial weights, as `shifted`'s routing
    assert (other.logprobs(shifted_mb) - free_lp).abs().max() > 1e-3
    mixed = [[g[0], replace(g[1], routed_experts=None)] for g in shifted]
    mixed_mb = step_inputs(mixed, 4096)[0][0]
    mixed_lp = other.logprobs(mixed_mb)

    def rows(mb, sample_id):
        i = mb.sample_ids.index(sample_id)
        return slice(int(mb.cu_seqlens[i]), int(mb.cu_seqlens[i + 1]))

    for g in mixed:  # without routing: -1 rows, routed anew; with: the shifted experts
        unrouted, routed = rows(mixed_mb, g[1].sample_id), rows(mixed_mb, g[0].sample_id)
        assert (mixed_mb.routed_experts[unrouted] == -1).all()
        torch.testing.assert_close(mixed_lp[unrouted], free_lp[rows(free_mb, g[1].sample_id)], atol=0, rtol=0)
        assert not torch.equal(mixed_lp[routed], free_lp[rows(free_mb, g[0].sample_id)])
