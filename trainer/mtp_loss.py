"""Online MTP training: the MTP layer learns to predict the token after next on the tokens the policy
generates, so its speculative drafts keep up with the policy being trained (as slime, Miles and SkyRL
train it during RL).

Position t of a packed batch reads x_{t+1} (its next-token target) and the main model's hidden h_t, and
predicts x_{t+2}, the next position's target. It counts where that token is a loss token of the same
sequence: the drafts that matter are drafts of generated tokens. The loss is the mean cross-entropy
over the counted positions of the step (temperature 1). It reaches the MTP layer only:
`Glm5ForCausalLM.mtp_logprobs` reads the main model detached.

Depths (GLM-5 shares one MTP layer over 3 training depths and drafts 2 tokens with it): speculative
decoding reuses the layer for draft j > 1 with its own previous output in place of h (rollout/drafting.py:
MTP position t reads the output of position t - 1 and the draft x_{t+1}). Depth d trains exactly that
input: position t reads depth d - 1's output at t - 1 (depth 1: h_t) and still predicts x_{t+2}. Trained at
depth 1 only, its second draft is accepted about a third of the time (bench/results/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from asyncrl.model.model import Glm5ForCausalLM, mtp_targets


@dataclass
class MTPTerms:
    loss_sum: Tensor
    """Sum over the counted positions of -log p(x_{t+2}), averaged over the depths at which the position
    counts (carries the MTP layer's gradient); / count is the mean of the depths' losses."""
    correct: Tensor
    """Counted positions where the MTP layer's greedy draft at depth 1 is x_{t+2}: the temperature-0 accept
    rate of a first draft."""
    count: int
    """Counted positions (depth 1)."""


def mtp_loss_mask(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """[N] bool: the positions the MTP loss counts (the next position's target is a loss token of the same
    sequence)."""
    _, valid = mtp_targets(loss_mask, cu_seqlens)
    return valid & loss_mask.bool().roll(-1)


def mtp_loss_terms(model: Glm5ForCausalLM, hidden: Tensor, targets: Tensor, cu_seqlens: Tensor,
                   loss_mask: Tensor, depths: int = 1, **batch_options) -> MTPTerms:
    """The MTP layer's terms on one packed batch whose main forward gave `hidden` (TokenLogprobs.hidden)
    for next-token `targets`, trained at `depths` depths (module docstring)."""
    goal, _ = mtp_targets(targets, cu_seqlens)
    counted = mtp_loss_mask(loss_mask, cu_seqlens)
    offset = torch.arange(len(targets), device=targets.device) - cu_seqlens[:-1].long().repeat_interleave(
        (cu_seqlens[1:] - cu_seqlens[:-1]).long())  # position of each row in its sequence
    nll, weight, correct, inputs = 0.0, torch.zeros_like(goal, dtype=torch.float32), None, hidden
    for depth in range(depths):
        out = model.mtp_logprobs(inputs, targets, cu_seqlens, goal, **batch_options)
        at_depth = counted & (offset >= depth)  # depth d needs d - 1 earlier positions of its sequence
        nll = nll - out.logprobs * at_depth
        weight = weight + at_depth
        if depth == 0:
            correct = ((out.predicted == goal) & counted).sum()
        if depth + 1 < depths:  # the next depth's position t reads this one's output at t - 1 (first: h)
            inputs = torch.where((offset == 0)[:, None], hidden.detach(), out.hidden.roll(1, 0))
    return MTPTerms(loss_sum=(nll / weight.clamp_min(1)).sum(), correct=correct, count=int(counted.sum()))


def clip_mtp_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the MTP layer's gradients on their own (the policy's clip must not see them, or the main
    update would change with the MTP loss); a non-finite norm drops them, so AdamW skips the MTP layer
    this step. -> the norm before clipping."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))
    if not torch.isfinite(torch.tensor(norm)):
        for param in params:
            param.grad = None
    return norm


def fit_mtp_layer(model: Glm5ForCausalLM, sequences: list[list[int]], steps: int, lr: float = 3e-3,
                  depths: int = 1) -> float:
    """Train only the MTP layer for `steps` full-batch AdamW steps on token sequences (e.g. the model's own
    generations: a drafter for a checkpoint whose MTP layer is untrained). -> the last step's greedy
    draft accuracy (the temperature-0 accept rate of one draft)."""
    ids = torch.tensor([t for s in sequences for t in s[:-1]])
    targets = torch.tensor([t for s in sequences for t in s[1:]])
    cu_seqlens = torch.tensor([0, *torch.tensor([len(s) - 1 for s in sequences]).cumsum(0).tolist()])
    with torch.no_grad():
        hidden = model.token_logprobs(ids, cu_seqlens, targets, with_entropy=False).hidden
    optimizer = torch.optim.AdamW(model.model.mtp_layers.parameters(), lr=lr)
    accuracy = 0.0
    for _ in range(steps):
        terms = mtp_loss_terms(model, hidden, targets, cu_seqlens, torch.ones_like(targets, dtype=torch.bool),
                               depths=depths)
        optimizer.zero_grad()
        (terms.loss_sum / terms.count).backward()
        optimizer.step()
        accuracy = float(terms.correct) / terms.count
    return accuracy
