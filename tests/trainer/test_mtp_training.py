"""Online MTP training (trainer/mtp_loss.py): the MTP loss trains the MTP layer only, so the policy update is
bit-identical with and without it; the layer learns; the warm-up trains it the same way; weight pushes
carry it; backends that cannot train it refuse the setting."""

import dataclasses
import random
import subprocess
import sys

import pytest
import torch

from asyncrl.config import ModelSection, TrainerConfig
from asyncrl.model.model import Glm5ForCausalLM
from tests.services import ROOT
from tests.trainer.test_torch_backend import backend, step_inputs, weights
from tests.trainer.helpers import policy_groups
from trainer import sft
from trainer.backends.base import make_backend
from asyncrl.model.model import mtp_targets
from trainer.mtp_loss import fit_mtp_layer, mtp_loss_mask, mtp_loss_terms

pytestmark = pytest.mark.timeout(180)
MTP = "model.layers.4."
"""The tiny model's MTP layer (num_hidden_layers 4), by its checkpoint name."""


@pytest.fixture(scope="module")
def groups(tiny_section):
    return policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), num_groups=4, gen_len=12)


def _split(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A state dict (checkpoint names) -> (policy tensors, MTP tensors)."""
    return {n: t for n, t in state.items() if not n.startswith(MTP)}, {n: t for n, t in state.items() if n.startswith(MTP)}


def test_the_mtp_loss_counts_the_drafts_of_generated_tokens():
    """Position t counts when target t + 1 (x_{t+2}) is a loss token of the same sequence."""
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    cu_seqlens = torch.tensor([0, 4, 8])
    assert mtp_loss_mask(loss_mask, cu_seqlens).tolist() == [True, True, True, False, False, True, True, False]


def test_online_mtp_training_leaves_the_policy_update_identical(tiny_section, groups):
    """Same seed, same batches: with mtp_loss_coef the policy weights after 3 steps are bit-identical
    to a run without it (grad_clip binds: each layer is clipped on its own), and only MTP weights differ."""
    mbs, normalizer = step_inputs(groups, 256)
    plain, online = backend(tiny_section, grad_clip=0.05), backend(tiny_section, grad_clip=0.05, mtp_loss_coef=0.5)
    start = weights(online)
    for _ in range(3):
        without, with_mtp = plain.train_step(mbs, normalizer), online.train_step(mbs, normalizer)
        assert with_mtp.loss == without.loss and with_mtp.grad_norm == without.grad_norm
        assert without.grad_norm > 0.05 and with_mtp.metrics["mtp_grad_norm"] > 0.05  # clipping binds both
    policy_plain, mtp_plain = _split(weights(plain))
    policy_online, mtp_online = _split(weights(online))
    assert all(torch.equal(t, policy_online[n]) for n, t in policy_plain.items())
    assert all(torch.equal(t, start[n]) for n, t in mtp_plain.items())  # no MTP loss: the layer stays as loaded
    changed = [n for n, t in mtp_online.items() if not torch.equal(t, start[n])]
    assert any("eh_proj" in n for n in changed) and any("self_attn" in n for n in changed)
    assert not any("indexer" in n for n in changed)  # the MTP block's indexer stays frozen with the others
    assert "mtp_loss" not in without.metrics and {"mtp_loss", "mtp_accuracy"} <= with_mtp.metrics.keys()


def test_the_mtp_layer_learns_the_rollouts(tiny_section, groups):
    mbs, normalizer = step_inputs(groups, 256)
    online = backend(tiny_section, mtp_loss_coef=1.0)
    losses = [online.train_step(mbs, normalizer).metrics["mtp_loss"] for _ in range(8)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
    counted = sum(int(mtp_loss_mask(mb.loss_mask, mb.cu_seqlens).sum()) for mb in mbs)
    assert counted > 0


def test_weight_pushes_carry_the_trained_mtp_layer(tiny_section, groups):
    mbs, normalizer = step_inputs(groups, 256)
    online = backend(tiny_section, mtp_loss_coef=0.5)
    before = {n: t.clone() for n, t in online.hf_state_dict().items() if n.startswith(MTP)}
    online.train_step(mbs, normalizer)
    after = online.hf_state_dict()
    assert before and all(n in after for n in before)
    assert not torch.equal(after[MTP + "eh_proj.weight"], before[MTP + "eh_proj.weight"])


def test_settings_that_cannot_train_an_mtp_layer_are_refused(tiny_section):
    no_mtp = ModelSection(arch=dataclasses.replace(tiny_section.arch, num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="mtp_loss_coef"):
        make_backend(TrainerConfig(mtp_loss_coef=0.1), no_mtp)
    megatron = ("from asyncrl.config import TrainerConfig, load_model_section\n"  # a process of its own: the
                "from trainer.backends.base import make_backend\n"  # registry test checks what is imported
                "make_backend(TrainerConfig(backend='megatron', mtp_loss_coef=0.1), load_model_section('tiny'))")
    refused = subprocess.run([sys.executable, "-c", megatron], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "ValueError: megatron backend: trainer.mtp_loss_coef" in refused.stderr, \
        refused.stderr[-2000:]  # refused before megatron-core is imported: also where it is not installed


def test_the_warm_up_trains_the_mtp_layer_and_leaves_the_policy_step_unchanged(tiny_section):
    """sft._step with and without the MTP loss, from the same weights and optimizer state."""
    rng = random.Random(0)
    batch = [([rng.randrange(1000) for _ in range(24)], [0] * 8 + [1] * 16) for _ in range(4)]
    nets = [Glm5ForCausalLM.from_config(tiny_section.arch, seed=0) for _ in range(2)]
    start = {n: t.clone() for n, t in nets[0].state_dict().items()}
    results = []
    for net, coef in zip(nets, (0.0, 1.0)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        results.append(sft._step(net, optimizer, batch, coef))
    (loss_plain, none), (loss_mtp, mtp) = results
    assert loss_plain == loss_mtp and none is None and mtp.count == 4 * 16  # each x_{t+2} of the 16 reply tokens
    policy_plain, mtp_plain = _split(nets[0].state_dict())
    policy_mtp, mtp_trained = _split(nets[1].state_dict())
    assert all(torch.equal(t, policy_mtp[n]) for n, t in policy_plain.items())
    assert all(torch.equal(t, start[n]) for n, t in mtp_plain.items())
    assert not torch.equal(mtp_trained[MTP + "eh_proj.weight"], start[MTP + "eh_proj.weight"])


def test_each_mtp_depth_reads_the_previous_depths_output_at_the_position_before(tiny_section):
    """Depth d of the loss is the input speculative decoding gives draft d (drafting.py): position t reads
    depth d - 1's output at t - 1 (a sequence's first position: h) and predicts x_{t+2}; the loss is the
    per-position mean over the depths at which the position counts; `correct` is depth 1's."""
    torch.manual_seed(0)
    net = Glm5ForCausalLM.from_config(tiny_section.arch, seed=0)
    cu_seqlens = torch.tensor([0, 7, 12])
    ids, targets = torch.randint(0, 1000, (12,)), torch.randint(0, 1000, (12,))
    loss_mask = torch.ones(12, dtype=torch.bool)
    hidden = net.token_logprobs(ids, cu_seqlens, targets, with_entropy=False).hidden.detach()
    goal = torch.cat([targets[1:7], targets[6:7], targets[8:12], targets[11:12]])  # x_{t+2}; last: stand-in
    counted = mtp_loss_mask(loss_mask, cu_seqlens)
    first = net.mtp_logprobs(hidden, targets, cu_seqlens, goal)
    shifted = hidden.clone()
    for start, end in ((0, 7), (7, 12)):
        shifted[start + 1:end] = first.hidden[start:end - 1]
    second = net.mtp_logprobs(shifted, targets, cu_seqlens, goal)
    offset = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4])
    both = counted & (offset >= 1)
    expected = (-(first.logprobs * counted) - second.logprobs * both) / (counted.float() + both.float()).clamp_min(1)
    one, two = (mtp_loss_terms(net, hidden, targets, cu_seqlens, loss_mask, depths=d) for d in (1, 2))
    assert torch.allclose(one.loss_sum, -(first.logprobs * counted).sum(), atol=1e-5)
    assert torch.allclose(two.loss_sum, expected.sum(), atol=1e-5)
    assert one.count == two.count == int(counted.sum()) and torch.equal(one.correct, two.correct)
    with pytest.raises(ValueError, match="trainer.mtp_depths"):
        make_backend(TrainerConfig(mtp_loss_coef=0.1, mtp_depths=0), tiny_section)


def test_training_more_depths_makes_second_drafts_right(tiny_section):
    """The layer fitted at depths 1..3 drafts its second token (fed its own first output) right far more
    often than one fitted at depth 1 only, on the same text (bench/results/speculative.md: accept length
    with 2 drafts 2.34 -> 2.89)."""
    from asyncrl.model.generate import greedy_generate

    accuracy = {}
    for depths in (1, 3):
        net = Glm5ForCausalLM.from_config(tiny_section.arch, seed=0)
        prompts = [[1006] + [random.Random(i).randrange(1000) for _ in range(8)] for i in range(16)]
        seqs = [p + o for p, o in zip(prompts, greedy_generate(net, prompts, 24))]
        fit_mtp_layer(net, seqs, steps=60, depths=depths)
        ids = torch.tensor([t for s in seqs for t in s[:-1]])
        targets = torch.tensor([t for s in seqs for t in s[1:]])
        cu_seqlens = torch.arange(len(seqs) + 1) * (len(seqs[0]) - 1)
        with torch.no_grad():
            hidden = net.token_logprobs(ids, cu_seqlens, targets, with_entropy=False).hidden
            goal, valid = mtp_targets(targets, cu_seqlens)
            first = net.mtp_logprobs(hidden, targets, cu_seqlens, goal)
            shifted = torch.where((torch.arange(len(ids)) % (len(seqs[0]) - 1) == 0)[:, None], hidden,
                                  first.hidden.roll(1, 0))
            second = net.mtp_logprobs(shifted, targets, cu_seqlens, goal)
        accuracy[depths] = float(((second.predicted == goal) & valid).sum() / valid.sum())
    assert 1 - accuracy[3] < (1 - accuracy[1]) / 2, accuracy  # measured: 0.95 against 0.80


def test_the_warm_up_distills_the_mtp_layer_on_the_policys_own_replies(tiny_section, tmp_path):
    """warmup.mtp_distill_samples: after the supervised steps the MTP layer alone is fitted to replies the
    policy sampled; the policy's weights are those of a warm-up without it."""
    from asyncrl.config import WarmupConfig
    from asyncrl.model.io import load_pretrained

    base = WarmupConfig(steps=3, batch_size=4)
    paths = [sft.warmup(tiny_section, dataclasses.replace(base, **extra), str(tmp_path / name))
             for name, extra in (("plain", {}), ("distilled", {"mtp_distill_samples": 8, "mtp_distill_steps": 5}))]
    (policy_plain, mtp_plain), (policy_distilled, mtp_distilled) = (
        _split(load_pretrained(p).state_dict()) for p in paths)
    assert all(torch.equal(t, policy_distilled[n]) for n, t in policy_plain.items())
    assert not torch.equal(mtp_plain[MTP + "eh_proj.weight"], mtp_distilled[MTP + "eh_proj.weight"])
    with pytest.raises(ValueError, match="warmup.mtp_distill_samples"):
        no_mtp = ModelSection(arch=dataclasses.replace(tiny_section.arch, num_nextn_predict_layers=0))
        sft.warmup(no_mtp, dataclasses.replace(base, mtp_distill_samples=8), str(tmp_path / "refused"))
