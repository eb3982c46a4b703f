"""return_routed_experts (rollout routing replay, R3) against an engine started with --enable-return-routed-experts.

Each finished request's meta_info.routed_experts must name, for every token that went through a forward
(prompt + output less the last token) and every MoE layer, the experts the model's router picks for that
token when the whole sequence is run at once: whatever the batch it shared, the prefix cache or the
chunked prefill. SGLang's layout: base64 of int32 [tokens, layers, top_k]."""

import asyncio

import httpx
import orjson
import pytest
import torch

from asyncrl.engine_client import EngineClient
from asyncrl.engine_response import routed_experts
from asyncrl.protocols.engine import GenerateResponse
from tests.rollout.conftest import assert_routing_replays, start_engine

@pytest.fixture(scope="module")
def routing_engine(tiny_checkpoint, tmp_path_factory):
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("routing"), "--enable-return-routed-experts",
                        "--chunked-prefill-size", "48", name="routing-engine")
    yield proc
    assert proc.stop() == 0, proc.log()


def check_routing(model, prompt: list[int], out: GenerateResponse) -> int:
    """The response's routing against a whole-sequence forward; -> near-ties (assert_routing_replays)."""
    config = model.config
    tokens = (prompt + out.output_ids)[:-1]
    got = routed_experts(out.meta_info, len(tokens)).reshape(-1, config.num_hidden_layers, config.num_experts_per_tok)
    return assert_routing_replays(model, tokens, torch.from_numpy(got.copy()))


async def test_routing_of_concurrent_requests_equals_a_whole_sequence_forward(routing_engine, reference_model):
    """Two waves of concurrent requests of mixed lengths (several past index_topk, chunked prefills): the
    second continues the first's conversations, so its prefixes come from the radix cache, whose routing
    rows were written by the first wave. Plus n > 1 and a stream."""
    base = [1006, 1008] + list(range(40, 100))
    prompts = [base[: 5 + 7 * i] for i in range(8)] + [base + list(range(200, 200 + 11 * i)) for i in range(8)]
    async with EngineClient(routing_engine.url, timeout_s=120) as client:
        def wave(prompts):
            return [client.generate(p, {"max_new_tokens": 8 + 5 * (i % 6), "sampling_seed": i},
                                    return_routed_experts=True) for i, p in enumerate(prompts)]
        first = await asyncio.gather(*wave(prompts))
        follow_ups = [p + out.output_ids + [1011, 60 + i] for i, (p, out) in enumerate(zip(prompts, first))]
        pairs = client.generate_samples(base + [7, 8], {"max_new_tokens": 12, "sampling_seed": 3}, 2,
                                        return_routed_experts=True)
        *second, samples = await asyncio.gather(*wave(follow_ups), pairs)
        snapshots = [s async for s in client.generate_stream(base[:30], {"max_new_tokens": 16, "sampling_seed": 5},
                                                             return_routed_experts=True)]
    ties = sum(check_routing(reference_model, p, out) for p, out in zip(prompts + follow_ups, first + second))
    ties += sum(check_routing(reference_model, base + [7, 8], out) for out in samples)
    assert all(s.meta_info.routed_experts is None for s in snapshots[:-1])  # as SGLang: the final event only
    ties += check_routing(reference_model, base[:30], snapshots[-1])
    assert all(out.meta_info.cached_tokens > len(p) // 2 for p, out in zip(follow_ups, second))
    assert ties <= 3  # near-ties are rare: a systematic error fails the asserts above instead


async def test_batch_flags_per_prompt_and_zero_new_tokens(routing_engine, reference_model):
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(routing_engine.url + "/generate", json={
            "input_ids": [[1006, 5, 6, 7], [1006, 8, 9]], "return_routed_experts": [True, False],
            "sampling_params": [{"max_new_tokens": 0}, {"max_new_tokens": 4}]})
    assert response.status_code == 200, response.text
    first, second = (GenerateResponse.model_validate(o) for o in orjson.loads(response.content))
    assert second.meta_info.routed_experts is None
    assert first.output_ids == [] and check_routing(reference_model, [1006, 5, 6, 7], first) == 0  # 3 rows


async def test_routing_survives_retraction(tiny_checkpoint, tmp_path, reference_model):
    """A pool of 1,200 tokens for 12 requests of ~150 tokens: retracted requests resume (their KV partly from
    the radix cache, partly recomputed) and still report the routing of a whole-sequence forward."""
    small = start_engine(tiny_checkpoint, tmp_path, "--max-total-tokens", "1200", "--enable-return-routed-experts",
                         name="small-routing")
    try:
        prompts = [[1006, 1008] + [100 + i] * 48 for i in range(12)]
        async with EngineClient(small.url, timeout_s=300) as client:
            outs = await asyncio.gather(*(client.generate(p, {"max_new_tokens": 100, "ignore_eos": True,
                                                              "sampling_seed": i}, return_routed_experts=True)
                                          for i, p in enumerate(prompts)))
        assert "retracted" in small.log()
        assert sum(check_routing(reference_model, p, out) for p, out in zip(prompts, outs)) <= 3
    finally:
        small.stop()
