"""The trainer backend boundary: what the RL loop needs from a training engine.

A backend owns the model replica(s) and the optimizer. The loop (trainer/loop.py) hands it packed
micro-batches of one optimizer step; it returns metrics. Everything crossing this boundary is
token-level and HF-named, so backends (torch on CPU/GPU, megatron-core) are interchangeable.
Register new backends in `BACKENDS` (keyed by `TrainerConfig.backend`); `make_backend` imports
only the chosen one.

Several processes (torchrun): the RL loop runs on the leader (rank 0) only and calls the methods
below with the whole step; the backend distributes the work. Every other rank calls `follow()`,
which executes the leader's calls until the leader calls `close()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from asyncrl.config import ModelSection, TrainerConfig
from asyncrl.model.config import ModelConfig
from asyncrl.plugins import load_plugin
from trainer.backends.leader import announce
from trainer.packing import MicroBatch


@dataclass
class SampleTokens:
    """One trained sample's per-position values from the step's forward (before its update), aligned with
    the micro-batch's targets: position j is the sample's token j + 1 given the tokens before it."""

    logprobs: np.ndarray
    """float32 [n - 1]: the trainer's log-prob of each target, at the temperature it was sampled at."""
    entropy: Optional[np.ndarray] = None
    """float32 [n - 1]: entropy of the trainer's next-token distribution; None when not computed."""


def sample_tokens(mb: MicroBatch, logprobs: torch.Tensor, entropy: Optional[torch.Tensor]) -> dict[str, SampleTokens]:
    """A micro-batch's [T] forward outputs split into its samples (by cu_seqlens): sample id -> SampleTokens."""
    bounds = mb.cu_seqlens.tolist()
    lp = logprobs.detach().float().cpu().numpy()
    ent = None if entropy is None else entropy.detach().float().cpu().numpy()
    return {sid: SampleTokens(lp[a:b].copy(), None if ent is None else ent[a:b].copy())
            for sid, a, b in zip(mb.sample_ids, bounds[:-1], bounds[1:])}


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    num_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    """Loss metrics of the whole step (LossMetrics.summary(): masked fraction, mean ratio, mismatch KL,
    entropy, ...) plus backend extras (e.g. indexer_kl)."""
    samples: dict[str, SampleTokens] = field(default_factory=dict)
    """Every trained sample's log-probs (and entropies) from the step's forward, gathered from all ranks:
    the trainer's off-policy health metrics and trained records come from them (trainer/off_policy.py)."""


class TrainerBackend(ABC):
    def __init__(self, cfg: TrainerConfig, model: ModelSection, seed: int = 0) -> None:
        self.cfg, self.model_cfg, self.seed = cfg, model, seed

    def hf_config(self) -> ModelConfig:
        """The architecture of the weights `hf_state_dict` returns (config.json of a weight snapshot)."""
        return ModelConfig.from_pretrained(self.model_cfg.path) if self.model_cfg.path else self.model_cfg.arch

    @property
    def is_leader(self) -> bool:
        """True on the process that runs the RL loop (rank 0)."""
        return True

    def follow(self) -> None:
        """Ranks other than the leader: execute the leader's calls until it closes the backend."""

    def close(self) -> None:
        """Release the backend (and let followers return from `follow`)."""

    @abstractmethod
    def train_step(self, micro_batches: list[MicroBatch], normalizer: int) -> StepResult:
        """Forward/backward every micro-batch of the step (the leader passes all of them; the backend
        splits them across data-parallel ranks), losses sharing `normalizer`, clip, one optimizer step.
        The result is the whole step's (summed over ranks)."""

    @abstractmethod
    def logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:
        """[T] log-probs of the micro-batch's targets under the current weights (no grad)."""

    @abstractmethod
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights with HF names (gathered across ranks): what is pushed to engines."""

    @abstractmethod
    def save_checkpoint(self, path: Path) -> None:
        """Write model + optimizer state into the new directory `path`. trainer/checkpoint.py makes it
        atomic and durable (it writes a temporary directory, fsyncs, renames)."""

    @abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote (path visible to every rank)."""

    def reset_optimizer(self) -> None:
        """Drop optimizer moments (the GLM-5 paper's default after each weight push), on every rank."""
        announce("reset_optimizer")
        self._reset_optimizer()

    @abstractmethod
    def _reset_optimizer(self) -> None:
        """This rank's reset (followers run it when the leader announces `reset_optimizer`)."""


BACKENDS: dict[str, str] = {
    "torch": "trainer.backends.torch_backend:TorchBackend",
    "megatron": "trainer.backends.megatron.backend:MegatronBackend",
}
"""`trainer.backend` built-ins -> import path of their TrainerBackend (asyncrl/plugins.py)."""


def make_backend(cfg: TrainerConfig, model: ModelSection, seed: int = 0) -> TrainerBackend:
    """The backend `cfg.backend` names, a built-in or an import path (its module is imported now, so
    megatron only when chosen)."""
    return load_plugin(BACKENDS, cfg.backend, "trainer.backend")(cfg, model, seed)
