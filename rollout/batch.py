"""A /generate request fanned out into the single-prompt, single-sample items the scheduler runs."""

from __future__ import annotations

from typing import Any

from asyncrl.protocols.engine import MAX_ITEMS_PER_REQUEST, MAX_SEED, GenerateItem, GenerateRequest, SamplingParams


def split_batch(req: GenerateRequest, new_rid) -> list[GenerateItem]:
    """GenerateRequest -> one GenerateItem per prompt and sample (prompt-major); per-prompt fields may be
    lists or scalars. With n > 1, sample j of a prompt gets rid `{rid}-{j}` and, when the prompt has a
    sampling_seed, seed + j: reproducible and distinct (SGLang repeats the seed, so its n copies agree)."""
    prompts = req.input_ids if req.input_ids is not None else req.text
    if not req.is_batch:
        prompts = [prompts]
    n = len(prompts)

    def pick(value: Any, name: str, default: Any = None) -> list[Any]:
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(f"'{name}' has {len(value)} entries for a batch of {n}")
            return value
        return [default if value is None else value] * n

    if req.rid is None:
        rids = [new_rid() for _ in range(n)]
    elif req.is_batch:
        if not isinstance(req.rid, list):
            raise ValueError("'rid' must be a list with one id per prompt in a batch request")
        rids = pick(req.rid, "rid")
    else:
        rids = [req.rid]
    sampling = pick(req.sampling_params, "sampling_params", SamplingParams())
    if n * req.parallel_samples > MAX_ITEMS_PER_REQUEST:
        raise ValueError(f"{n} prompts x n={req.parallel_samples} exceeds {MAX_ITEMS_PER_REQUEST} samples per request")
    items = [
        GenerateItem(
            rid=rids[i],
            text=prompts[i] if req.text is not None else None,
            sampling=sampling[i],
            return_logprob=pick(req.return_logprob, "return_logprob")[i],
            logprob_start_len=pick(req.logprob_start_len, "logprob_start_len")[i],
            top_logprobs_num=pick(req.top_logprobs_num, "top_logprobs_num")[i],
            return_text_in_logprobs=req.return_text_in_logprobs,
            return_routed_experts=pick(req.return_routed_experts, "return_routed_experts")[i],
            stream=req.stream,
        )
        for i in range(n)
    ]
    if req.input_ids is not None:  # validated with the request (in chunks: LongIds), not again in one call
        for item, prompt in zip(items, prompts):
            item.input_ids = prompt
    samples = req.parallel_samples
    return items if samples == 1 else [sample for item in items for sample in _samples(item, samples)]


def _samples(item: GenerateItem, n: int) -> list[GenerateItem]:
    """The n single-sample items of an n > 1 prompt: rid `{rid}-{j}`, seed + j (mod 2**64) when seeded."""
    seed = item.sampling.sampling_seed
    return [item.model_copy(update={"rid": f"{item.rid}-{j}", "sampling": item.sampling.model_copy(
                update={"n": 1, "sampling_seed": None if seed is None else (seed + j) % (MAX_SEED + 1)})})
            for j in range(n)]
