"""A randomized soak of one engine: mixed requests (plain, streamed incrementally, n > 1; sampling
options, stop strings, log-prob ranges) from many clients while a chaos client pauses in every mode,
updates and relabels weights, aborts everything and flushes the cache. Whatever interleaving happens,
every request must come back whole and self-consistent, and the engine must end idle and healthy."""

from __future__ import annotations

import asyncio
import random
import time

from asyncrl.engine_client import EngineClient, EngineError
from tests.rollout.conftest import start_engine

CLIENTS, SECONDS = 12, 20.0


def inconsistencies(out, params: dict) -> list[str]:
    """What is wrong with one finished response (empty: nothing)."""
    meta, n = out.meta_info, len(out.output_ids)
    problems = []
    if meta.finish_reason is None:
        return ["no finish_reason"]
    if meta.completion_tokens != n:
        problems.append(f"completion_tokens {meta.completion_tokens} for {n} tokens")
    if meta.output_token_logprobs is not None and len(meta.output_token_logprobs) != n:
        problems.append(f"{len(meta.output_token_logprobs)} log-probs for {n} tokens")
    spans = meta.weight_versions
    if n and (spans[0].start != 0 or spans[-1].end != n or any(a.end != b.start for a, b in zip(spans, spans[1:]))):
        problems.append(f"weight_versions {spans} do not tile {n} tokens")
    kind = meta.finish_reason["type"]
    if kind == "length" and n != params["max_new_tokens"] or n > params["max_new_tokens"]:
        problems.append(f"{n} tokens, finish {kind}, max_new_tokens {params['max_new_tokens']}")
    if kind == "stop" and n < params.get("min_new_tokens", 0):
        problems.append(f"stopped after {n} < min_new_tokens tokens")
    return problems


def random_request(rng: random.Random) -> tuple[list[int], dict]:
    prompt = [1006, 1008] + [rng.randrange(0, 1000) for _ in range(rng.randrange(1, 120))]
    params = {"max_new_tokens": rng.choice([1, 3, 17, 64, 150]), "temperature": rng.choice([0, 0.7, 1.0]),
              "sampling_seed": rng.randrange(1 << 30)}
    for key, values, chance in (("top_p", [0.5, 0.9], 0.3), ("top_k", [1, 5, 50], 0.2), ("stop", [["a"], ["e "]], 0.2),
                                ("ignore_eos", [True], 0.5)):
        if rng.random() < chance:
            params[key] = rng.choice(values)
    if rng.random() < 0.2:
        params["min_new_tokens"] = min(params["max_new_tokens"], 5)
    return prompt, params


async def client_loop(url: str, seed: int, until: float, problems: list, done: list) -> None:
    rng = random.Random(seed)
    async with EngineClient(url, timeout_s=120) as client:
        while time.monotonic() < until:
            prompt, params = random_request(rng)
            kind = rng.random()
            if kind < 0.35:
                snapshots = [s async for s in client.generate_stream(prompt, params)]
                lengths = [len(s.output_ids) for s in snapshots]
                outs = snapshots[-1:]
                if lengths != sorted(lengths):
                    problems.append(f"stream lengths {lengths}")
            elif kind < 0.5:
                outs = await client.generate_samples(prompt, params, rng.choice([2, 3]))
            else:
                outs = [await client.generate(prompt, params, logprob_start_len=rng.choice([-1, 0, 1]),
                                              top_logprobs_num=rng.choice([0, 3]))]
            for out in outs:
                problems += [f"{p} ({params})" for p in inconsistencies(out, params)]
            done.append(len(outs))


async def chaos_loop(url: str, checkpoint: str, until: float, actions: list) -> None:
    rng = random.Random(99)
    async with EngineClient(url, timeout_s=120) as client:
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(0.3, 1.2))
            action = rng.choice(["pause", "update", "relabel", "abort", "flush"])
            if action == "pause":
                await client.pause(rng.choice(["abort", "retract", "in_place"]))
                await asyncio.sleep(0.2)
                await client.resume()
            elif action == "update":
                await client.pause("in_place")
                await client.update_weights_from_disk(checkpoint, weight_version=str(rng.randrange(100)))
                await client.resume()
            elif action == "relabel":
                await client.update_weight_version(str(rng.randrange(100)), abort_all_requests=rng.random() < 0.5)
            elif action == "abort":
                await client.abort(abort_all=True)
            else:
                await client.flush_cache()  # a 400 while requests run is the expected answer; both are fine
            actions.append(action)


async def test_random_traffic_under_chaos_keeps_every_response_consistent(tiny_checkpoint, tmp_path):
    proc = start_engine(tiny_checkpoint, tmp_path, "--incremental-streaming-output", "--max-total-tokens", "4000",
                        "--max-running-requests", "16")
    problems: list[str] = []
    done: list[int] = []
    actions: list[str] = []
    try:
        until = time.monotonic() + SECONDS
        try:
            await asyncio.gather(*(client_loop(proc.url, i, until, problems, done) for i in range(CLIENTS)),
                                 chaos_loop(proc.url, str(tiny_checkpoint), until, actions))
        except EngineError as err:  # a 4xx here would be a request the engine should have taken
            problems.append(f"engine refused: {err}")
        async with EngineClient(proc.url) as client:
            assert await client.health_generate()
            loads = (await client.loads()).loads[0]
    finally:
        assert proc.stop() == 0, proc.log()
    assert problems == []
    assert (loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens) == (0, 0, 0)
    assert sum(done) > 100 and len(set(actions)) >= 4, (sum(done), actions)
    assert "Traceback" not in proc.log_path.read_text(errors="replace")  # no step failed, no handler crashed
