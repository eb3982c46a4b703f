"""The teacher-forcing check itself: it lets a near tie's cascade through and catches a wrong record."""

import pytest
import torch

from asyncrl.model.near_ties import recorded_selection_margins
from tests.gateway import checks

PROMPT, NEW = 6, 480


@pytest.fixture(scope="module")
def sequence(reference_model):
    """Random tokens, their teacher-forced log-probs and each query's smallest selection margin."""
    ids = torch.randint(0, reference_model.config.vocab_size, (PROMPT + NEW,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), recorded_selection_margins(reference_model) as margins:
        out = reference_model.token_logprobs(ids, torch.tensor([0, len(ids)]), ids.roll(-1), with_entropy=False)
    forced = torch.cat([torch.zeros(1), out.logprobs[:-1]])
    return ids, forced, torch.stack(margins).flatten(1).amin(0)


def record(ids, logprobs) -> dict:
    return {"tokens": ids.tolist(), "loss_mask": [0] * PROMPT + [1] * NEW,
            "rollout_logprobs": [0.0] * PROMPT + logprobs[PROMPT:].tolist()}


def test_an_exact_record_passes(reference_model, sequence):
    ids, forced, _ = sequence
    assert checks.assert_teacher_forced(reference_model, record(ids, forced + 1e-7)) <= 1e-5


def test_a_record_in_a_shifted_context_fails(reference_model, sequence):
    """Log-probs computed as if token 200 had been repeated (the kind of slip a continuation could make)."""
    ids, forced, _ = sequence
    shifted = torch.cat([ids[:201], ids[200:-1]])
    with torch.no_grad():
        wrong = reference_model.token_logprobs(shifted, torch.tensor([0, len(shifted)]), shifted.roll(-1),
                                               with_entropy=False).logprobs
    logprobs = forced.clone()
    logprobs[201:-1] = wrong[201:-1]  # log p(ids[p] | ids[:p] with ids[200] twice), 200 < p < 485
    with pytest.raises(AssertionError, match="no near tie"):
        checks.assert_teacher_forced(reference_model, record(ids, logprobs))


def test_a_divergence_passes_only_where_a_near_tie_begins_it(reference_model, sequence, monkeypatch):
    """Take the query closest to a tie as the tie: a cascade of small changes starting at the token it
    predicts passes; the same cascade starting one token later has no tie before it and fails."""
    ids, forced, margin = sequence
    tie = int(margin[PROMPT:-1].argmin()) + PROMPT  # query position; it predicts token tie + 1
    monkeypatch.setattr(checks, "NEAR_TIE_MARGIN", margin[tie].item() * 1.01)
    for onset, passes in ((tie + 1, True), (tie + 2, False)):
        logprobs = forced.clone()
        logprobs[onset::3] += 0.004  # an intermittent cascade, as a tie's leaves
        if passes:
            assert checks.assert_teacher_forced(reference_model, record(ids, logprobs)) == pytest.approx(0.004, abs=1e-5)
        else:
            with pytest.raises(AssertionError, match="no near tie"):
                checks.assert_teacher_forced(reference_model, record(ids, logprobs))
