import numpy as np
import torch

from rollout.sampler import SamplingBatch, sample, splitmix64_uniform


def batch(n, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seeds=None, counters=None):
    return SamplingBatch(
        temperature=torch.full((n,), temperature), top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.int64), min_p=torch.full((n,), min_p),
        seeds=np.arange(n, dtype=np.uint64) if seeds is None else np.asarray(seeds, np.uint64),
        counters=np.zeros(n, np.uint64) if counters is None else np.asarray(counters, np.uint64))


def test_uniforms_are_a_pure_function_of_seed_and_counter():
    u = splitmix64_uniform(np.array([1, 2, 1], np.uint64), np.array([5, 5, 5], np.uint64))
    assert u[0] == u[2] and u[0] != u[1] and ((u >= 0) & (u < 1)).all()
    many = splitmix64_uniform(np.full(20000, 7, np.uint64), np.arange(20000, dtype=np.uint64))
    assert abs(many.mean() - 0.5) < 0.01


def test_greedy_is_argmax_and_reports_temperature_one_logprob():
    logits = torch.randn(4, 50)
    out = sample(logits, batch(4, temperature=0.0))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected)


def test_row_result_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    seeds = np.arange(100, 108, dtype=np.uint64)
    full = sample(logits, batch(8, seeds=seeds, top_p=0.9, top_k=50))
    for i in range(8):
        alone = sample(logits[i:i + 1], batch(1, seeds=seeds[i:i + 1], top_p=0.9, top_k=50))
        assert alone.token_ids.item() == full.token_ids[i].item()
        assert alone.logprobs.item() == full.logprobs[i].item()


def test_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-30).log().expand(20000, 4).contiguous()
    out = sample(logits, batch(20000, seeds=np.arange(20000)))
    freq = torch.bincount(out.token_ids, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(4000, 5).contiguous()
    drawn = lambda **kw: set(sample(logits, batch(4000, seeds=np.arange(4000), **kw)).token_ids.tolist())
    assert drawn(top_k=2) == {0, 1}
    p = torch.softmax(logits[0], -1)
    assert drawn(top_p=float(p[0] + 0.01)) == {0, 1}  # mass before token 1 is p0 < top_p
    assert drawn(min_p=float(p[2] / p[0]) - 1e-4) == {0, 1, 2}
    assert drawn(top_k=1) == {0}


def test_temperature_scales_reported_logprob():
    logits = torch.randn(3, 20)
    out = sample(logits, batch(3, temperature=0.5))
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected)
