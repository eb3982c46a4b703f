"""Routing replay through the gateway: with --routing-replay it asks the engine for every call's routed
experts and stores them with the samples, row t = the experts the engine sent token t to."""

import numpy as np
import pytest
import torch

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
