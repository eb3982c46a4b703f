"""The supervised warm-up (trainer/sft.py): its stages run in order on their own envs' demonstrations, with
one optimizer, before the main stage; tool-calling demonstrations are rendered as the gateway renders the
agent's turns (tests/envs/test_file_lookup_env.py checks the tokens)."""

import logging

import pytest
import torch

from asyncrl.config import WarmupConfig, WarmupStage, load_model_section
from asyncrl.model.io import load_pretrained
from asyncrl.tokenizer import load_tokenizer
from asyncrl.chat_template import GlmChatTemplate
from trainer.sft import _examples, warmup

COPY = WarmupStage(env="envs.tasks.CopyEnv", env_options={"alphabet": "0123456789", "min_len": 2, "max_len": 8},
                   steps=60, batch_size=32)


def copy_loss(path: str) -> float:
    """Mean loss of the model at `path` on fresh copy demonstrations (not the warm-up's)."""
    from envs.tasks import CopyEnv

    net = load_pretrained(path)
    template = GlmChatTemplate(load_tokenizer("builtin:tiny"), thinking=False)
    ids, targets, mask, bounds = [], [], [], [0]
    for tokens, loss_mask in _examples(template, CopyEnv(**COPY.env_options), 64, seed=99):
        ids, targets, mask = ids + tokens, targets + tokens[1:] + [0], mask + loss_mask[1:] + [0]
        bounds.append(len(ids))
    with torch.no_grad():
        out = net.token_logprobs(torch.tensor(ids), torch.tensor(bounds), torch.tensor(targets), with_entropy=False)
    weights = torch.tensor(mask, dtype=torch.float32)
    return float(-(out.logprobs * weights).sum() / weights.sum())


def test_stages_train_in_order_before_the_main_stage(tmp_path, caplog):
    model = load_model_section("tiny")
    main = dict(steps=2, batch_size=4, env="envs.terminal.FileLookupEnv", env_options={"names": "ab"}, lr=3e-3)
    with caplog.at_level(logging.INFO, logger="trainer.sft"):
        staged = warmup(model, WarmupConfig(stages=[COPY], **main), str(tmp_path / "staged"))
    plain = warmup(model, WarmupConfig(**main), str(tmp_path / "plain"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up on")]
    assert lines[0].startswith("warm-up on envs.tasks.CopyEnv, step 1/60")
    assert lines[-1].startswith("warm-up on envs.terminal.FileLookupEnv, step 2/2")
    assert [i for i, line in enumerate(lines) if "CopyEnv" in line] == list(range(len(lines) - 2))
    assert copy_loss(staged) < copy_loss(plain) - 0.3  # the copy stage trained the model that was saved


def test_a_stage_with_until_loss_ends_when_its_mean_loss_is_below_it(tmp_path, caplog):
    """A loss every step beats ends the stage after its first LOSS_WINDOW steps; one no step reaches runs the
    stage to its `steps` and says so; a non-positive one is refused."""
    from dataclasses import replace

    from trainer.sft import LOSS_WINDOW

    model = load_model_section("tiny")
    main = dict(steps=1, batch_size=4, env="envs.terminal.FileLookupEnv", env_options={"names": "ab"}, lr=3e-3)
    reached, missed = replace(COPY, steps=30, batch_size=4, until_loss=100.0), replace(COPY, steps=30, batch_size=4,
                                                                                      until_loss=1e-9)
    with caplog.at_level(logging.INFO, logger="trainer.sft"):
        warmup(model, WarmupConfig(stages=[reached, missed], **main), str(tmp_path / "w"))
    steps = [r.getMessage() for r in caplog.records if "CopyEnv, step" in r.getMessage()]
    assert steps[-1].startswith("warm-up on envs.tasks.CopyEnv, step 30/30")  # the second stage ran to its end
    assert sum(f"step {LOSS_WINDOW}/30" in line for line in steps) == 1  # the first stopped there
    assert any("mean loss of the last 20 steps" in r.getMessage() and "until_loss 100" in r.getMessage()
               for r in caplog.records)
    assert any(r.levelno == logging.WARNING and "not below until_loss 1e-09" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"warmup.stages\[0\].until_loss must be > 0"):
        warmup(model, WarmupConfig(stages=[replace(COPY, until_loss=0.0)], **main), str(tmp_path / "bad"))
