"""The built-in engine against its contract (docs/protocols/engine.md): every endpoint, over real HTTP,
checked against the model."""

import asyncio
from itertools import accumulate

import httpx
import orjson
import pytest
import torch

from asyncrl.engine_client import LONG_PROMPT_IDS, EngineClient, EngineError, generate_content
from tests.rollout.conftest import argmax_continuation, start_engine, teacher_forced
from tests.services import unpublished_bodies

PROMPT = [1006, 1008, 1011, 10, 72, 101, 108, 108, 111, 1012]


async def post(url, path, body):
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(url + path, json=body)


async def test_health_info_loads_and_metrics(engine, client):
    assert await client.health() and await client.health_generate()
    info = await client.model_info()
    assert info["is_generation"] and info["weight_version"] == "0" and info["model_path"]
    async with httpx.AsyncClient() as http:
        assert (await http.get(engine.url + "/model_info")).json() == info
        server = (await http.get(engine.url + "/server_info")).json()
        metrics = (await http.get(engine.url + "/metrics")).text
    assert server["max_total_num_tokens"] == 32768 and "version" in server
    loads = await client.loads()
    assert loads.loads[0].num_running_reqs == 0 and loads.loads[0].dp_rank == 0
    assert "sglang_generation_tokens_total" in metrics
    assert {"sglang_num_running_reqs 0.0", "sglang_num_queue_reqs 0.0"} <= set(metrics.splitlines())
    assert any(line.startswith("sglang_token_usage ") for line in metrics.splitlines())


async def test_openapi_publishes_every_request_body(engine):
    async with httpx.AsyncClient() as http:
        openapi = (await http.get(engine.url + "/openapi.json")).json()
    assert unpublished_bodies(openapi, frozenset({"POST /continue_generation", "POST /flush_cache"})) == []
    generate = openapi["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"input_ids", "sampling_params"} <= set(generate["properties"])


async def test_greedy_equals_argmax_and_logprobs_equal_teacher_forcing(client, reference_model):
    out = await client.generate(PROMPT, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert out.output_ids == argmax_continuation(reference_model, PROMPT, 24)
    got = torch.tensor([lp for lp, _, _ in out.meta_info.output_token_logprobs])
    ref = teacher_forced(reference_model, PROMPT, out.output_ids)
    assert (got - ref).abs().max() <= 1e-5
    assert out.meta_info.finish_reason == {"type": "length", "length": 24}
    assert out.meta_info.weight_versions[0].model_dump() == {"version": "0", "start": 0, "end": 24}


async def test_prompt_logprobs_and_top_logprobs(client, reference_model):
    out = await client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 1},
                                logprob_start_len=0, top_logprobs_num=3)
    entries = out.meta_info.input_token_logprobs
    assert entries[0] == [None, PROMPT[0], None] and [e[1] for e in entries] == PROMPT
    ref = teacher_forced(reference_model, PROMPT[:1], PROMPT[1:])
    assert (torch.tensor([e[0] for e in entries[1:]]) - ref).abs().max() <= 1e-5
    assert all(len(top) == 3 for top in out.meta_info.output_top_logprobs)
    top0 = out.meta_info.output_top_logprobs[0]
    assert top0[0][0] >= top0[1][0] >= top0[2][0]
    late = await client.generate(PROMPT, {"max_new_tokens": 1}, logprob_start_len=4)
    assert [e[1] for e in late.meta_info.input_token_logprobs] == PROMPT[4:]


async def test_batch_text_and_stop_rules(engine, client):
    batch = (await post(engine.url, "/generate", {
        "input_ids": [PROMPT, PROMPT[:4]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}]})).json()
    assert isinstance(batch, list) and [len(b["output_ids"]) for b in batch] == [2, 5]
    text = (await post(engine.url, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})).json()
    assert isinstance(text["text"], str) and text["meta_info"]["prompt_tokens"] > 0
    free = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    stop_at = free.output_ids[5]
    stopped = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at]})
    first = free.output_ids.index(stop_at)
    assert stopped.output_ids == free.output_ids[:first + 1]  # the stop token is kept in output_ids
    assert stopped.meta_info.finish_reason == {"type": "stop", "matched": stop_at}
    held = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at],
                                          "min_new_tokens": first + 2})
    assert len(held.output_ids) > first + 1 and stop_at not in held.output_ids[:first + 2]
    nothing = await client.generate(PROMPT, {"max_new_tokens": 0}, logprob_start_len=0)
    assert nothing.output_ids == [] and len(nothing.meta_info.input_token_logprobs) == len(PROMPT)


async def test_stop_string_trims_text(engine):
    free = (await post(engine.url, "/generate", {"text": "abc", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}})).json()
    text = free["text"]
    stop = text[6:8] if len(text) >= 8 else text[-2:]
    out = (await post(engine.url, "/generate", {"text": "abc", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop], "skip_special_tokens": False}})).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])


async def test_parallel_samples_fan_out_from_one_cached_prefill(engine, client):
    """SGLang's n: a list of n samples per prompt (prompt-major), each prefilled from the prompt's cached KV;
    with a sampling_seed, sample j is the request seeded seed + j."""
    history = [1006, 1008, *range(200, 260)]
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    four = await client.generate_samples(history, params, 4, rid="grpo")
    assert [o.meta_info.id for o in four] == ["grpo-0", "grpo-1", "grpo-2", "grpo-3"]
    assert all(o.meta_info.cached_tokens >= len(history) - 1 for o in four)
    for j, sample in enumerate(four):
        alone = await client.generate(history, {**params, "sampling_seed": 7 + j})
        assert sample.output_ids == alone.output_ids and sample.meta_info.output_token_logprobs is not None
    assert len({tuple(o.output_ids) for o in four}) > 1
    batch = (await post(engine.url, "/generate", {"input_ids": [PROMPT, history], "sampling_params": {**params, "n": 2}})).json()
    assert [b["output_ids"] for b in batch[2:]] == [four[0].output_ids, four[1].output_ids]  # prompt-major
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", engine.url + "/generate", json={
                "input_ids": PROMPT, "sampling_params": {**params, "n": 2}, "stream": True}) as response:
            events = [orjson.loads(line[6:]) async for line in response.aiter_lines()
                      if line.startswith("data: {")]
    finals = {e["index"]: e["output_ids"] for e in events if e["meta_info"]["finish_reason"]}
    assert finals == {0: batch[0]["output_ids"], 1: batch[1]["output_ids"]}  # streamed: each sample by index
    mixed = await post(engine.url, "/generate", {"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 2}, {"n": 3}]})
    assert mixed.status_code == 400 and "same n" in mixed.json()["error"]
    assert (await post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"n": 0}})).status_code == 400


async def test_sampling_seed_reproduces_under_concurrent_load(client):
    params = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 0.95, "sampling_seed": 1234, "ignore_eos": True}
    alone = await client.generate(PROMPT, params)
    noise = [client.generate(PROMPT[: 2 + i % 7], {"max_new_tokens": 10 + i, "temperature": 1.0}) for i in range(24)]
    loaded, *_ = await asyncio.gather(client.generate(PROMPT, params), *noise)
    assert loaded.output_ids == alone.output_ids
    assert [e[0] for e in loaded.meta_info.output_token_logprobs] == pytest.approx(
        [e[0] for e in alone.meta_info.output_token_logprobs], abs=1e-5)


async def test_128_concurrent_mixed_lengths_complete_correctly(client, reference_model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(torch.randint(1, 160, (1,), generator=g)),), generator=g).tolist()
               for _ in range(128)]
    budgets = [int(torch.randint(1, 48, (1,), generator=g)) for _ in range(128)]
    outs = await asyncio.gather(*(client.generate(p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True,
                                                      "sampling_seed": i})
                                  for i, (p, n) in enumerate(zip(prompts, budgets))))
    assert [len(o.output_ids) for o in outs] == budgets
    worst = 0.0
    for i in range(0, 128, 9):  # teacher-force a sample of them: batch composition must not matter
        got = torch.tensor([e[0] for e in outs[i].meta_info.output_token_logprobs])
        worst = max(worst, float((got - teacher_forced(reference_model, prompts[i], outs[i].output_ids)).abs().max()))
    assert worst <= 1e-5, worst


async def test_prefix_cache_reuses_shared_prefix(client, reference_model):
    history = PROMPT * 6
    first = await client.generate(history, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    turn2 = history + first.output_ids + [1013, 40, 41]
    second = await client.generate(turn2, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert second.meta_info.cached_tokens >= len(history)
    got = torch.tensor([e[0] for e in second.meta_info.output_token_logprobs])
    assert (got - teacher_forced(reference_model, turn2, second.output_ids)).abs().max() <= 1e-5


async def test_streaming_sends_cumulative_snapshots(client):
    snapshots = [s async for s in client.generate_stream(PROMPT, {"max_new_tokens": 6, "temperature": 0,
                                                                  "ignore_eos": True})]
    lengths = [len(s.output_ids) for s in snapshots]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(snapshots) >= 2
    assert snapshots[-1].meta_info.finish_reason["type"] == "length"


async def test_neutral_values_of_unsupported_sglang_options_are_accepted(engine):
    body = {"input_ids": PROMPT, "lora_path": None, "return_hidden_states": False, "sampling_params": {
        "max_new_tokens": 2, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0, "regex": None}}
    assert (await post(engine.url, "/generate", body)).status_code == 200


async def test_stream_interval_sends_the_first_token_then_every_nth(tiny_checkpoint, tmp_path):
    """SGLang's --stream-interval: fewer SSE events for the same tokens."""
    proc = start_engine(tiny_checkpoint, tmp_path, "--stream-interval", "4")
    try:
        async with EngineClient(proc.url, timeout_s=60) as c:
            params = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}
            lengths = [len(s.output_ids) async for s in c.generate_stream(PROMPT, params)]
            whole = await c.generate(PROMPT, params)
            last = [s async for s in c.generate_stream(PROMPT, params)][-1]
    finally:
        assert proc.stop() == 0, proc.log()
    # [1, 4, 8, 12, 13] unless a slow client had events merged (merging keeps the newest)
    assert lengths[-1] == 13 and len(lengths) >= 2 and all(n == 1 or n % 4 == 0 for n in lengths[:-1])
    assert last.output_ids == whole.output_ids and last.text == whole.text


async def test_incremental_streaming_output_sends_only_new_output(tiny_checkpoint, tmp_path):
    """SGLang's --incremental-streaming-output: each event carries the tokens, text and log-probs since the
    previous one; the events add up to the unstreamed response, and EngineClient reads them as snapshots."""
    proc = start_engine(tiny_checkpoint, tmp_path, "--incremental-streaming-output")
    params = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.get(proc.url + "/get_server_info")).json()["incremental_streaming_output"] is True
            body = {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True, "stream": True}
            async with http.stream("POST", proc.url + "/generate", json=body) as response:
                events = [orjson.loads(line[6:]) async for line in response.aiter_lines()
                          if line.startswith("data: {")]
            batch = {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": params, "stream": True}
            async with http.stream("POST", proc.url + "/generate", json=batch) as response:
                batch_events = [orjson.loads(line[6:]) async for line in response.aiter_lines()
                                if line.startswith("data: {")]
        async with EngineClient(proc.url, timeout_s=60) as c:
            whole = await c.generate(PROMPT, params)
            short = await c.generate(PROMPT[:5], params)
            snapshots = [s async for s in c.generate_stream(PROMPT, params)]
    finally:
        assert proc.stop() == 0, proc.log()
    assert len(events) >= 2 and sum(len(e["output_ids"]) for e in events) == 20
    assert [e["meta_info"]["completion_tokens"] for e in events] == list(accumulate(len(e["output_ids"]) for e in events))
    assert all(len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]) for e in events)
    assert [t for e in events for t in e["output_ids"]] == whole.output_ids
    assert "".join(e["text"] for e in events) == whole.text
    streamed = torch.tensor([e[0] for ev in events for e in ev["meta_info"]["output_token_logprobs"]])
    unstreamed = torch.tensor([e[0] for e in whole.meta_info.output_token_logprobs])
    assert (streamed - unstreamed).abs().max() <= 1e-5  # a cached prefix changes the prefill's rounding only
    for index, alone in enumerate((whole, short)):  # a batch streams each prompt's deltas under its index
        mine = [e for e in batch_events if e["index"] == index]
        assert [t for e in mine for t in e["output_ids"]] == alone.output_ids
        assert "".join(e["text"] for e in mine) == alone.text
    lengths = [len(s.output_ids) for s in snapshots]
    assert lengths == sorted(lengths) and lengths[-1] == 20
    last = snapshots[-1]
    assert last.output_ids == whole.output_ids and last.text == whole.text
    assert [e[1] for e in last.meta_info.output_token_logprobs] == whole.output_ids
    assert (torch.tensor([e[0] for e in last.meta_info.output_token_logprobs]) - unstreamed).abs().max() <= 1e-5
    assert last.meta_info.weight_versions == whole.meta_info.weight_versions


MALFORMED_GENERATE = [
    (b'{"input_ids": [1, 2', "malformed JSON"),
    (b'{"sampling_params": {}}', "exactly one of 'text' or 'input_ids'"),
    (b'{"input_ids": [1], "text": "x"}', "exactly one of 'text' or 'input_ids'"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": ["a"]}', "input_ids"),
    (b'{"input_ids": [99999]}', "outside the vocabulary"),
    (b'{"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 5}', "logprob_start_len"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}}', "context length"),
    (b'{"input_ids": [[1], [2]], "rid": "same"}', "'rid' must be a list"),
    (b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}', "repetition_penalty: not supported"),
    (b'{"input_ids": [1], "sampling_params": {"json_schema": "{}"}}', "json_schema: not supported"),
    (b'{"input_ids": [1], "lora_path": "adapter"}', "lora_path: not supported"),
    (b'{"input_ids": [1, 2], "return_routed_experts": true}', "--enable-return-routed-experts"),
    (b'{"input_ids": [[1], [2]], "return_routed_experts": [true]}', "'return_routed_experts' has 1 entries"),
    (b'{"input_ids": [1], "sampling_params": {"sampling_seed": -1}}', "sampling_seed"),
    (b'{"input_ids": [1], "sampling_params": {"sampling_seed": 18446744073709551616}}', "sampling_seed"),
    (b'{"input_ids": [1], "sampling_params": {"sampling_seed": 1.5}}', "sampling_seed"),
    (b'{"input_ids": [1, true]}', "input_ids"),
    (b'{"input_ids": [1, -3]}', "input_ids"),
    (b'{"input_ids": [[1], [2, false]]}', "input_ids"),
    (b'{"input_ids": [1], "logprob_start_len": -2}', "logprob_start_len"),
    (b'{"input_ids": [1], "top_logprobs_num": -1}', "top_logprobs_num"),
    (b'{"input_ids": [1], "top_logprobs_num": 1000000}', "top_logprobs_num"),
    (b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}', "stop_token_ids"),
    (b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [99999]}}', "stop_token_ids"),
    (b'{"input_ids": [1], "sampling_params": {"stop": [""]}}', "stop"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": "1"}}', "temperature"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": true}}', "max_new_tokens"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": -2}}', "top_k"),
    (b'{"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}', "ignore_eos"),
    (b'{"input_ids": [1], "sampling_params": {"n": 5000}}', "n"),
    (b'{"input_ids": [1], "stream": 1}', "stream"),
    (b'{"input_ids": [1], "return_logprob": "true"}', "return_logprob"),
    (b'{"text": 5}', "text"),
    (b'{"input_ids": [1], "rid": 7}', "rid"),
]


@pytest.mark.parametrize("body, field", MALFORMED_GENERATE)
async def test_malformed_generate_is_a_400_naming_the_problem(engine, body, field):
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(engine.url + "/generate", content=body)
    assert response.status_code == 400
    assert field in response.json()["error"]


async def test_a_long_request_runs_on_undisturbed_while_malformed_ones_are_refused(engine, client):
    """Every malformed request of the list above, sent while a long greedy one is generating: each is a
    400, and the long one finishes with the tokens it makes alone, in one piece (nothing aborted it)."""
    greedy = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}
    alone = await client.generate(PROMPT, greedy)
    running = asyncio.create_task(client.generate(PROMPT, greedy))
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(3):
            for body, field in MALFORMED_GENERATE:
                response = await http.post(engine.url + "/generate", content=body)
                assert response.status_code == 400 and field in response.json()["error"], (body, response.text)
    assert not running.done(), "the long request ended before the malformed ones were all sent"
    together = await running
    assert together.output_ids == alone.output_ids and together.meta_info.finish_reason["type"] == "length"


@pytest.mark.parametrize("path, body, field", [
    ("/abort_request", {}, "rid"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/no/such/dir"}, "No such file"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "cuda_ipc"}, "load_format"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, "no weights update group"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [[1]]}, "same length"),
    ("/release_memory_occupation", {"tags": ["kv_cache", "gpu"]}, "unknown ['gpu']"),
    ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
    ("/update_weight_version", {"abort_all_requests": False}, "new_version"),
    ("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 0}, "truncate_size"),
    ("/destroy_weights_update_group", {"group_name": "nope"}, "no weights update group"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors[0]"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["aGVsbG8gd29ybGQ="]}, "safetensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [1]}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["", ""]}, "one entry"),
    ("/update_weights_from_tensor", [], "body"),
    ("/init_weights_update_group", {"master_address": "no-such-host.invalid", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2}, "does not resolve"),
    ("/init_weights_update_group", {"master_address": "", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 2,
                                    "world_size": 2}, "rank_offset 2 must be below world_size 2"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 1}, "world_size"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float99"], "shapes": [[1]]}, "dtypes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes"),
    ("/get_weights_by_name", {"name": 5}, "name"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
])
async def test_malformed_control_requests_are_400s(engine, path, body, field):
    response = await post(engine.url, path, body)
    assert response.status_code == 400
    payload = response.json()
    assert field in (payload.get("error") or payload.get("message")), payload


async def test_flush_cache(engine):
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.post(engine.url + "/flush_cache")).status_code == 200
        assert (await http.get(engine.url + "/flush_cache")).text.startswith("Cache flushed")


async def test_client_errors_are_typed(client):
    with pytest.raises(EngineError) as info:
        await client.generate([99999], {"max_new_tokens": 1})
    assert info.value.status == 400 and "vocabulary" in info.value.message


async def test_a_long_prompt_is_serialized_in_chunks_the_engine_reads_whole(client):
    """Prompts past LONG_PROMPT_IDS are serialized off the event loop, a chunk per call: the bytes are
    orjson's own, and the engine reads all the ids (its refusal counts them against its context length)."""
    for n in (LONG_PROMPT_IDS + 1, 2 * LONG_PROMPT_IDS, 3 * LONG_PROMPT_IDS + 7):
        body = {"input_ids": [i % 1000 for i in range(n)], "sampling_params": {"max_new_tokens": 1}, "rid": "r"}
        assert await generate_content(body) == orjson.dumps(body)
    with pytest.raises(EngineError) as refused:
        await client.generate(body["input_ids"], {"max_new_tokens": 1})
    assert refused.value.status == 400 and f"prompt ({n})" in refused.value.message, refused.value.message
