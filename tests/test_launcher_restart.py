"""The launcher's watch over the trainer actor (Job.wait) under real Ray: a trainer that dies and comes
back slowly costs one restart, not the whole budget; one that does not come back in time fails the run,
naming the trainer."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from asyncrl.config import ComponentsConfig, RunConfig
from asyncrl_run.launcher import ComponentFailed, Job

RESTART_DELAY_S = 4.0


class SlowlyRestartingTrainer:
    """Exits in its first run; its next incarnation takes RESTART_DELAY_S to start (a loaded machine)."""

    def __init__(self, cfg, model, redis_url: str, run: str, run_dir: str, seed: int = 0,
                 retention_groups: int = 10_000, log_file=None) -> None:
        self.died = Path(run_dir) / "died"
        if self.died.exists():
            time.sleep(RESTART_DELAY_S)

    def run(self, total_steps: int) -> int:
        if not self.died.exists():
            self.died.write_text(str(os.getpid()))
            os._exit(1)
        return total_steps


class TrainerLosingRedis(SlowlyRestartingTrainer):
    """Its run() raises what a trainer whose Redis died raises."""

    def run(self, total_steps: int) -> int:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")


@pytest.fixture
def job(local_ray, redis_server, run_name, tmp_path):
    cfg = RunConfig(name=run_name, total_steps=1,
                    components=ComponentsConfig(trainer=f"{__name__}.SlowlyRestartingTrainer"))
    return lambda **overrides: Job(replace(cfg, **overrides), tmp_path, redis_server.url)


def test_a_slow_trainer_restart_is_waited_for_and_counts_once(job, tmp_path):
    run = job(trainer_restarts=1)
    run._create_trainer("unused")
    run._start_training()
    start = time.monotonic()
    run.wait()  # returns once the restarted trainer's run() does
    assert (tmp_path / "died").exists() and time.monotonic() - start >= RESTART_DELAY_S


def test_a_trainer_error_is_named_by_its_cause_without_escape_codes(local_ray, redis_server, run_name, tmp_path):
    """Ray's error text opens with a colored `ray::Trainer.run()` line; the console gets the cause instead."""
    cfg = RunConfig(name=run_name, total_steps=1,
                    components=ComponentsConfig(trainer=f"{__name__}.TrainerLosingRedis"))
    run = Job(cfg, tmp_path, redis_server.url)
    run._create_trainer("unused")
    run._start_training()
    with pytest.raises(ComponentFailed) as failure:
        run.wait()
    assert str(failure.value) == ("trainer failed: redis.exceptions.ConnectionError: "
                                  "Error 111 connecting to 127.0.0.1:1. Connection refused.")


def test_a_trainer_that_does_not_come_back_in_time_fails_the_run(job):
    run = job(trainer_restart_timeout_s=1.0)
    run._create_trainer("unused")
    run._start_training()
    with pytest.raises(ComponentFailed, match="not restarted within 1 s") as failure:
        run.wait()
    assert failure.value.component == "trainer"

