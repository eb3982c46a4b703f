"""Near-tie diagnostics: where a sequence's DSA selection sits within rounding of a different one.

Cached decode and the teacher-forced forward compute the same index scores with different kernel shapes;
where a query's k-th and (k+1)-th scores are closer than fp32 rounding, the two paths can select different
keys and that token's log-prob (and, through its hidden state, later ones) moves (docs/model.md, "Near
ties"). Recording each query's selection margin during a forward tells such a divergence apart from a
wrong record: a divergence that begins at a query with no near tie is not rounding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from asyncrl.model.indexer import Indexer


@contextmanager
def recorded_selection_margins(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, each indexer's `select` also appends its queries' margins ([B, Lq], see
    Indexer.selection_margins) to the yielded list, one entry per indexer layer call."""
    margins: list[torch.Tensor] = []
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]

    def recording(indexer: Indexer):
        def select(q, weights, key_store, batch):
            margins.append(indexer.selection_margins(q, weights, key_store, batch))
            return Indexer.select(indexer, q, weights, key_store, batch)
        return select

    for indexer in indexers:
        indexer.select = recording(indexer)  # instance attribute shadows the method
    try:
        yield margins
    finally:
        for indexer in indexers:
            del indexer.select
