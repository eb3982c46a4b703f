"""One naming convention for every service's Prometheus metrics (docs/run.md "Metrics"), checked on the
real services of a small run, scraped in one place after one group went through all of them: the
engine (tiny model), the TITO gateway, the orchestrator, an env service and the trainer (which trains
that group). asyncrl's own metrics are `asyncrl_<component>_<name>`; the engine keeps SGLang's
`sglang_*` names (so SGLang dashboards work on it); docs/run.md lists every metric served."""

from __future__ import annotations

import re

import httpx
import pytest

from asyncrl.config import TrainerConfig, load_model_section
from asyncrl.store import Store
from tests.orchestrator.conftest import Orchestrator, start_envs
from tests.rollout.conftest import start_engine
from tests.services import ROOT, ServiceProcess

pytestmark = pytest.mark.timeout(300)

COMPONENT_PREFIXES = {"engine": ("sglang_", "asyncrl_engine_"), "gateway": ("asyncrl_gateway_",),
                      "orchestrator": ("asyncrl_orchestrator_",), "env": ("asyncrl_env_",),
                      "trainer": ("asyncrl_trainer_",)}


def families(url: str) -> list[str]:
    """The metric families a /metrics endpoint serves (its `# TYPE` lines; `_created` companions dropped)."""
    reply = httpx.get(f"{url}/metrics", timeout=30)
    assert reply.status_code == 200, reply.text
    names = re.findall(r"^# TYPE (\S+) \S+$", reply.text, re.M)
    return [n for n in names if not n.endswith("_created")]


async def test_every_service_names_its_metrics_asyncrl_component(tiny_checkpoint, redis_server, run_name, tmp_path):
    import torch

    from trainer.actor import Trainer

    torch.set_num_threads(1)
    engine = start_engine(tiny_checkpoint, tmp_path, name="engine")
    gateway = ServiceProcess("gateway.server", ["--engine", engine.url, "--redis-url", redis_server.url, "--run",
                                                run_name], tmp_path, name="gateway")
    orch = Orchestrator(tmp_path, redis_server.url, run_name, "--gateway", gateway.url, "--group-size", "2",
                        "--max-groups", "1", "--sampling", '{"max_new_tokens": 4}')
    envs = start_envs(tmp_path, 1, "--capacity", "4", "--option", "sleep_s=0.1", "--option", "llm_turns=1",
                      "--orchestrator", orch.url, "--log-level", "WARNING")
    trainer = None
    try:
        orch.wait_done(1, timeout_s=120)
        trainer = Trainer(TrainerConfig(groups_per_step=1, staleness_tau=100), load_model_section("tiny"),
                          redis_server.url, run_name, str(tmp_path / "trainer"))
        assert (await trainer.step())["step"] == 1  # the group the services produced

        served = {"engine": families(engine.url), "gateway": families(gateway.url), "orchestrator": families(orch.url),
                  "env": families(envs[0].url), "trainer": families(trainer.metrics_url)}
        store = Store.connect(redis_server.url, run_name)
        services = await store.redis.hgetall(store.key("services"))
        await store.close()
        assert services[b"trainer_metrics"].decode() == trainer.metrics_url
    finally:
        if trainer is not None:
            await trainer.close()
        for env in envs:
            env.stop()
        orch.stop()
        gateway.stop()
        engine.stop()

    wrong = {component: [n for n in names if not n.startswith(COMPONENT_PREFIXES[component])]
             for component, names in served.items()}
    assert all(served.values()) and not any(wrong.values()), wrong
    docs = (ROOT / "docs" / "run.md").read_text()
    section = docs[docs.index("## Metrics"):]
    undocumented = sorted(n for names in served.values() for n in names if f"`{n}" not in section)
    assert not undocumented, f"served but not listed in docs/run.md's Metrics section: {undocumented}"
