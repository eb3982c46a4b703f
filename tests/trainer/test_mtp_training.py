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
from trainer.mtp_loss import mtp_loss_mask

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
