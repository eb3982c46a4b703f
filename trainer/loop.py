"""The RL loop: read complete groups, train one optimizer step, push weights every K steps,
checkpoint, acknowledge, report.

    groups (Redis) -> GroupLoader.next_step -> backend.train_step -> [push every K] -> [checkpoint -> XACK]

Order matters: the push comes before the checkpoint, so a checkpoint holds the weight version the
engines serve and the optimizer state after its reset; groups are acknowledged only after the
checkpoint that holds their step is durable (trainer/checkpoint.py has the crash cases).

The loop drives a `LoopTrainer`, not trainer/actor.py's Trainer itself, so the two do not import each other
and the loop can be read (and driven) knowing only the few operations it calls.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from asyncrl.config import TrainerConfig
from trainer.backends.base import StepResult
from trainer.checkpoint import TrainerState
from trainer.data import StepBatch
from trainer.losses import TrustBand
from trainer.off_policy import step_health
from trainer.packing import replayed_fraction
from trainer.weight_push import PushReport


class LoopTrainer(Protocol):
    """What the RL loop drives (trainer/actor.py's Trainer is the implementation)."""

    cfg: TrainerConfig
    state: TrainerState
    stopping: asyncio.Event
    band: Optional[TrustBand]
    """The loss's trust band (PolicyLoss.band): the health metrics classify tokens by it."""

    async def start(self) -> None:
        """Once, before the first step: whatever a restart must put right before training goes on."""

    async def next_batch(self) -> Optional[StepBatch]:
        """The next step's batch, or None once a stop is requested."""

    async def train_step(self, batch: StepBatch) -> StepResult:
        """One optimizer step on `batch`, whose groups wait for the next checkpoint to be acknowledged."""

    async def push_weights(self, version: int) -> PushReport: ...

    async def checkpoint_and_commit(self) -> None:
        """Make the trained steps durable, then acknowledge their groups (nothing when none were trained)."""

    async def report(self, metrics: dict[str, float]) -> None:
        """Publish one step's metrics record."""

    async def export_final(self) -> Path: ...


async def train(t: LoopTrainer, total_steps: int) -> None:
    """Run until `total_steps` optimizer steps (counting those before a restart) or a stop request."""
    await t.start()
    while t.state.step < total_steps and not t.stopping.is_set():
        await rl_step(t, final=t.state.step + 1 == total_steps)
    await t.checkpoint_and_commit()  # stopped early: make what was trained durable before returning
    if t.state.step >= total_steps:
        await t.export_final()


async def rl_step(t: LoopTrainer, final: bool = False) -> Optional[dict[str, float]]:
    cfg, state = t.cfg, t.state
    started = time.perf_counter()
    batch = await t.next_batch()                                   # blocks until groups_per_step usable groups
    if batch is None:
        return None
    waited = time.perf_counter() - started
    result = await t.train_step(batch)
    trained = time.perf_counter() - started - waited
    state.step += 1
    push = None
    if state.step % cfg.weight_push.every_k_steps == 0:
        push = await t.push_weights(state.weight_version + 1)     # pause engines, transfer, continue
    metrics = step_metrics(batch, result, push, state.step, state.weight_version, waited, trained,
                           time.perf_counter() - started, t.band)
    metrics["checkpoint_s"] = 0.0
    if state.step % cfg.checkpoint_every == 0 or final:
        state.record = dict(metrics)                               # durable with the step it describes
        checkpoint_started = time.perf_counter()
        await t.checkpoint_and_commit()                            # durable, then XACK
        metrics["checkpoint_s"] = time.perf_counter() - checkpoint_started
        metrics["step_s"] += metrics["checkpoint_s"]
    await t.report(metrics)
    return metrics


def step_metrics(batch: StepBatch, result: StepResult, push: Optional[PushReport], step: int, weight_version: int,
                 wait_s: float, train_s: float, step_s: float, band: Optional[TrustBand] = None) -> dict[str, float]:
    """The `trainer` record of the metrics stream for one step (its off-policy health: trainer/off_policy.py)."""
    samples = {s.sample_id: s for g in batch.groups for s in g.samples}
    trained = [samples[sid] for mb in batch.micro_batches for sid in mb.sample_ids]
    staleness = [batch.staleness(s) for s in trained if s.first_weight_version >= 0]
    metrics = {
        "step": step, "weight_version": weight_version, "loss": result.loss, "grad_norm": result.grad_norm,
        "tokens": result.num_tokens, "tokens_per_s": result.num_tokens / max(train_s, 1e-9),
        "reward_mean": float(np.mean([s.reward for s in trained])) if trained else 0.0,
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)), "fill_ratio": batch.fill_ratio,
        "routing_replayed": replayed_fraction(batch.micro_batches),
        "wait_s": wait_s, "train_s": train_s, "step_s": step_s,
        **batch.stats.metrics(), **result.metrics, **step_health(batch, result.samples, band, step_s),
    }
    if push is not None:
        metrics |= {"push_s": push.total_s, "push_paused_s": push.pause_s + push.update_s + push.resume_s,
                    "push_failed_engines": len(push.failed)}
    return {k: float(v) for k, v in metrics.items()}
