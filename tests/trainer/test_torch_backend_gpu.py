"""The torch backend on a CUDA device: the same step as on CPU, bf16 autocast, weights leave the GPU
for a snapshot. (Data parallelism over NCCL needs two GPUs: not covered here.)"""

import pytest
import torch

from asyncrl.config import TrainerConfig
from asyncrl.model.io import read_tensors, save_tensors
from asyncrl.model.model import Glm5ForCausalLM
from tests.trainer.helpers import policy_groups
from tests.trainer.test_torch_backend import grads, step_inputs
from trainer.backends.base import make_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def inputs(tiny_section):
    groups = policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), num_groups=3, gen_len=80)
    return step_inputs(groups, 128)


def test_cuda_step_matches_cpu(tiny_section, inputs):
    cpu = make_backend(TrainerConfig(lr=1e-3), tiny_section)
    gpu = make_backend(TrainerConfig(lr=1e-3, device="cuda"), tiny_section)
    assert gpu.model.lm_head.weight.is_cuda
    r_cpu, r_gpu = cpu.train_step(*inputs), gpu.train_step(*inputs)
    assert r_gpu.loss == pytest.approx(r_cpu.loss, rel=1e-4) and r_gpu.metrics["masked_fraction"] == 0
    assert r_gpu.grad_norm == pytest.approx(r_cpu.grad_norm, rel=1e-4)
    theirs = grads(cpu)
    for name, g in grads(gpu).items():
        torch.testing.assert_close(g.cpu(), theirs[name], rtol=1e-3, atol=1e-5, msg=name)


def test_bf16_autocast_on_cuda_and_snapshot_from_gpu(tiny_section, inputs, tmp_path):
    from dataclasses import replace

    fp32 = make_backend(TrainerConfig(lr=1e-3, device="cuda"), tiny_section).train_step(*inputs)
    bf16 = make_backend(TrainerConfig(lr=1e-3, device="cuda"), replace(tiny_section, dtype="bfloat16"))
    result = bf16.train_step(*inputs)
    assert result.loss == pytest.approx(fp32.loss, rel=0.05) and result.metrics["masked_fraction"] < 0.1
    tensors = bf16.hf_state_dict()
    assert tensors["lm_head.weight"].is_cuda and tensors["lm_head.weight"].dtype == torch.bfloat16
    save_tensors(tensors, bf16.hf_config(), tmp_path, torch.bfloat16)
    back = read_tensors(tmp_path)
    assert all(torch.equal(back[k], t.cpu()) for k, t in tensors.items())
