"""megatron backend, one process (CPU, gloo): parity with asyncrl's torch model on the tiny config.

Optional tier: skipped unless megatron-core is installed (`make test-megatron`). Same weights (the
seeded random init both backends use) must give the same log-probs and the same first step.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from asyncrl.config import TrainerConfig, load_model_section
from asyncrl.model.io import checkpoint_tensors
from asyncrl.model.model import Glm5ForCausalLM
from tests.trainer.megatron_helpers import (SEED, at_temperatures, make_micro_batches, normalizer_of, reference_step,
                                            with_replayed_routing)

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (optional tier: make test-megatron)"),
]

CFG = TrainerConfig(backend="megatron", lr=1e-3)
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def section():
    return load_model_section("tiny")


@pytest.fixture(scope="module")
def micro_batches(section):
    return make_micro_batches(section.arch)


@pytest.fixture(scope="module")
def reference(section, micro_batches):
    return reference_step(section.arch, CFG, micro_batches)


def new_backend(section, cfg: TrainerConfig = CFG):
    from trainer.backends.megatron.backend import MegatronBackend

    return MegatronBackend(cfg, section, seed=SEED)


@pytest.fixture
def backend(section):
    return new_backend(section)


def test_hf_megatron_conversion_round_trips_every_tensor(section):
    from trainer.backends.megatron.hf_weights import hf_to_megatron, megatron_to_hf

    from trainer.backends.megatron.backend import is_mtp

    hf = checkpoint_tensors(Glm5ForCausalLM.from_config(section.arch, seed=SEED))
    hf = {name: t for name, t in hf.items() if not is_mtp(name, section.arch)}  # the backend keeps MTP aside
    full = hf_to_megatron(hf)
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in full
    assert "decoder.layers.2.self_attention.core_attention.indexer.linear_wk.weight" not in full  # shared-indexer layer
    back = megatron_to_hf(full)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)
    with pytest.raises(ValueError, match="no HF <-> megatron mapping"):
        hf_to_megatron({"model.layers.0.self_attn.rotary.weight": torch.zeros(1)})


def test_backend_weights_equal_the_checkpoint_it_loaded(backend, section):
    hf = checkpoint_tensors(Glm5ForCausalLM.from_config(section.arch, seed=SEED))
    pushed = backend.hf_state_dict()
    assert pushed.keys() == hf.keys()
    assert all(torch.equal(pushed[name], hf[name]) for name in hf)
    assert pushed["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_logprobs_match_the_torch_model(backend, micro_batches, reference):
    for mb, expected in zip(micro_batches, reference.logprobs_before):
        assert int(mb.cu_seqlens.diff().max()) > load_model_section("tiny").arch.index_topk
        got = backend.logprobs(mb)
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= LOGPROB_ATOL


@pytest.fixture(scope="module")
def tempered(section, micro_batches):
    """Micro-batches sampled at T = 0.7 and 1.3 and the torch reference step at those temperatures."""
    batches = at_temperatures(micro_batches, (0.7, 1.3))
    return batches, reference_step(section.arch, CFG, batches)


def test_logprobs_and_first_step_at_the_sampling_temperatures_match_the_torch_model(section, tempered, reference):
    batches, tempered_reference = tempered
    backend = new_backend(section)
    for mb, expected, at_one in zip(batches, tempered_reference.logprobs_before, reference.logprobs_before):
        assert (expected - at_one).abs().max() > 1e-2  # the temperatures change the log-probs
        assert (backend.logprobs(mb) - expected).abs().max() <= LOGPROB_ATOL
    result = backend.train_step(batches, normalizer_of(batches))
    assert result.loss == pytest.approx(tempered_reference.loss, abs=1e-6)
    assert result.grad_norm == pytest.approx(tempered_reference.grad_norm, rel=1e-5)


@pytest.fixture(scope="module")
def routed(section, micro_batches):
    """Micro-batches with replayed routing (other experts than the router's, a stretch of unknown rows)
    and the torch reference step replaying the same routing."""
    routed = with_replayed_routing(micro_batches, section.arch)
    return routed, reference_step(section.arch, CFG, routed)


def test_replayed_routing_logprobs_match_the_torch_model(backend, routed, reference):
    routed_batches, routed_reference = routed
    for mb, expected, free in zip(routed_batches, routed_reference.logprobs_before, reference.logprobs_before):
        assert (expected - free).abs().max() > 1e-2  # the replayed experts are not the router's
        assert (backend.logprobs(mb) - expected).abs().max() <= LOGPROB_ATOL


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed_activations"])
def test_first_step_with_replayed_routing_matches_the_torch_reference(section, routed, recompute):
    routed_batches, routed_reference = routed
    backend = new_backend(section, replace(CFG, grad_checkpointing=recompute))
    result = backend.train_step(routed_batches, normalizer_of(routed_batches))
    assert result.loss == pytest.approx(routed_reference.loss, abs=1e-6)
    assert result.grad_norm == pytest.approx(routed_reference.grad_norm, rel=1e-5)
    for mb, after in zip(routed_batches, routed_reference.logprobs_after):
        assert (backend.logprobs(mb) - after).abs().max() < 1e-4


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed_activations"])
def test_first_step_matches_the_torch_reference(section, micro_batches, reference, recompute):
    backend = new_backend(section, replace(CFG, grad_checkpointing=recompute))
    result = backend.train_step(micro_batches, normalizer_of(micro_batches))
    assert result.metrics["skipped_step"] == 0.0 and result.metrics["masked_fraction"] < 0.5
    assert result.loss == pytest.approx(reference.loss, abs=1e-6)
    assert result.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)
    assert result.num_tokens == sum(mb.num_tokens for mb in micro_batches)
    # one AdamW step at lr 1e-3 moves log-probs by ~0.05; both backends land on the same ones
    for mb, before, after in zip(micro_batches, reference.logprobs_before, reference.logprobs_after):
        assert (after - before).abs().max() > 1e-2
        assert (backend.logprobs(mb) - after).abs().max() < 1e-4


def test_frozen_indexer_gets_no_gradient_and_stays_bit_identical(backend, micro_batches):
    indexer_params = [p for name, p in backend.model.module.named_parameters() if ".indexer." in name]
    assert indexer_params and not any(p.requires_grad for p in indexer_params)
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in indexer_params}
    before = {name: t.clone() for name, t in backend.hf_state_dict().items()}  # fp32: views of live weights
    results = [backend.train_step(micro_batches, normalizer_of(micro_batches)) for _ in range(2)]
    after = backend.hf_state_dict()
    # every trained sample's forward log-probs come back (the off-policy health and trained records use them)
    assert results[0].samples.keys() == {sid for mb in micro_batches for sid in mb.sample_ids}
    assert all(len(t.logprobs) == len(t.entropy) and (t.logprobs <= 0).all() for t in results[0].samples.values())
    indexer = [name for name in before if ".indexer." in name]
    # 3 full-indexer decoder layers and the MTP layer x (wq_b, wk, k_norm.weight, k_norm.bias, weights_proj)
    assert len(indexer) == 20
    assert all(torch.equal(before[name], after[name]) for name in indexer)
    trained = "model.layers.0.self_attn.q_b_proj.weight"
    assert not torch.equal(before[trained], after[trained])
    assert torch.equal(before["model.layers.1.mlp.gate.e_score_correction_bias"],
                       after["model.layers.1.mlp.gate.e_score_correction_bias"])  # a checkpoint value, not trained


def test_checkpoint_restores_weights_and_optimizer(backend, micro_batches, tmp_path):
    normalizer = normalizer_of(micro_batches)
    backend.train_step(micro_batches, normalizer)
    backend.save_checkpoint(tmp_path / "ckpt")
    continued = backend.train_step(micro_batches, normalizer)
    logprobs = backend.logprobs(micro_batches[0])
    backend.load_checkpoint(tmp_path / "ckpt")
    replayed = backend.train_step(micro_batches, normalizer)
    assert (replayed.loss, replayed.grad_norm) == (continued.loss, continued.grad_norm)
    assert torch.equal(backend.logprobs(micro_batches[0]), logprobs)  # same Adam moments: same update


def test_non_finite_gradient_skips_the_update(backend, micro_batches):
    poisoned = replace(micro_batches[0], advantages=torch.full_like(micro_batches[0].advantages, float("nan")))
    before = backend.logprobs(micro_batches[1])
    result = backend.train_step([poisoned, micro_batches[1]], normalizer_of(micro_batches))
    assert result.metrics["skipped_step"] == 1.0 and result.grad_norm != result.grad_norm  # NaN
    assert torch.equal(backend.logprobs(micro_batches[1]), before)


def test_reset_optimizer_drops_the_moments(backend, micro_batches):
    backend.train_step(micro_batches, normalizer_of(micro_batches))
    assert any(len(state) for _, state in backend.optimizer.state.items())
    backend.reset_optimizer()
    assert not any(len(state) for _, state in backend.optimizer.state.items())


def fp32_masters(backend) -> list[torch.Tensor]:
    """Copies of the parameters the optimizer steps (its fp32 masters under bf16)."""
    optimizers = getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
    return [p.detach().clone() for o in optimizers for g in o.optimizer.param_groups for p in g["params"]]


def test_bf16_reset_optimizer_keeps_the_fp32_master_weights(section, micro_batches):
    """GLM-5 resets the optimizer after each push; under bf16 that must not round the masters to bf16."""
    backend = new_backend(replace(section, dtype="bfloat16"), replace(CFG, lr=1e-5))
    normalizer = normalizer_of(micro_batches)
    backend.train_step(micro_batches, normalizer)
    masters = fp32_masters(backend)
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # they hold more than bf16 can
    backend.reset_optimizer()
    assert not any(len(state) for _, state in backend.optimizer.state.items())
    kept = fp32_masters(backend)
    assert all(torch.equal(a, b) for a, b in zip(masters, kept))
    # updates below a bf16 step still add up across resets (rebuilt masters would drop each one)
    start = {k: v.clone() for k, v in backend.hf_state_dict().items()}
    for _ in range(6):
        backend.train_step(micro_batches, normalizer)
        backend.reset_optimizer()
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert not torch.equal(backend.hf_state_dict()[name], start[name])


def test_unfrozen_indexer_is_refused(section):
    with pytest.raises(ValueError, match="freeze_indexer"):
        new_backend(section, replace(CFG, freeze_indexer=False))


def test_bf16_backend_keeps_the_router_fp32_and_tracks_fp32_logprobs(section, micro_batches, reference):
    backend = new_backend(replace(section, dtype="bfloat16"))
    pushed = backend.hf_state_dict()
    assert pushed["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    assert pushed["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert (backend.logprobs(micro_batches[0]) - reference.logprobs_before[0]).abs().mean() < 0.05
    result = backend.train_step(micro_batches, normalizer_of(micro_batches))
    assert result.metrics["skipped_step"] == 0.0 and result.loss == pytest.approx(reference.loss, abs=0.02)
    assert backend.hf_state_dict()["model.layers.1.mlp.gate.weight"].dtype == torch.float32
