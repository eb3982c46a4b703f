"""The trainer's Prometheus endpoint, on a real trainer against a real redis-server: /metrics with the
asyncrl_trainer_ prefix whose values follow the steps, /health, and its URL in the run's `services` hash."""

import re

import httpx
import pytest

from asyncrl.config import TrainerConfig, WeightPushConfig
from asyncrl.model.model import Glm5ForCausalLM
from asyncrl.store import Store
from tests.trainer.helpers import policy_groups, write_groups
from trainer.actor import Trainer

pytestmark = pytest.mark.timeout(120)


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, and every family name under '# TYPE'."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    samples["#families"] = re.findall(r"^# TYPE (\S+) ", text, re.M)
    return samples


async def test_a_trainer_serves_its_step_metrics_and_records_where(redis_server, run_name, tiny_section, tmp_path):
    store = Store.connect(redis_server.url, run_name)
    await write_groups(store, policy_groups(Glm5ForCausalLM.from_config(tiny_section.arch, seed=0), 4))
    cfg = TrainerConfig(lr=1e-3, groups_per_step=2, checkpoint_every=2, staleness_tau=100, micro_batch_tokens=64,
                        weight_push=WeightPushConfig(every_k_steps=1))
    trainer = Trainer(cfg, tiny_section, redis_server.url, run_name, str(tmp_path))
    url = trainer.metrics_url
    assert url.startswith("http://127.0.0.1:")
    before = scrape(url)
    assert before["asyncrl_trainer_step"] == 0 and before['asyncrl_trainer_phase_seconds_total{phase="train"}'] == 0

    first = await trainer.step()
    services = await store.redis.hgetall(store.key("services"))
    assert services[b"trainer_metrics"].decode() == url  # where `asyncrl watch` and operators find it
    one = scrape(url)
    assert one["asyncrl_trainer_step"] == 1 and one["asyncrl_trainer_weight_version"] == 1
    assert one["asyncrl_trainer_loss"] == pytest.approx(first["loss"])
    assert one["asyncrl_trainer_reward_mean"] == pytest.approx(first["reward_mean"])
    assert one["asyncrl_trainer_grad_norm"] == pytest.approx(first["grad_norm"]) and first["grad_norm"] > 0
    assert one["asyncrl_trainer_tokens_per_second"] == pytest.approx(first["tokens_per_s"])
    assert one["asyncrl_trainer_staleness_mean"] == pytest.approx(first["staleness_mean"])
    assert one['asyncrl_trainer_last_step_seconds{phase="train"}'] == pytest.approx(first["train_s"])
    assert one['asyncrl_trainer_last_step_seconds{phase="push"}'] == pytest.approx(first["push_s"])
    assert first["push_s"] > 0
    assert one['asyncrl_trainer_last_step_seconds{phase="checkpoint"}'] == 0  # checkpoint_every 2
    assert one["asyncrl_trainer_tokens_total"] == first["tokens"] > 0

    second = await trainer.step()
    two = scrape(url)
    assert two["asyncrl_trainer_step"] == 2 and two["asyncrl_trainer_weight_version"] == 2
    assert two["asyncrl_trainer_loss"] == pytest.approx(second["loss"])
    assert two["asyncrl_trainer_loss"] != one["asyncrl_trainer_loss"]
    assert two['asyncrl_trainer_last_step_seconds{phase="checkpoint"}'] == pytest.approx(second["checkpoint_s"])
    assert second["checkpoint_s"] > 0
    train_total = two['asyncrl_trainer_phase_seconds_total{phase="train"}']
    assert train_total == pytest.approx(first["train_s"] + second["train_s"])
    assert two["asyncrl_trainer_tokens_total"] == first["tokens"] + second["tokens"]
    assert two["asyncrl_trainer_steps_total"] == 2
    assert all(name.startswith("asyncrl_trainer_") for name in two["#families"]), two["#families"]

    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok", "step": 2, "weight_version": 2}
    assert httpx.get(f"{url}/nope", timeout=10).status_code == 404

    await trainer.close()
    assert b"trainer_metrics" not in await store.redis.hgetall(store.key("services"))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
    await store.close()


def test_the_endpoint_can_be_turned_off(redis_server, run_name, tiny_section, tmp_path):
    trainer = Trainer(TrainerConfig(metrics_port=None), tiny_section, redis_server.url, run_name, str(tmp_path))
    assert trainer.metrics_url is None and trainer.metrics_server is None
