"""The one sampling policy (asyncrl/sampling.py) and where it is read: a tiny temperature is greedy for the
engine and, for the log-probs, temperature 1 at the gateway alike; what the engine refuses as reshaping is
what the gateway refuses."""

import pytest

from asyncrl.protocols.engine import SamplingParams
from asyncrl.sampling import RESHAPING_SAMPLING, is_truncating, logprob_temperature
from gateway.sampling import SamplingPolicyError, check_sampling


@pytest.mark.parametrize("temperature,expected", [(None, 1.0), (0.0, 1.0), (1e-7, 1.0), (0.5, 0.5), (1.3, 1.3)])
def test_log_probs_of_a_greedy_request_are_at_temperature_1(temperature, expected):
    assert logprob_temperature(temperature) == expected


def test_the_engine_and_the_gateway_agree_on_greedy_and_on_what_reshapes():
    engine = SamplingParams.model_validate({"temperature": 1e-7})
    assert engine.temperature == 0.0  # greedy at the engine ...
    assert logprob_temperature(check_sampling({"temperature": 1e-7}, False)["temperature"]) == 1.0  # ... and here
    assert set(SamplingParams.UNSUPPORTED) == set(RESHAPING_SAMPLING)
    for name, (neutral, _) in RESHAPING_SAMPLING.items():
        bad = 0.5 if name.endswith("penalty") else {"type": "json_object"} if name == "response_format" else "x"
        assert not neutral(bad)
        with pytest.raises(SamplingPolicyError, match=name):
            check_sampling({name: bad}, allow_truncation=True)
        with pytest.raises(ValueError, match=name):
            SamplingParams.model_validate({name: bad})


def test_truncation():
    assert [is_truncating(n, v) for n, v in [("top_p", 0.9), ("top_k", 0), ("top_k", 5), ("min_p", 0.0),
                                             ("temperature", 0.1)]] == [True, False, True, False, False]
