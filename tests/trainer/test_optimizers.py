"""trainer.optimizer=muon (trainer/optimizers.py): torch.optim.Muon on the hidden matrices, each routed expert a
matrix of its own, AdamW on the rest; its state survives a checkpoint; it trains; the megatron backend refuses
it by name."""

import os
import subprocess
import sys

import pytest
import torch

from asyncrl.config import TrainerConfig
from asyncrl.model.model import Glm5ForCausalLM
from tests.trainer.test_torch_backend import assert_same, backend, step_inputs, weights
from tests.services import ROOT
from tests.trainer.conftest import SUBPROCESS_ENV
from tests.trainer.helpers import policy_groups
from trainer.optimizers import MuonWithAdamW, build_optimizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def groups(tiny_section):
    return policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), num_groups=4)


def test_each_expert_gets_the_update_torch_muon_gives_its_matrix_and_the_rest_adamw(tiny_section):
    model = Glm5ForCausalLM.from_config(tiny_section.arch, seed=0)
    model.freeze_indexer()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = dict(named)
    torch.manual_seed(0)
    for p in params.values():
        p.grad = torch.randn_like(p)
    experts = next(n for n, p in named if p.dim() == 3)
    expert_before, expert_grad = params[experts][3].detach().clone(), params[experts].grad[3].clone()
    embed = "model.embed_tokens.weight"
    embed_before, embed_grad = params[embed].detach().clone(), params[embed].grad.clone()
    optimizer = build_optimizer("muon", named, lr=1e-2, weight_decay=0.1)
    assert isinstance(optimizer, MuonWithAdamW)
    optimizer.step()

    alone = expert_before.clone().requires_grad_()  # expert 3 as a parameter of its own under torch's Muon
    alone.grad = expert_grad
    torch.optim.Muon([alone], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw").step()
    torch.testing.assert_close(params[experts][3].detach(), alone.detach(), rtol=0, atol=1e-6)
    table = embed_before.clone().requires_grad_()
    table.grad = embed_grad
    torch.optim.AdamW([table], lr=1e-2, weight_decay=0.1).step()
    torch.testing.assert_close(params[embed].detach(), table.detach(), rtol=0, atol=1e-7)

    optimizer.zero_grad()
    assert all(p.grad is None for p in params.values())  # the 3-D weights too: in no optimizer themselves


def test_muon_state_survives_a_checkpoint_and_the_run_trains(tiny_section, groups, tmp_path):
    mbs, norm = step_inputs(groups, 64)
    a = backend(tiny_section, optimizer="muon")
    a.train_step(mbs, norm)
    a.save_checkpoint(tmp_path / "ckpt")
    a.train_step(mbs, norm)
    resumed = backend(tiny_section, optimizer="muon")
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.train_step(mbs, norm)
    assert_same(weights(a), weights(resumed))  # bit-identical: momentum buffers and Adam moments came back
    before = advantage_weighted_logprob(backend(tiny_section, optimizer="muon"), mbs)
    for _ in range(4):
        a.train_step(mbs, norm)
    assert advantage_weighted_logprob(a, mbs) > before + 0.5  # likelier where the advantage is positive
    backend(tiny_section, optimizer="adamw").save_checkpoint(tmp_path / "adam")
    with pytest.raises(ValueError, match="not a Muon \\+ AdamW checkpoint"):
        backend(tiny_section, optimizer="muon").load_checkpoint(tmp_path / "adam")


def advantage_weighted_logprob(b, mbs) -> float:
    """Sum over generated tokens of advantage x log-prob: what the policy gradient raises."""
    return sum(float((b.logprobs(mb) * mb.advantages * mb.loss_mask).sum()) for mb in mbs)


def test_an_unknown_optimizer_and_muon_on_megatron_are_refused_by_name():
    with pytest.raises(ValueError, match="trainer.optimizer 'sgd': one of adamw, muon"):
        TrainerConfig(optimizer="sgd")
    # in a process of its own: this one must not import the megatron backend (test_registry_imports_only_...)
    refusal = subprocess.run([sys.executable, "-c", MEGATRON_MUON], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, **SUBPROCESS_ENV}, timeout=120)
    assert "megatron backend: trainer.optimizer=muon is not supported" in refusal.stderr, refusal.stderr[-2000:]


MEGATRON_MUON = """
from asyncrl.config import TrainerConfig, load_model_section
from trainer.backends.megatron.backend import MegatronBackend
MegatronBackend(TrainerConfig(backend="megatron", optimizer="muon"), load_model_section("tiny"))
"""
