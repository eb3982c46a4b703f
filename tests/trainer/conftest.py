"""Trainer tests run torch single-threaded: on a shared 2-core box a second intra-op thread makes the
tiny model's small ops far slower, and single-threaded CPU runs are deterministic."""

import pytest
import torch

from asyncrl.config import ModelSection, load_model_section

torch.set_num_threads(1)
SUBPROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def tiny_section() -> ModelSection:
    """configs/model/tiny.yaml: random init from the architecture (seed given to the backend)."""
    return load_model_section("tiny")
