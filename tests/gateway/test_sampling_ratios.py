"""Rollout log-probs equal trainer log-probs under the sampling settings actually used: a session at
T != 1 (with an agent's per-request override) is sampled through a real gateway and engine, recorded in
Redis, and re-scored by the real torch trainer backend; truncated sampling is refused with a 400."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from asyncrl.config import ModelSection, TrainerConfig
from tests.gateway.checks import assert_engine_replays, assert_ledger_consistent
from tests.gateway.conftest import AUTH_TOKEN, error_message
from trainer.advantages import ScoredSample
from trainer.backends.base import make_backend
from trainer.losses import LossInputs, build_loss
from trainer.packing import pack

SEED = 4321
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def backend(tiny_arch, tiny_checkpoint):
    """The trainer, holding exactly the engine's weights (on-policy)."""
    return make_backend(TrainerConfig(), ModelSection(arch=tiny_arch, path=str(tiny_checkpoint)))


def trainer_view(backend, sample):
    """(trainer log-probs, rollout log-probs, IS-masked fraction) over the sample's loss tokens."""
    [mb] = pack([ScoredSample(sample, advantage=1.0)], micro_batch_tokens=4096)
    trained = backend.logprobs(mb)
    _, metrics = build_loss(TrainerConfig().loss)(LossInputs(trained, mb.rollout_logprobs, mb.advantages,
                                                             mb.loss_mask))
    mask = mb.loss_mask
    return trained[mask], mb.rollout_logprobs[mask], metrics.summary()["masked_fraction"]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
async def test_engine_and_trainer_logprobs_agree_at_the_sampling_temperature(
        temperature, random_client, random_engine, template, store, backend, openai_client):
    override = round(2.0 - temperature, 2)  # the agent's own value for its second turn
    session = await random_client.create(sampling={"sampling_seed": SEED, "temperature": temperature})
    client = openai_client(base_url=session["base_url"], api_key=AUTH_TOKEN)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for k, requested in enumerate([None, override]):
        extra = {} if requested is None else {"temperature": requested}
        reply = await client.chat.completions.create(model="asyncrl", messages=messages, max_tokens=MAX_TOKENS, **extra)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"and {k}?"}]
    used = [temperature, override]

    [segment] = (await random_client.record(session["session_id"]))["segments"]
    assert_ledger_consistent(segment)
    assert [turn["sampling"]["temperature"] for turn in segment["turns"]] == used
    sampling = lambda k: {"temperature": used[k], "max_new_tokens": MAX_TOKENS, "sampling_seed": SEED + k,  # noqa: E731
                          "stop_token_ids": list(template.stop_token_ids)}
    await assert_engine_replays(random_engine.url, segment, sampling)  # same seed, same T -> same tokens

    finished = await random_client.finish(session["session_id"], reward=1.0)
    [sample] = await store.get_samples(finished["sample_refs"])
    expected = np.ones(sample.num_tokens, dtype=np.float32)
    for turn, t in zip(segment["turns"], used):
        expected[turn["prompt_len"]:turn["prompt_len"] + turn["output_len"]] = t
    assert np.array_equal(sample.temperatures, expected)

    trained, rollout, masked = trainer_view(backend, sample)
    assert trained.numel() == sum(turn["output_len"] for turn in segment["turns"]) > MAX_TOKENS
    assert (trained - rollout).abs().max().item() <= 1e-5
    assert masked == 0.0

    # What the trainer did before it read the temperatures (T = 1 throughout): the check above would fail
    # (this random model's near-flat logits keep the gap small; a trained model's is far larger).
    at_one, _, _ = trainer_view(backend, replace(sample, temperatures=None))
    assert (at_one - rollout).abs().max().item() > 1e-2


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1)])
async def test_truncated_sampling_is_refused_naming_the_field_and_the_policy(field, value, random_client, random_gateway):
    session = await random_client.create()
    chat = f"/sessions/{session['session_id']}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    for stream in (False, True):
        r = await random_client.http.post(chat, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert f"{field}={value}" in error_message(r) and "sampling policy" in error_message(r)
    native = await random_client.http.post(f"/sessions/{session['session_id']}/generate",
                                           json={"input_ids": [1, 2, 3], "sampling_params": {field: value}})
    assert native.status_code == 400 and f"{field}={value}" in error_message(native)
    # The refused turns left the session untouched, and it still serves an untruncated turn.
    ok = await random_client.http.post(chat, json={**body, field: None})
    assert ok.status_code == 200, ok.text
    [segment] = (await random_client.record(session["session_id"]))["segments"]
    assert len(segment["turns"]) == 1


async def test_a_session_that_allows_truncation_records_it(random_client):
    session = await random_client.create(sampling={"allow_truncation": True, "top_k": 3, "sampling_seed": 1})
    r = await random_client.http.post(f"/sessions/{session['session_id']}/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                            "top_p": 0.8})
    assert r.status_code == 200, r.text
    [segment] = (await random_client.record(session["session_id"]))["segments"]
    recorded = segment["turns"][0]["sampling"]
    assert (recorded["top_k"], recorded["top_p"]) == (3, 0.8)


def test_the_trainer_scores_each_position_at_its_own_temperature(tiny_arch):
    """token_logprobs with a per-position temperature equals scoring each position at its scalar T."""
    from asyncrl.model.model import Glm5ForCausalLM

    model = Glm5ForCausalLM.from_config(tiny_arch, seed=3).eval()
    ids = torch.randint(1, tiny_arch.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    cu, targets = torch.tensor([0, 11]), ids[1:]
    temps = torch.tensor([1.0] * 5 + [0.5] * 3 + [1.7] * 3)
    with torch.no_grad():
        mixed = model.token_logprobs(ids[:-1], cu, targets, temperature=temps, with_entropy=False).logprobs
        for t in (1.0, 0.5, 1.7):
            alone = model.token_logprobs(ids[:-1], cu, targets, temperature=t, with_entropy=False).logprobs
            assert torch.equal(mixed[temps == t], alone[temps == t])
