"""Supervised warm-up: teach a fresh model the task format before RL (the demo's first minute).

The demonstrations come from an environment class named by import path (it must offer
`demonstrations(count, seed) -> list of OpenAI message lists`, and `demonstration_tools()` -> the OpenAI
tool specs its agent sends, when the demonstrations call tools), rendered with the same chat template
and stop token the gateway uses, so RL starts from a policy that already speaks the format. Only
assistant tokens (content and tool calls, and the stop token that ends each reply) are in the loss.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.config import ModelSection, WarmupConfig, WarmupStage
from asyncrl.model.generate import generate
from asyncrl.model.io import load_pretrained, save_pretrained
from asyncrl.model.model import Glm5ForCausalLM
from asyncrl.plugins import load_object
from asyncrl.tokenizer import load_tokenizer
from trainer.mtp_loss import MTPTerms, fit_mtp_layer, mtp_loss_terms

log = logging.getLogger("trainer.sft")

LOSS_WINDOW = 20
"""Steps whose mean loss WarmupStage.until_loss is compared with: one batch's loss is noisy (a batch of long
copies, an AdamW spike), and a stage stopped on one lucky batch would stop before its jump."""


def tokenize_dialogue(template: GlmChatTemplate, messages: list[dict[str, Any]],
                      tools: Optional[list[dict[str, Any]]] = None) -> tuple[list[int], list[int]]:
    """-> (tokens, loss mask): each assistant reply is generated after its generation prompt and ends
    with the stop token a model emits before the next message (as the gateway records turns); `tools`
    open the conversation's system block as the agent's request renders them."""
    tokens: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        done = _last_reply(messages, i)
        prompt = template.render_incremental(messages[:done], tokens, messages[done:i], tools)
        reply = template.render_reply(message)
        stop = template.stop_token_for(message) if i + 1 < len(messages) else template.tokenizer.eos_token_id
        tokens += prompt + reply + [stop]
        mask += [0] * len(prompt) + [1] * (len(reply) + 1)
    return tokens, mask


def _last_reply(messages: list[dict[str, Any]], before: int) -> int:
    """Index after the last assistant message before `before` (what is already rendered)."""
    done = [j + 1 for j in range(before) if messages[j]["role"] == "assistant"]
    return done[-1] if done else 0


def warmup(model: ModelSection, cfg: WarmupConfig, out_dir: str, seed: int = 0) -> str:
    """Train the stages, then `cfg.steps` supervised steps on cfg.env, and save an HF checkpoint; returns its
    directory."""
    torch.manual_seed(seed)
    net = load_pretrained(model.path, dtype=torch.float32) if model.path else \
        Glm5ForCausalLM.from_config(model.arch, seed=seed)  # fp32 master weights, whatever the checkpoint's dtype
    template = GlmChatTemplate(load_tokenizer(model.tokenizer), thinking=cfg.thinking)
    _check(cfg, net)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=cfg.lr)
    rng = random.Random(seed)
    main = WarmupStage(env=cfg.env, env_options=cfg.env_options, steps=cfg.steps, batch_size=cfg.batch_size)
    for stage in [*cfg.stages, main]:
        env = load_object(stage.env)(**stage.env_options)
        examples = _examples(template, env, stage.steps * stage.batch_size, seed)
        _train_stage(net, optimizer, stage, examples, rng, cfg)
    if cfg.mtp_distill_samples > 0:
        _distill_mtp(net, env, template, cfg, max(sum(mask) for _, mask in examples), seed)  # the main stage's
    save_pretrained(net, out_dir)
    return out_dir


def _check(cfg: WarmupConfig, net: Glm5ForCausalLM) -> None:
    for name in ("mtp_loss_coef", "mtp_distill_samples"):
        if getattr(cfg, name) > 0 and not net.model.mtp_layers:
            raise ValueError(f"warmup.{name} {getattr(cfg, name)}: the model has no MTP layer")
    if cfg.mtp_depths < 1:
        raise ValueError(f"warmup.mtp_depths must be >= 1, got {cfg.mtp_depths}")
    for i, stage in enumerate(cfg.stages):
        if stage.until_loss is not None and stage.until_loss <= 0:
            raise ValueError(f"warmup.stages[{i}].until_loss must be > 0 (or null), got {stage.until_loss}")


def _train_stage(net: Glm5ForCausalLM, optimizer: torch.optim.Optimizer, stage: WarmupStage,
                 examples: list[tuple[list[int], list[int]]], rng: random.Random, cfg: WarmupConfig) -> None:
    """`stage.steps` steps on batches drawn from `examples`, fewer when its mean loss gets below `until_loss`."""
    recent: deque[float] = deque(maxlen=LOSS_WINDOW)
    for step in range(stage.steps):
        loss, mtp = _step(net, optimizer, rng.sample(examples, stage.batch_size), cfg.mtp_loss_coef, cfg.mtp_depths)
        recent.append(loss)
        reached = stage.until_loss is not None and len(recent) == LOSS_WINDOW and \
            sum(recent) / LOSS_WINDOW < stage.until_loss
        if step % 20 == 0 or step == stage.steps - 1 or reached:
            log.info("warm-up on %s, step %d/%d: loss %.3f%s", stage.env, step + 1, stage.steps, loss,
                     f", MTP loss {mtp.loss_sum.item() / mtp.count:.3f} accuracy {mtp.correct.item() / mtp.count:.2f}"
                     if mtp and mtp.count else "")
        if reached:
            log.info("warm-up on %s: mean loss of the last %d steps %.4f < until_loss %g at step %d",
                     stage.env, LOSS_WINDOW, sum(recent) / len(recent), stage.until_loss, step + 1)
            return
    if stage.until_loss is not None:
        log.warning("warm-up on %s ended at its %d steps with mean loss %.4f, not below until_loss %g: "
                    "the stage may not have learned what the next one builds on", stage.env, stage.steps,
                    sum(recent) / max(len(recent), 1), stage.until_loss)


def _examples(template: GlmChatTemplate, env, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`count` tokenized demonstrations of the env, with its agent's tools when it has some."""
    tools = env.demonstration_tools() if hasattr(env, "demonstration_tools") else None
    return [tokenize_dialogue(template, d, tools) for d in env.demonstrations(count, seed)]


def _distill_mtp(net: Glm5ForCausalLM, env, template: GlmChatTemplate, cfg: WarmupConfig, max_reply: int,
                 seed: int) -> None:
    """Fit the MTP layer to replies the warmed-up policy samples itself (WarmupConfig.mtp_distill_samples),
    on first-turn prompts of a demonstration stream the warm-up did not use."""
    prompts = [tokens[:mask.index(1)] for tokens, mask in _examples(template, env, cfg.mtp_distill_samples, seed + 1)]
    replies = generate(net, prompts, max_reply, temperature=1.0, seed=seed, stop_ids=net.config.eos_token_ids)
    accuracy = fit_mtp_layer(net, [p + r for p, r in zip(prompts, replies)], cfg.mtp_distill_steps, lr=cfg.lr,
                             depths=cfg.mtp_depths)
    log.info("MTP self-distillation: %d sampled replies, %d steps, first-draft accuracy %.2f",
             len(replies), cfg.mtp_distill_steps, accuracy)


def _step(net: Glm5ForCausalLM, optimizer: torch.optim.Optimizer, batch: list[tuple[list[int], list[int]]],
          mtp_loss_coef: float = 0.0, mtp_depths: int = 1) -> tuple[float, Optional[MTPTerms]]:
    """One supervised step; the MTP loss (its own mean, times `mtp_loss_coef`) trains the MTP layer only."""
    ids, targets, mask, bounds = [], [], [], [0]
    for tokens, loss_mask in batch:
        ids += tokens
        targets += tokens[1:] + [0]
        mask += loss_mask[1:] + [0]  # target i is tokens[i + 1]
        bounds.append(len(ids))
    targets, bounds = torch.tensor(targets), torch.tensor(bounds)
    out = net.token_logprobs(torch.tensor(ids), bounds, targets, with_entropy=False)
    weights = torch.tensor(mask, dtype=torch.float32)
    loss = -(out.logprobs * weights).sum() / weights.sum()
    total, mtp = loss, None
    if mtp_loss_coef > 0:
        mtp = mtp_loss_terms(net, out.hidden, targets, bounds, weights.bool(), depths=mtp_depths)
        total = loss + mtp_loss_coef * mtp.loss_sum / max(mtp.count, 1)
    optimizer.zero_grad()
    total.backward()
    optimizer.step()
    return loss.item(), mtp
