"""The indexer's top-k: lower position wins ties, independent of row length, padding, chunking and batch."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.indexer import Indexer, topk_lower_position_wins


def _reference_topk(scores_row: torch.Tensor, query_pos: int, k: int) -> list[int]:
    """Stable descending sort of the causal keys: equal scores keep position order."""
    causal = scores_row[: query_pos + 1]
    return sorted(causal.sort(descending=True, stable=True).indices[:k].tolist())


def _topk_sets(scores: torch.Tensor, query_pos: torch.Tensor, k: int) -> torch.Tensor:
    """The selected positions in ascending order (the selection is a set; its order is unspecified)."""
    return topk_lower_position_wins(scores, query_pos, k).sort(dim=-1).values


def test_ties_go_to_the_lower_position():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert _topk_sets(scores, torch.tensor([4]), 2).tolist() == [[1, 2]]
    signed_zeros = torch.tensor([[-0.0, 0.0, -0.0, 0.0]])  # -0.0 == +0.0 is a tie too
    assert _topk_sets(signed_zeros, torch.tensor([3]), 3).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_selection_matches_stable_sort_and_ignores_padding(seed):
    generator = torch.Generator().manual_seed(seed)
    width, k = 57, 8
    scores = torch.randint(-2, 3, (12, width), generator=generator).float()  # five values: ties everywhere
    query_pos = torch.randint(k, width, (12,), generator=generator)
    picked = _topk_sets(scores, query_pos, k)
    padded = torch.cat([scores, torch.randn(12, 40, generator=generator) * 100], dim=1)  # longer rows, junk keys
    assert torch.equal(_topk_sets(padded, query_pos, k), picked)
    for row in range(12):
        assert picked[row].tolist() == _reference_topk(scores[row], int(query_pos[row]), k)
        truncated = scores[row : row + 1, : int(query_pos[row]) + 1]  # the decode view: row ends at the query
        assert _topk_sets(truncated, query_pos[row : row + 1], k).tolist() == [picked[row].tolist()]


def test_indexer_selection_is_the_same_chunked_batched_or_alone(parity_config):
    torch.manual_seed(0)
    indexer = Indexer(parity_config)
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    lens = [40, 23, 61]
    keys = torch.randn(sum(lens), parity_config.index_head_dim)
    q = torch.randn(sum(lens), parity_config.index_n_heads, parity_config.index_head_dim)
    weights = torch.randn(sum(lens), parity_config.index_n_heads)
    cu = torch.tensor([0, 40, 63, 124])
    together = indexer.select(q, weights, keys, ForwardBatch.packed(torch.zeros(124), cu))
    chunked = indexer.select(q, weights, keys, ForwardBatch.packed(torch.zeros(124), cu, max_score_elements=1))
    assert torch.equal(together.index.sort(-1).values, chunked.index.sort(-1).values)
    alone = indexer.select(q[63:], weights[63:], keys[63:], ForwardBatch.packed(torch.zeros(61), torch.tensor([0, 61])))
    assert torch.equal(together.index[2, :61].sort(-1).values, alone.index[0].sort(-1).values)
    assert together.valid[0, 5].sum() == 6 and together.valid[2, 60].all()  # k = min(index_topk, t + 1)
