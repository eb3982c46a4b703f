"""Every field of the run's sampling config reaches the engines, in both modes: launcher -> orchestrator
config -> gateway session defaults -> the engine's sampling params of a turn whose agent sends none (the
endpoint of a gateway session carries no sampling), and, without a gateway (sessions=endpoint), through
the env's LLM endpoint and the agent's request. The test walks the dataclass, so a new field fails here
until it is carried."""

from dataclasses import fields

import pytest
from hydra import compose, initialize_config_dir

from asyncrl.config import RolloutConfig, RunConfig, SamplingConfig, register_configs, to_dataclass
from asyncrl.protocols.engine import SamplingParams as EngineSampling
from asyncrl.protocols.gateway import ChatCompletionRequest
from asyncrl_run.launcher import orchestrator_section, write_config
from envs.sdk.base import EpisodeContext
from gateway.openai_api import chat_sampling, turn_sampling
from gateway.sampling import check_sampling
from orchestrator.server import parse_args
from orchestrator.sampling import endpoint_sampling, session_sampling
from tests.services import ROOT

VALUES = {"temperature": 0.6, "top_p": 0.85, "top_k": 7, "min_p": 0.05, "max_new_tokens": 33, "allow_truncation": True}
"""A value other than the default for every SamplingConfig field."""
POLICY_FIELDS = {"allow_truncation"}
"""Fields that configure the gateway session, not the engine."""


def test_every_field_has_a_value_here():
    assert set(VALUES) == {f.name for f in fields(SamplingConfig)}, "add the new field to VALUES and carry it"
    assert all(VALUES[f.name] != f.default for f in fields(SamplingConfig))


def agent_request(context: EpisodeContext) -> ChatCompletionRequest:
    """What the OpenAI client of an env's agent sends: the typed arguments plus extra_body, merged."""
    args = context.completion_args()
    body = {k: v for k, v in args.items() if k not in ("model", "extra_body")} | args.get("extra_body", {})
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_sampling_field_reaches_the_engine(mode, tmp_path):
    run = RunConfig(mode=mode, rollout=RolloutConfig(sampling=SamplingConfig(**VALUES)))
    orchestrator, _ = parse_args(write_config(tmp_path, "orchestrator",
                                              orchestrator_section(run, "redis://127.0.0.1:1", "http://127.0.0.1:2")))
    assert orchestrator.sampling == run.rollout.sampling

    session = session_sampling(orchestrator.sampling, seed=5)
    assert session.allow_truncation is True
    endpoint = endpoint_sampling(orchestrator.sampling)
    context = EpisodeContext("e", "t", 0, 1, 60.0, "asyncrl", endpoint.model_dump())
    engine_fields = set(VALUES) - POLICY_FIELDS
    request = agent_request(context)  # sessions=endpoint has no gateway defaults: the request alone carries them
    assert {name: getattr(request, "max_tokens" if name == "max_new_tokens" else name) for name in engine_fields} \
        == {k: VALUES[k] for k in engine_fields}
    silent = agent_request(EpisodeContext("e", "t", 0, 1, 60.0, "asyncrl"))  # a gateway session's endpoint: none
    assert all(getattr(silent, name) is None for name in ("temperature", "top_p", "max_tokens"))
    for params in (chat_sampling(request, session, 0, [1]),  # an agent's chat turn that sets every field
                   chat_sampling(silent, session, 0, [1]),   # an agent's chat turn that sets none
                   turn_sampling(session, 0)):               # a token-native turn that sets nothing itself
        check_sampling(params, session.allow_truncation)
        engine = EngineSampling.model_validate(params)
        assert {name: getattr(engine, name) for name in engine_fields} == {k: VALUES[k] for k in engine_fields}


def test_hydra_config_with_truncation_needs_the_flag():
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        refused = compose("config", overrides=["experiment=tiny_demo", "rollout.sampling.top_p=0.9"])
        with pytest.raises(ValueError, match=r"top_p=0.9 .*rollout.sampling.allow_truncation=true"):
            to_dataclass(refused)
        allowed = compose("config", overrides=["experiment=tiny_demo", "rollout.sampling.min_p=0.1",
                                               "rollout.sampling.allow_truncation=true"])
        assert to_dataclass(allowed).rollout.sampling.min_p == 0.1


def test_the_orchestrator_refuses_a_sampling_key_it_does_not_know(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--redis-url", "redis://127.0.0.1:1", "--gateway", "http://127.0.0.1:2",
                    "--sampling", '{"top_q": 0.5}'])
    err = capsys.readouterr().err
    assert "argument --sampling" in err and "'top_q'" in err
