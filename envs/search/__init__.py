"""Search env: multi-hop questions over a shipped fictional corpus, BM25 (bm25s), tools search/open/answer."""

from envs.search.env import SearchEnv

__all__ = ["SearchEnv"]
