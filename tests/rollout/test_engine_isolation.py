"""One request's failure inside the engine aborts that request alone: the batch it shared a step with
carries on and produces the tokens it would have produced alone."""

import threading

import pytest

from asyncrl.protocols.engine import GenerateItem, SamplingParams
from rollout.engine import Engine, EngineArgs
from rollout.request import Req
from tests.rollout.conftest import argmax_continuation

PROMPT = [1006, 1008, 1011, 10, 72, 101, 108, 108, 111, 1012]
LONG = 40


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = Engine(EngineArgs(model_path=str(tiny_checkpoint), max_total_tokens=4096)).start()
    yield engine
    engine.stop()


def submit(engine: Engine, item: GenerateItem) -> tuple[Req, threading.Event]:
    done = threading.Event()
    return engine.submit(engine.request(item, lambda req: done.set() if req.finished else None)), done


def long_greedy(rid: str) -> GenerateItem:
    return GenerateItem(rid=rid, input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=LONG, temperature=0,
                                                                           ignore_eos=True))


def negative_seed(rid: str) -> GenerateItem:
    """What validation refuses (sampling_seed < 0), smuggled past it: numpy cannot make it a uint64 seed,
    which used to fail the batched sampler and with it every request in the step."""
    return GenerateItem(rid=rid, input_ids=PROMPT[:4],
                        sampling=SamplingParams.model_construct(**{**SamplingParams().model_dump(), "sampling_seed": -1,
                                                                   "max_new_tokens": 8}))


def failing_stop_check(monkeypatch):
    """Stop-string handling (detokenizing the tail) that fails for one request only."""
    original = Req.check_stop_strings

    def check(self, decode):
        if self.rid == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, decode)
    monkeypatch.setattr(Req, "check_stop_strings", check)
    return GenerateItem(rid="bad", input_ids=PROMPT[:4], sampling=SamplingParams(max_new_tokens=8, stop=["x"]))


@pytest.mark.parametrize("fault", ["sampling", "stop handling"])
def test_a_failing_request_aborts_alone_and_its_batch_finishes_correctly(engine, reference_model, monkeypatch, fault):
    bad_item = negative_seed("bad") if fault == "sampling" else failing_stop_check(monkeypatch)
    good, good_done = submit(engine, long_greedy(f"good-{fault}"))
    bad, bad_done = submit(engine, bad_item)  # admitted with `good`: both are in the first step
    assert bad_done.wait(60) and good_done.wait(120)
    assert bad.finish_reason["type"] == "abort"
    assert "request failed in the engine" in bad.finish_reason["message"]
    assert good.finish_reason == {"type": "length", "length": LONG}
    assert good.output_ids == argmax_continuation(reference_model, PROMPT, LONG)
    # nothing leaked: every KV slot is back in the pool or the prefix cache
    assert engine.call(lambda: engine.scheduler.loads()).result(10)["num_used_tokens"] == 0
    after, after_done = submit(engine, long_greedy(f"after-{fault}"))
    assert after_done.wait(120) and after.output_ids == good.output_ids


def test_a_request_larger_than_the_kv_pool_aborts_alone(tiny_checkpoint):
    """A context length set above the pool admits a request the pool cannot hold: that request is aborted
    with the setting to raise, and the engine goes on serving (it once failed the whole queue)."""
    small = Engine(EngineArgs(model_path=str(tiny_checkpoint), max_total_tokens=64, context_length=512)).start()
    try:
        fits, fits_done = submit(small, GenerateItem(rid="fits", input_ids=PROMPT,
                                                     sampling=SamplingParams(max_new_tokens=20, ignore_eos=True)))
        huge, huge_done = submit(small, GenerateItem(rid="huge", input_ids=PROMPT * 10,
                                                     sampling=SamplingParams(max_new_tokens=4)))
        assert huge_done.wait(60) and fits_done.wait(60)
        assert huge.finish_reason["type"] == "abort" and "max_total_tokens" in huge.finish_reason["message"]
        assert fits.finish_reason == {"type": "length", "length": 20}, fits.finish_reason
    finally:
        small.stop()
