"""The trainer backend boundary: what the RL loop needs from a training engine.

A backend owns the model replica(s) and the optimizer. The loop (trainer/loop.py) hands it packed
micro-batches of one optimizer step; it returns metrics. Everything crossing this boundary is
token-level and HF-named, so backends (torch on CPU/GPU, megatron-core) are interchangeable.
Register new backends in `BACKENDS` (keyed by `TrainerConfig.backend`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from asyncrl.config import ModelSection, TrainerConfig
from trainer.packing import MicroBatch


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    """Loss metrics (masked fraction, mean ratio, mismatch KL, entropy, ...) summed over micro-batches."""


class TrainerBackend(ABC):
    def __init__(self, cfg: TrainerConfig, model: ModelSection, seed: int = 0) -> None:
        self.cfg, self.model_cfg, self.seed = cfg, model, seed

    @abstractmethod
    def train_step(self, micro_batches: list[MicroBatch], normalizer: int) -> StepResult:
        """Forward/backward every micro-batch (losses share `normalizer`), clip, one optimizer step."""

    @abstractmethod
    def logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """[T] log-probs of the micro-batch's targets under the current weights (no grad)."""

    @abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights with HF names (gathered across ranks): what is pushed to engines."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Model + optimizer state, written atomically (a crash leaves the previous checkpoint)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        ...

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Drop optimizer moments (the GLM-5 paper's default after each weight push)."""


BACKENDS: dict[str, Callable[..., TrainerBackend]] = {}
"""`trainer.backend` -> factory; backends add themselves when their module is imported."""
