"""The trainer of `python -m trainer.run`, killed with SIGKILL at a chosen point (recovery tests).

    python -m tests.trainer.crash_worker LOG CRASH [hydra overrides...]

CRASH: `none`; `train:N` (inside step N's forward pass, after earlier steps' work); `commit:N` (after
the checkpoint holding step N is durable, before its groups are acknowledged). Every finished
train_step is appended to LOG as a json line {"step": n, "groups": [stream ids]}.
"""

import asyncio
import json
import os
import signal
import sys

import torch

from trainer.run import build_trainer, load_config, serve


def install(trainer, crash: str, log_path: str) -> None:
    point, _, at = crash.partition(":")
    at = int(at or 0)
    read, train, forward_backward, commit = (trainer.loader.next_step, trainer.backend.train_step,
                                             trainer.backend._forward_backward, trainer.loader.commit)
    last = {}

    async def next_step(*args):
        last["batch"] = await read(*args)
        return last["batch"]

    def train_step(*args):
        result = train(*args)
        with open(log_path, "a") as log:
            log.write(json.dumps({"step": trainer.state.step + 1, "groups": last["batch"].stream_ids}) + "\n")
            log.flush()
            os.fsync(log.fileno())
        return result

    def forward_backward_or_die(*args):
        if point == "train" and trainer.state.step + 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_backward(*args)

    async def commit_or_die(batch):
        if point == "commit" and trainer.state.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        await commit(batch)

    trainer.loader.next_step, trainer.backend.train_step = next_step, train_step
    trainer.backend._forward_backward, trainer.loader.commit = forward_backward_or_die, commit_or_die


def main(log_path: str, crash: str, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = load_config(overrides)
    trainer = build_trainer(cfg)
    install(trainer, crash, log_path)
    asyncio.run(serve(trainer, cfg.total_steps))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
