"""Routing replay through the gateway: with --routing-replay it asks the engine for every call's routed
experts and stores them with the samples, row t = the experts the engine sent token t to."""

import base64

import numpy as np
import pytest
import torch

from asyncrl.protocols.engine import GenerateResponse
from gateway.generation import EngineRequestError, engine_call
from tests.gateway.conftest import GatewayClient, start_gateway
from tests.rollout.conftest import assert_routing_replays, start_engine


@pytest.fixture(scope="module")
def routing_gateway(tiny_checkpoint, redis_server, gateway_run, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gw-routing")
    engine = start_engine(tiny_checkpoint, workdir, "--enable-return-routed-experts", "--incremental-streaming-output",
                          name="engine-routing")
    gateway = start_gateway(workdir, [engine], redis_server.url, gateway_run, "--routing-replay", name="gateway-routing")
    yield gateway
    assert gateway.stop() == 0, gateway.log()
    assert engine.stop() == 0, engine.log()


def assert_sample_routing(model, sample) -> int:
    """Every row but the last (no forward saw the last token) is the routing of a whole-sequence forward."""
    config = model.config
    rows = sample.routed_experts
    assert rows.shape == (sample.num_tokens, config.num_hidden_layers * config.num_experts_per_tok)
    assert (rows[-1] == -1).all()
    got = torch.from_numpy(rows[:-1].astype(np.int32)).view(-1, config.num_hidden_layers, config.num_experts_per_tok)
    return assert_routing_replays(model, sample.tokens[:-1].tolist(), got)


async def test_samples_carry_the_engines_routing(routing_gateway, template, store, openai_client, reference_model):
    client = GatewayClient(routing_gateway.url)
    try:
        token = await client.create(sampling={"sampling_seed": 1})
        params = {"max_new_tokens": 12, "ignore_eos": True}
        first = template.render([{"role": "user", "content": "Count to five."}], add_generation_prompt=True)
        for ids in (first, [1011, 72, 101, 1012, 1014]):  # two token-native turns: one segment
            r = await client.http.post(f"/sessions/{token['session_id']}/generate",
                                       json={"input_ids": ids, "sampling_params": params})
            assert r.status_code == 200, r.text
        chat = await client.create(sampling={"sampling_seed": 2, "max_new_tokens": 10})
        openai = openai_client(base_url=chat["base_url"])
        messages = [{"role": "user", "content": "Hi."}]
        for _ in range(2):  # streamed chat turns: the engine streams, routing comes with its last event
            stream = await openai.chat.completions.create(model="asyncrl", messages=messages, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
        refs = [ref for s in (token, chat) for ref in (await client.finish(s["session_id"], reward=1.0))["sample_refs"]]
    finally:
        await client.close()
    samples = await store.get_samples(refs)
    assert [s.num_turns for s in samples] == [2, 2] and all(len(s.tokens) > 20 for s in samples)
    assert sum(assert_sample_routing(reference_model, s) for s in samples) <= 2


def _response(ids: int, finish: dict, routing: np.ndarray) -> GenerateResponse:
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": ids, "cached_tokens": 0,
            "weight_version": "0", "weight_versions": [{"version": "0", "start": 0, "end": ids}] if ids else [],
            "e2e_latency": 0.0, "output_token_logprobs": [[-1.0, 7, None]] * ids,
            "routed_experts": base64.b64encode(routing.astype(np.int32).tobytes()).decode()}
    return GenerateResponse.model_validate({"output_ids": [7] * ids, "meta_info": meta, "text": ""})


def test_engine_calls_keep_one_row_per_token_and_refuse_other_payloads():
    rows = np.arange(4 * 6).reshape(4, 6)  # prompt 3 + output 2 - 1 rows, 6 ids a row
    call = engine_call("e", _response(2, {"type": "length", "length": 2}, rows), prompt_len=3, wall_s=0.1)
    assert np.array_equal(call.routed_experts, rows)
    aborted = engine_call("e", _response(2, {"type": "abort", "message": "x"}, rows[:2]), prompt_len=3, wall_s=0.1)
    assert aborted.routed_experts is None  # its rows stop where the abort caught it: the next call covers them
    with pytest.raises(EngineRequestError, match="engine e: routed_experts holds 23 expert ids"):
        engine_call("e", _response(2, {"type": "length", "length": 2}, rows.flatten()[:23]), prompt_len=3, wall_s=0.1)
