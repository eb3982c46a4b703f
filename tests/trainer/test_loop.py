"""The RL loop driven step by step (the sync-mode hook) on a real redis-server: acknowledgement only
after the checkpoint, weight versions and optimizer resets every K steps, the metrics record."""

import numpy as np
import pytest

from asyncrl.config import TrainerConfig, WeightPushConfig
from asyncrl.model.model import Glm5ForCausalLM
from asyncrl.store import TRAINER_GROUP, Store
from tests.trainer.helpers import policy_groups, write_groups
from trainer.actor import Trainer
from trainer.run import build_trainer, load_config

pytestmark = pytest.mark.timeout(120)


async def pending(store: Store) -> int:
    return (await store.redis.xpending(store.key("groups"), TRAINER_GROUP))["pending"]


async def test_steps_ack_after_checkpoint_push_every_k_and_report(redis_server, run_name, tiny_section, tmp_path):
    groups = policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), 8)
    store = Store.connect(redis_server.url, run_name)
    await write_groups(store, groups)
    cfg = TrainerConfig(lr=1e-3, groups_per_step=2, checkpoint_every=3, staleness_tau=100, micro_batch_tokens=64,
                        weight_push=WeightPushConfig(every_k_steps=2, reset_optimizer=True))
    trainer = Trainer(cfg, tiny_section, redis_server.url, run_name, str(tmp_path))
    seen = []
    for step in range(1, 5):
        metrics = await trainer.step()
        seen.append((metrics["step"], metrics["weight_version"], await pending(store),
                     len(trainer.backend.optimizer.state) > 0))
    # step: pending groups until the step-3 checkpoint; version + 1 and a fresh optimizer every 2 steps
    assert seen == [(1, 0, 2, True), (2, 1, 4, False), (3, 1, 0, True), (4, 2, 2, False)]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]
    weights = await store.weights()
    assert weights.served_version == 2 and weights.snapshot.endswith("v00000002")

    records = [values for _, source, values in await store.read_metrics() if source == "trainer"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    first = records[0]
    assert first["masked_fraction"] == 0 and first["mean_ratio"] == pytest.approx(1, abs=1e-5)
    assert first["reward_mean"] == pytest.approx(np.mean([s.reward for g in groups[:2] for s in g]))
    assert first["filter_groups_kept"] == 2 and first["tokens"] > 0 and first["tokens_per_s"] > 0
    assert "push_s" in records[1] and "push_s" not in records[0]
    assert [r["staleness_max"] for r in records] == [0, 0, 1, 1]  # samples were generated under version 0
    await trainer.close()
    await store.close()


async def test_the_runs_redis_retention_trims_what_the_trainer_acknowledged(redis_server, run_name, tmp_path):
    """redis.retention_groups reaches the trainer's Store (it once stayed at the 10,000 default)."""
    cfg = load_config([f"redis.url={redis_server.url}", f"name={run_name}", f"run_dir={tmp_path}",
                       "model=tiny", "redis.retention_groups=2", "trainer.groups_per_step=2",
                       "trainer.checkpoint_every=1", "trainer.staleness_tau=100", "trainer.micro_batch_tokens=64"])
    store = Store.connect(redis_server.url, run_name)
    await write_groups(store, policy_groups(Glm5ForCausalLM.from_config(cfg.model.arch, seed=0), 8))
    trainer = build_trainer(cfg)
    for _ in range(3):
        await trainer.step()
    assert await store.redis.llen(store.key("consumed")) == 2  # 6 acknowledged, the oldest 4 trimmed
    assert await store.redis.xlen(store.key("groups")) == 4  # 2 kept for inspection + 2 never read
    await trainer.close()
    await store.close()


def test_trainer_runs_as_a_ray_actor(redis_server, run_name, tiny_section, tmp_path):
    import ray

    from asyncrl.store import run_sync
    from tests.services import ROOT

    async def write() -> None:
        store = Store.connect(redis_server.url, run_name)
        await write_groups(store, policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), 2))
        await store.close()
    run_sync(write())
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        cfg = TrainerConfig(groups_per_step=2, staleness_tau=100, micro_batch_tokens=64)
        actor = ray.remote(Trainer).remote(cfg, tiny_section, redis_server.url, run_name, str(tmp_path))
        metrics = ray.get(actor.step.remote(final=True), timeout=120)
        assert metrics["step"] == 1 and metrics["weight_version"] == 1 and metrics["filter_groups_kept"] == 2
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.shutdown()
    assert (tmp_path / "checkpoints" / "step-00000001" / "trainer_state.json").exists()
