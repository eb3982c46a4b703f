"""Sparse attention + indexer memory grows with T * k, the dense-masked reference with T^2 (measured by
bench/model_bench.py's probe in a child process; the full table at T = 1k..4k is in bench/results)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "model_bench.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("model_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux VmHWM reset")
def test_sparse_peak_grows_linearly_and_dense_quadratically():
    peaks = _bench_module().peak_bytes([("sparse", 1024), ("sparse", 2048), ("dense", 1024), ("dense", 2048)])
    sparse, dense = peaks[:2], peaks[2:]
    assert sparse[1] / sparse[0] < 2.5  # doubling T about doubles it (measured 1.7x)
    assert dense[1] / dense[0] > 3.0  # the [T, heads, T] scores: about 4x (measured 3.9x)
    assert sparse[1] < dense[1] / 3
