"""Speculative decoding in the built-in engine (--speculative-algorithm NEXTN, rollout/drafting.py): the
tokens, log-probs and weight versions it emits are those of decoding without it, under continuous
batching, the radix cache, chunked prefill, retraction, stops and in-place weight updates; sampled
tokens follow the target's distribution exactly; seeded requests reproduce under load."""

import threading

import numpy as np
import pytest
import torch

from asyncrl.model.io import load_pretrained, read_tensors
from asyncrl.protocols.engine import GenerateItem, SamplingParams
from rollout.engine import Engine, EngineArgs
from rollout.request import Req
from rollout.sampler import SamplingBatch
from rollout.speculative import distribution
from tests.rollout.conftest import DRAFT_PROMPTS, teacher_forced

pytestmark = pytest.mark.timeout(300)
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}


def run(engine: Engine, items: list[GenerateItem], timeout: float = 120) -> list[Req]:
    """Submit every item at once (one batch) and wait for all of them."""
    done, lock, finished = threading.Event(), threading.Lock(), set()

    def on_update(req: Req) -> None:
        if req.finished:
            with lock:
                finished.add(req.rid)
                if len(finished) == len(items):
                    done.set()
    reqs = [engine.request(item, on_update) for item in items]
    engine.call(lambda: [engine.scheduler.add(r) for r in reqs])
    assert done.wait(timeout), f"{len(finished)} of {len(items)} finished"
    return reqs


def greedy(rid: str, prompt: list[int], n: int = 32, **sampling) -> GenerateItem:
    return GenerateItem(rid=rid, input_ids=prompt, return_logprob=True,
                        sampling=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **sampling))


@pytest.fixture(scope="module")
def engines(drafting_checkpoint):
    """(spec off, spec on) engines on the drafting checkpoint."""
    pair = [Engine(EngineArgs(model_path=str(drafting_checkpoint), max_total_tokens=16384, **extra)).start()
            for extra in ({}, SPEC)]
    yield pair
    for engine in pair:
        engine.stop()


@pytest.fixture(scope="module")
def model(drafting_checkpoint):
    return load_pretrained(drafting_checkpoint).eval()


def accept_length(reqs: list[Req]) -> float:
    return sum(len(r.output_ids) for r in reqs) / sum(r.spec_verify_ct for r in reqs)


def test_greedy_tokens_logprobs_and_versions_equal_decoding_without_speculation(engines, model):
    """Concurrent requests with stops, max_new_tokens and min_new_tokens inside a verified chain."""
    items = [greedy(f"r{i}", p, n=17 + i % 9) for i, p in enumerate(DRAFT_PROMPTS[:24])]
    plain, spec = (run(e, items) for e in engines)
    ids = plain[0].output_ids
    stop_at = ids[6]  # a stop token the chain verifies mid-way
    # each token first drawn at output position j, as a stop with min_new_tokens = j: allowed from j on, so
    # greedy decoding stops right there; a ban one position too long (inside a verified chain) would not
    edges = [j for j in range(2, len(ids)) if ids[j] not in ids[:j]]
    extra = [greedy("stop", DRAFT_PROMPTS[0], stop_token_ids=[stop_at]),
             greedy("min", DRAFT_PROMPTS[0], stop_token_ids=[stop_at], min_new_tokens=12),
             *[greedy(f"edge{j}", DRAFT_PROMPTS[0], stop_token_ids=[ids[j]], min_new_tokens=j) for j in edges]]
    plain, spec = plain + run(engines[0], extra), spec + run(engines[1], extra)
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason, a.rid
        assert np.abs(np.subtract(b.output_logprobs, a.output_logprobs)).max() <= 1e-5, a.rid
        assert b.output_versions == a.output_versions
        forced = teacher_forced(model, b.prompt, b.output_ids)
        assert (torch.tensor(b.output_logprobs) - forced).abs().max() <= 1e-5, a.rid
    stop, min_new, *edged = spec[-2 - len(edges):]
    assert stop.finish_reason == {"type": "stop", "matched": stop_at} and len(stop.output_ids) == 7
    assert len(min_new.output_ids) > 12
    assert len(edges) >= 4 and [len(r.output_ids) for r in edged] == [j + 1 for j in edges]
    assert accept_length(spec) > 2.0  # drafts were accepted: the rollback paths ran
    assert all(r.spec_verify_ct == 0 for r in plain)


def test_prefix_cache_chunked_prefill_and_retraction_keep_greedy_tokens(drafting_checkpoint, engines):
    """A small pool (retractions), 16-token prefill chunks, and prompts that share cached prefixes."""
    small = Engine(EngineArgs(model_path=str(drafting_checkpoint), max_total_tokens=400, chunked_prefill_size=16,
                              **SPEC)).start()
    try:
        base = DRAFT_PROMPTS[3] * 6
        items = [greedy(f"p{i}", base + DRAFT_PROMPTS[i][:2 + i % 3], n=40) for i in range(12)]
        first = run(small, items[:1])  # cached: later prompts reuse its prefix
        spec = first + run(small, items[1:])
        assert small.scheduler.retractions > 0
        plain = run(engines[0], items)
        for a, b in zip(plain, spec):
            assert b.output_ids == a.output_ids, a.rid
        assert sum(r.cached_tokens for r in spec[1:]) > 0
        assert small.call(lambda: small.scheduler.loads()).result(10)["num_used_tokens"] == 0  # no slot leaked
    finally:
        small.stop()


def _exact(model, reqs: list[Req], position: int, settings: dict) -> tuple[np.ndarray, np.ndarray]:
    """For each request's output token `position`, under the exact target distribution given its prefix
    (teacher-forced): its randomised probability integral transform (Uniform(0, 1) iff the tokens follow
    the distribution), and (whether it is the most likely token, that token's probability)."""
    rng = np.random.default_rng(0)
    pit, top = [], []
    for length in sorted({len(r.prompt) for r in reqs}):  # one forward per prompt length
        group = [r for r in reqs if len(r.prompt) == length]
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt + r.output_ids[:position] for r in group]))[:, -1].float()
        rows = len(group)
        batch = SamplingBatch(temperature=torch.full((rows,), settings.get("temperature", 1.0)),
                              top_p=torch.full((rows,), settings.get("top_p", 1.0)),
                              top_k=torch.full((rows,), settings.get("top_k", -1)), min_p=torch.zeros(rows),
                              seeds=np.zeros(rows, np.uint64), counters=np.zeros(rows, np.uint64))
        probs = distribution(logits, batch).double()
        cdf = probs.cumsum(-1).numpy()
        for row, req in enumerate(group):
            token = req.output_ids[position]
            below = cdf[row, token - 1] if token else 0.0
            pit.append(below + rng.random() * (cdf[row, token] - below))
            top.append((float(token == int(probs[row].argmax())), float(probs[row].max())))
    return np.sort(pit), np.array(top)


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 1.0, "top_k": 8},
                                      {"temperature": 0.7, "top_p": 0.9}], ids=["t1", "top_k", "top_p"])
def test_sampled_tokens_follow_the_target_distribution(engines, model, settings):
    """1200 seeded requests; their verified tokens (output positions 1 and 2: accepted drafts, corrections
    and bonus tokens) against the exact target distribution, each at p = 1e-4: a Kolmogorov-Smirnov test
    of the PIT against Uniform(0, 1), and the count of most likely tokens against its expectation (what
    a wrong acceptance rule shifts most: correcting from p instead of max(0, p - q) fails it)."""
    n = 1200
    items = [GenerateItem(rid=f"s{i}", input_ids=DRAFT_PROMPTS[i % 8],
                          sampling=SamplingParams(max_new_tokens=3, ignore_eos=True, sampling_seed=i, **settings))
             for i in range(n)]
    reqs = run(engines[1], items, timeout=240)
    critical = np.sqrt(-np.log(1e-4 / 2) / (2 * n))
    for position in (1, 2):
        pit, top = _exact(model, reqs, position, settings)
        ks = np.max(np.maximum(np.arange(1, n + 1) / n - pit, pit - np.arange(n) / n))
        z = (top[:, 0].sum() - top[:, 1].sum()) / np.sqrt((top[:, 1] * (1 - top[:, 1])).sum())
        assert ks < critical and abs(z) < 3.9, (position, ks, critical, z)
    assert 1.05 < accept_length(reqs) < 2.95  # drafts were both accepted and rejected (3: all accepted)


def test_seeded_requests_reproduce_under_concurrent_load(engines):
    item = GenerateItem(rid="alone", input_ids=DRAFT_PROMPTS[5],
                        sampling=SamplingParams(max_new_tokens=30, ignore_eos=True, sampling_seed=77, top_k=20))
    alone = run(engines[1], [item])[0]
    load = [GenerateItem(rid=f"l{i}", input_ids=DRAFT_PROMPTS[i], sampling=SamplingParams(
        max_new_tokens=10 + i, ignore_eos=True, sampling_seed=i)) for i in range(30)]
    busy = run(engines[1], load + [item.model_copy(update={"rid": "busy"})])[-1]
    assert busy.output_ids == alone.output_ids and busy.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


def test_an_in_place_weight_update_mid_request_splits_the_version_spans(drafting_checkpoint, tiny_checkpoint_b):
    engine = Engine(EngineArgs(model_path=str(drafting_checkpoint), max_total_tokens=4096, **SPEC)).start()
    try:
        seen, lock = threading.Event(), threading.Lock()
        done = threading.Event()

        def on_update(req: Req) -> None:
            if len(req.output_ids) >= 10:
                seen.set()
            if req.finished:
                done.set()
        req = engine.submit(engine.request(greedy("long", DRAFT_PROMPTS[1], n=200), on_update))
        assert seen.wait(60)
        tensors = read_tensors(tiny_checkpoint_b)
        engine.update_weights(lambda: tensors, strict=True, version="1", flush_cache=False).result(60)
        assert done.wait(120)
        versions = req.output_versions
        switch = versions.index("1")
        assert 10 <= switch < 200 and set(versions[:switch]) == {"0"} and set(versions[switch:]) == {"1"}
        assert req.spec_verify_ct < len(req.output_ids)  # speculation ran (accepted drafts) before the update
    finally:
        engine.stop()


async def test_the_server_reports_verify_counts_and_acceptance(drafting_checkpoint, tmp_path):
    """Over HTTP: SGLang's flags start it, meta_info carries spec_verify_ct, /metrics the acceptance counters."""
    import httpx

    from asyncrl.engine_client import EngineClient
    from tests.rollout.conftest import start_engine

    proc = start_engine(drafting_checkpoint, tmp_path, "--speculative-algorithm", "EAGLE", "--speculative-num-steps",
                        "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
    try:
        async with EngineClient(proc.url, timeout_s=60) as client:
            out = await client.generate(DRAFT_PROMPTS[2], {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        verify = out.meta_info.spec_verify_ct
        assert out.meta_info.completion_tokens / verify > 1.5
        metrics = httpx.get(f"{proc.url}/metrics", timeout=30).text
        assert f"sglang_spec_verify_total {float(verify)}" in metrics and "sglang_spec_tokens_total 24.0" in metrics
    finally:
        assert proc.stop() == 0, proc.log()


def test_engines_refuse_speculation_they_cannot_serve(tiny_checkpoint, tmp_path):
    from asyncrl.config import load_model_section
    from asyncrl.model.io import save_pretrained
    from asyncrl.model.model import Glm5ForCausalLM
    import dataclasses

    no_mtp = dataclasses.replace(load_model_section("tiny").arch, num_nextn_predict_layers=0)
    save_pretrained(Glm5ForCausalLM.from_config(no_mtp, seed=0), tmp_path / "no-mtp")
    for path, extra, message in [(tmp_path / "no-mtp", {}, "no MTP layer"),
                                 (tiny_checkpoint, {"speculative_eagle_topk": 4}, "only chains"),
                                 (tiny_checkpoint, {"speculative_num_draft_tokens": 5}, "verifies 3")]:
        with pytest.raises(ValueError, match=message):
            Engine(EngineArgs(model_path=str(path), **SPEC, **extra))
