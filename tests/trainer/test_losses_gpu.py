"""The objectives on a CUDA device: same values and gradients as on CPU, and no host sync in the step."""

import pytest
import torch

from tests.trainer.helpers import make_sample
from trainer.advantages import ScoredSample
from trainer.losses import direct_double_sided_is_loss, icepop_ppo_loss
from trainer.packing import pack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def packed_case(seed: int = 0):
    items = [ScoredSample(make_sample(f"s{i}", prompt_len=5 + i, gen_len=3 + 2 * i, seed=seed + i), float(i) - 2.5)
             for i in range(6)]
    (mb,) = pack(items, micro_batch_tokens=256)
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(mb.num_tokens, generator=g) * 2
    old = logprobs + torch.randn(mb.num_tokens, generator=g) * 0.1
    rollout = old + torch.randn(mb.num_tokens, generator=g) * 0.5
    return mb, logprobs, old, rollout


def run_loss(name, case, how, device):
    mb, logprobs, old, rollout = case
    mb, old, rollout = mb.to(device), old.to(device), rollout.to(device)
    lp = logprobs.to(device).requires_grad_()
    normalizer = mb.num_loss_tokens if how == "token" else mb.num_loss_sequences
    common = dict(aggregation=how, cu_seqlens=mb.cu_seqlens, normalizer=normalizer)
    torch.cuda.set_sync_debug_mode("error" if device == "cuda" else "default")
    try:
        if name == "is":
            loss, metrics = direct_double_sided_is_loss(lp, rollout, mb.advantages, mb.loss_mask, 0.2, 0.28, **common)
        else:
            loss, metrics = icepop_ppo_loss(lp, old, rollout, mb.advantages, mb.loss_mask, **common)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return loss.item(), lp.grad.cpu(), metrics.summary()


@pytest.mark.parametrize("how", ["token", "sequence"])
@pytest.mark.parametrize("name", ["is", "icepop"])
def test_cuda_matches_cpu_without_host_sync(name, how):
    case = packed_case()
    cpu = run_loss(name, case, how, "cpu")
    gpu = run_loss(name, case, how, "cuda")  # sync debug mode "error": a host sync raises
    assert 0 < cpu[2]["masked_fraction"] < 1  # kept and masked tokens both present
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-5, atol=1e-7)
    assert gpu[2] == pytest.approx(cpu[2], rel=1e-5, abs=1e-7)


def test_bf16_logprobs_on_cuda_stay_close_to_fp32():
    mb, logprobs, old, rollout = packed_case(seed=1)
    mb = mb.to("cuda")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        lp = logprobs.to("cuda", dtype).requires_grad_()
        loss, _ = icepop_ppo_loss(lp, old.cuda(), rollout.cuda(), mb.advantages, mb.loss_mask,
                                  cu_seqlens=mb.cu_seqlens, aggregation="sequence")
        loss.backward()
        assert torch.isfinite(lp.grad).all()
        results.append((loss.item(), lp.grad.float().cpu()))
    assert results[1][0] == pytest.approx(results[0][0], rel=2e-2, abs=1e-3)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=2e-2, atol=1e-3)
