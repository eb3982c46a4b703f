"""rollout/speculative.py: the acceptance rule emits tokens distributed exactly as the target samples them
(chi-square over 40k seeded draws, at temperature 1 and under top-k / top-p / min-p), temperature 0 is
greedy decoding, bans hold, and a request's tokens depend only on its own seed and counters."""

import math

import numpy as np
import pytest
import torch

from rollout.sampler import SamplingBatch, sample
from rollout.speculative import distribution, draft, verify

V = 6
DRAWS = 40_000


def batch(rows: int, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seeds=None, counter=0) -> SamplingBatch:
    return SamplingBatch(temperature=torch.full((rows,), temperature), top_p=torch.full((rows,), top_p),
                         top_k=torch.full((rows,), top_k, dtype=torch.long), min_p=torch.full((rows,), min_p),
                         seeds=np.arange(rows, dtype=np.uint64) if seeds is None else seeds,
                         counters=np.full(rows, counter, dtype=np.uint64))


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile at standard-normal quantile z (3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the outcomes of positive probability (none may occur outside them)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


LOGITS = {"target_1": [2.0, 1.0, 0.5, 0.0, -1.0, 1.5], "target_2": [0.0, 2.5, 0.0, 1.0, -0.5, 0.3],
          "draft_1": [0.0, 2.0, 1.0, 1.0, 0.0, -1.0], "draft_2": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}
"""Drafts deliberately unlike the target (the draft favours token 1 where the target favours 0)."""


def _run(settings: dict) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """DRAWS seeded requests, 2 drafts each -> (accepted, tokens, p_1, p_2)."""
    b = batch(DRAWS, **settings)
    logits = {name: torch.tensor(v).expand(DRAWS, V) for name, v in LOGITS.items()}
    d1, q1 = draft(logits["draft_1"], b)
    d2, q2 = draft(logits["draft_2"], batch(DRAWS, **settings, counter=1))
    verdict = verify(torch.stack([logits["target_1"], logits["target_2"], logits["target_1"]], 1),
                     torch.stack([d1, d2], 1), torch.stack([q1, q2], 1), b)
    p1 = distribution(logits["target_1"][:1], batch(1, **settings))[0].double().numpy()
    p2 = distribution(logits["target_2"][:1], batch(1, **settings))[0].double().numpy()
    return verdict.accepted, verdict.tokens, p1, p2


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.2}],
                         ids=["t1", "t0.7", "top_k", "top_p", "min_p"])
def test_emitted_tokens_follow_the_target_distribution(settings):
    accepted, tokens, p1, p2 = _run(settings)
    first = np.bincount(tokens[:, 0].numpy(), minlength=V)
    stat, df = chi2(first, p1)
    assert stat < chi2_critical(df), (stat, first / DRAWS, p1)
    reached = accepted >= 1  # the second token is emitted when the first draft was accepted
    second = np.bincount(tokens[reached, 1].numpy(), minlength=V)
    stat, df = chi2(second, p2)
    assert stat < chi2_critical(df), (stat, second / second.sum(), p2)
    assert 0.1 < reached.float().mean() < 0.9  # drafts are both accepted and rejected: both paths tested


def test_the_test_fails_a_wrong_acceptance_rule():
    """Its power: correcting from p instead of max(0, p - q) (a common mistake) shifts the first token's
    distribution far past what 40k draws detect."""
    b = batch(1)
    p = distribution(torch.tensor([LOGITS["target_1"]]), b)[0].double().numpy()
    q = distribution(torch.tensor([LOGITS["draft_1"]]), b)[0].double().numpy()
    wrong = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p
    expected_stat = DRAWS * (((wrong - p) ** 2) / p).sum()
    assert expected_stat > 10 * chi2_critical(V - 1)


def test_temperature_zero_is_greedy_decoding():
    rows = 64
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(rows, 3, 50, generator=generator)
    greedy = target.argmax(-1)
    drafts = greedy[:, :2].clone()
    wrong = torch.arange(rows) % 3  # rows 0 mod 3: first draft wrong; 1 mod 3: second wrong; else both right
    drafts[wrong == 0, 0] = (greedy[wrong == 0, 0] + 1) % 50
    drafts[wrong == 1, 1] = (greedy[wrong == 1, 1] + 1) % 50
    q = torch.nn.functional.one_hot(drafts, 50).float()
    verdict = verify(target, drafts, q, batch(rows, temperature=0.0))
    assert verdict.accepted.tolist() == [{0: 0, 1: 1, 2: 2}[int(w)] for w in wrong]
    for row in range(rows):
        n = int(verdict.accepted[row]) + 1
        assert verdict.tokens[row, :n].tolist() == greedy[row, :n].tolist()
        expected = sample(target[row, :n], batch(n, temperature=0.0)).token_ids  # what decoding alone emits
        assert verdict.tokens[row, :n].tolist() == expected.tolist()


def test_banned_tokens_are_never_emitted():
    """Stop tokens before min_new_tokens: banned at a position for the target and the draft alike."""
    b = batch(4000)
    banned = torch.zeros(4000, 2, V, dtype=torch.bool)
    banned[:, 0, 0] = True  # token 0, the target's favourite, may not come first
    logits = torch.tensor(LOGITS["target_1"]).expand(4000, V)
    d, q = draft(torch.tensor(LOGITS["draft_2"]).expand(4000, V), b, banned[:, 0])
    verdict = verify(torch.stack([logits, logits], 1), d[:, None], q[:, None], b, banned)
    assert not (verdict.tokens[:, 0] == 0).any() and (verdict.tokens[verdict.accepted == 1, 1] == 0).any()


def test_a_request_draws_the_same_tokens_in_any_batch():
    seeds = np.array([11, 12, 13, 14], dtype=np.uint64)
    generator = torch.Generator().manual_seed(1)
    target, draft_logits = torch.randn(4, 3, V, generator=generator), torch.randn(4, 2, V, generator=generator)
    full = batch(4, seeds=seeds, counter=7)
    drafts = [draft(draft_logits[:, i], batch(4, seeds=seeds, counter=7 + i)) for i in range(2)]
    verdict = verify(target, torch.stack([d for d, _ in drafts], 1), torch.stack([q for _, q in drafts], 1), full)
    alone = verify(target[2:3], torch.stack([d[2:3] for d, _ in drafts], 1),
                   torch.stack([q[2:3] for _, q in drafts], 1), batch(1, seeds=seeds[2:3], counter=7))
    assert verdict.tokens[2].tolist() == alone.tokens[0].tolist() and verdict.accepted[2] == alone.accepted[0]
    again = verify(target, torch.stack([d for d, _ in drafts], 1), torch.stack([q for _, q in drafts], 1), full)
    assert torch.equal(again.tokens, verdict.tokens)



def test_reported_logprobs_are_the_targets():
    generator = torch.Generator().manual_seed(2)
    target = torch.randn(8, 3, V, generator=generator)
    d, q = draft(torch.randn(8, V, generator=generator), batch(8, temperature=0.8))
    drafts = torch.stack([d, d], 1)
    verdict = verify(target, drafts, torch.stack([q, q], 1), batch(8, temperature=0.8))
    expected = (target / 0.8).log_softmax(-1).gather(-1, verdict.tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(verdict.logprobs, expected)
