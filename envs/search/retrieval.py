"""BM25 retrieval over the corpus with bm25s (sparse-matrix BM25; no network, no model weights)."""

from __future__ import annotations

import bm25s


class BM25Index:
    """Ranks documents (title + text) for a free-text query."""

    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        corpus = self.tokenizer.tokenize([f"{d['title']} {d['text']}" for d in docs], show_progress=False)
        self.retriever = bm25s.BM25()
        self.retriever.index(corpus, show_progress=False)

    def search(self, query: str, k: int = 5) -> list[tuple[dict, float]]:
        """The k best documents with a positive score, best first."""
        tokens = self.tokenizer.tokenize([query], update_vocab=False, show_progress=False)
        if not any(tokens[0]):
            return []
        ids, scores = self.retriever.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return [(self.docs[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]
