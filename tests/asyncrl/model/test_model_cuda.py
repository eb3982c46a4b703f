"""The same model on a CUDA device: parity with the CPU run and with transformers there, cached decode,
batch invariance, greedy generation, and a bf16 training step with a frozen indexer. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.generate import greedy_generate
from asyncrl.model.io import save_pretrained
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.model import Glm5ForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would dominate a 1e-5 comparison
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _tokens(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


def test_cuda_logits_equal_cpu_and_transformers(parity_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_pretrained(parity_model, tmp_path)
    reference = transformers.GlmMoeDsaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                                  dtype=torch.float32).to(CUDA).eval()
    ids = _tokens((3, 120), seed=0)
    with torch.no_grad():
        cpu = parity_model(ids)
        gpu_model = parity_model.to(CUDA)
        gpu = gpu_model(ids.to(CUDA))
        assert (gpu.cpu() - cpu).abs().max() <= 1e-5
        assert (gpu - reference(ids.to(CUDA)).logits).abs().max() <= 1e-5
        assert (gpu_model(ids.to(CUDA), attention_impl="dense") - gpu).abs().max() <= 1e-5


def test_cuda_cached_ragged_decode_equals_full_forward_and_is_batch_invariant(parity_model, parity_config):
    model = parity_model.to(CUDA)
    seqs = [_tokens((n,), seed=n).to(CUDA) for n in (90, 41, 7, 130)]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        cache = KVCache(parity_config, 512, device=CUDA)
        slots = torch.randperm(512, generator=torch.Generator().manual_seed(1)).to(CUDA)
        starts = torch.tensor([0, 90, 131, 138, 268])
        rows = [slots[a:b] for a, b in zip(starts[:-1], starts[1:])]
        done, diff = [5] * 4, 0.0
        model.forward_batch(ForwardBatch(torch.cat([s[:5] for s in seqs]), torch.full((4,), 5, device=CUDA),
                                         torch.stack([r[:5] for r in rows]), torch.full((4,), 5, device=CUDA)), cache)
        while any(d < len(s) for d, s in zip(done, seqs)):
            live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            width = max(done[i] + 1 for i in live)
            context = torch.stack([torch.nn.functional.pad(rows[i][: done[i] + 1], (0, width - done[i] - 1))
                                   for i in live])
            lens = torch.tensor([done[i] + 1 for i in live], device=CUDA)
            logits = model.forward_batch(ForwardBatch(torch.stack([seqs[i][done[i]] for i in live]),
                                                      torch.ones_like(lens), context, lens), cache)
            for row, i in enumerate(live):
                diff = max(diff, (logits[row] - full[i][done[i]]).abs().max().item())
                done[i] += 1
        assert diff <= 1e-5
        cu = torch.tensor([0, 90, 131, 138, 268], device=CUDA)
        packed = model.token_logprobs(torch.cat(seqs), cu, torch.cat(seqs))
        alone = model.token_logprobs(seqs[1], torch.tensor([0, 41], device=CUDA), seqs[1])
        assert (packed.logprobs[90:131] - alone.logprobs).abs().max() <= 1e-5


def test_cuda_greedy_generation_matches_cpu(parity_model):
    prompts = [_tokens((n,), seed=n).tolist() for n in (12, 30)]
    cpu = greedy_generate(parity_model, prompts, max_new_tokens=40)
    assert greedy_generate(parity_model.to(CUDA), prompts, max_new_tokens=40) == cpu


def test_cuda_bf16_training_step_keeps_the_frozen_indexer(parity_config):
    model = Glm5ForCausalLM.from_config(parity_config, seed=3, dtype=torch.bfloat16).to(CUDA)
    model.freeze_indexer()
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    frozen = [p.detach().clone() for p in model.indexer_parameters()]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = _tokens((200,), seed=5).to(CUDA)
    cu = torch.tensor([0, 120, 200], device=CUDA)
    losses = []
    for _ in range(3):
        out = model.token_logprobs(ids, cu, ids.roll(-1))
        loss = -out.logprobs.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert torch.isfinite(torch.tensor(losses)).all() and losses[-1] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.indexer_parameters()))
