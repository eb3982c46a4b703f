"""Inference path: the latent KV cache (slot pool) gives the full forward's logits, for ragged batches,
chunked prefill, shared prefixes and mixed prefill/decode calls; and batch composition changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.model import Glm5ForCausalLM

TOLERANCE = 1e-5


def _sequences(lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=generator) for n in lengths]


def _scattered_slots(lengths: list[int], pool_size: int, seed: int) -> list[list[int]]:
    """Each sequence gets non-contiguous slots, interleaved with the others' (as a busy pool would)."""
    free = torch.randperm(pool_size, generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for n in lengths:
        out.append(free[start : start + n])
        start += n
    return out


def _full_logits(model: Glm5ForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(seq[None])[0] for seq in seqs]


def _decode_ragged(model, seqs, prompt_lens, cache, slots, prefill_chunk: int, **batch_options
                   ) -> list[list[torch.Tensor]]:
    """Prefill every prompt in chunks (all sequences in each call), then decode the rest one token per
    call for all sequences at once (teacher-forced). -> per sequence, the logits of each position."""
    out = [[] for _ in seqs]
    done = [0] * len(seqs)
    with torch.no_grad():
        while any(d < len(s) for d, s in zip(done, seqs)):
            live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
            take = {i: min(prefill_chunk if done[i] < prompt_lens[i] else 1, len(seqs[i]) - done[i]) for i in live}
            batch = ForwardBatch.from_lists([seqs[i][done[i] : done[i] + take[i]].tolist() for i in live],
                                            [slots[i][: done[i] + take[i]] for i in live], logits="all",
                                            **batch_options)
            logits = model.forward_batch(batch, cache).split([take[i] for i in live])
            for i, rows in zip(live, logits):
                out[i].extend(rows)
                done[i] += take[i]
    return out


def _max_diff(decoded: list[list[torch.Tensor]], full: list[torch.Tensor]) -> float:
    return max((torch.stack(rows) - ref).abs().max().item() for rows, ref in zip(decoded, full))


@pytest.mark.parametrize("prefill_chunk,grouping", [(64, {}), (7, {}), (64, {"group_min_pairs": 0})],
                         ids=["chunk64", "chunk7", "chunk64-length-groups"])
def test_ragged_cached_decode_equals_full_forward_over_70_steps(parity_model, parity_config, prefill_chunk, grouping):
    prompt_lens, steps = [3, 20, 41, 9], 70  # contexts grow from 3 to 111 tokens, index_topk is 16
    seqs = _sequences([p + steps for p in prompt_lens], seed=0)
    slots = _scattered_slots([len(s) for s in seqs], 1024, seed=1)
    cache = KVCache(parity_config, 1024)
    decoded = _decode_ragged(parity_model, seqs, prompt_lens, cache, slots, prefill_chunk, **grouping)
    assert _max_diff(decoded, _full_logits(parity_model, seqs)) <= TOLERANCE


def test_shared_prefix_slots_are_reused_without_recomputation(parity_model, parity_config):
    prefix, tails = _sequences([30], seed=2)[0], _sequences([25, 12], seed=3)
    cache = KVCache(parity_config, 256)
    with torch.no_grad():
        parity_model.forward_batch(ForwardBatch.from_lists([prefix.tolist()], [list(range(30))]), cache)
        # Both continuations point at slots 0..29 for the prefix; only their tails are computed.
        contexts = [list(range(30)) + list(range(100, 125)), list(range(30)) + list(range(200, 212))]
        batch = ForwardBatch.from_lists([t.tolist() for t in tails], contexts, logits="all")
        logits = parity_model.forward_batch(batch, cache).split([25, 12])
    full = _full_logits(parity_model, [torch.cat([prefix, t]) for t in tails])
    assert all((rows - ref[30:]).abs().max() <= TOLERANCE for rows, ref in zip(logits, full))


def test_log_probs_do_not_depend_on_the_rest_of_the_batch(parity_model, parity_config):
    probe = _sequences([90], seed=4)[0]
    others = _sequences([5, 130, 47, 64, 2], seed=5)
    targets = torch.roll(probe, -1)

    def probe_logprobs(batch_seqs: list[torch.Tensor]) -> torch.Tensor:
        ids = torch.cat(batch_seqs)
        cu = torch.tensor([0] + [len(s) for s in batch_seqs]).cumsum(0)
        with torch.no_grad():
            out = parity_model.token_logprobs(ids, cu, torch.cat([torch.roll(s, -1) for s in batch_seqs]))
        start = [i for i, s in enumerate(batch_seqs) if s is probe][0]
        return out.logprobs[cu[start] : cu[start] + len(probe)]

    alone = probe_logprobs([probe])
    orders = ([others[0], probe, *others[1:]], [*others, probe], [others[2], probe])
    batched = [probe_logprobs(order) for order in orders]
    diffs = [(b - alone).abs().max().item() for b in batched]
    assert max(diffs) <= TOLERANCE, diffs
    # The engine path (cache) against the trainer path (no cache): the engine's log-prob contract.
    cache = KVCache(parity_config, 512)
    seqs = [probe, *others[:3]]
    slots = _scattered_slots([len(s) for s in seqs], 512, seed=6)
    decoded = _decode_ragged(parity_model, seqs, [40, 3, 100, 20], cache, slots, prefill_chunk=16)
    engine_logprobs = torch.stack(decoded[0]).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    assert (engine_logprobs - alone).abs().max().item() <= TOLERANCE


def test_exact_score_ties_select_the_same_keys_in_every_path(parity_config):
    """One index head: ReLU zeroes about half of all scores, so the k-th place is often an exact tie."""
    config = dataclasses.replace(parity_config, index_n_heads=1, index_topk=8)
    model = Glm5ForCausalLM.from_config(config, seed=11).eval()
    seqs = _sequences([60, 33], seed=7)
    full = _full_logits(model, seqs)
    cache = KVCache(config, 256)
    decoded = _decode_ragged(model, seqs, [5, 20], cache, _scattered_slots([60, 33], 256, seed=8), prefill_chunk=16)
    assert _max_diff(decoded, full) <= TOLERANCE
    with torch.no_grad():  # padded together with a longer row, in one packed call
        packed = model.token_logprobs(torch.cat(seqs), torch.tensor([0, 60, 93]), torch.zeros(93, dtype=torch.long))
        alone = model.token_logprobs(seqs[1], torch.tensor([0, 33]), torch.zeros(33, dtype=torch.long))
    assert (packed.logprobs[60:] - alone.logprobs).abs().max() <= TOLERANCE
    assert _ties_at_the_boundary(model, seqs[0]) > 0  # the scenario really has ties to break


def _ties_at_the_boundary(model: Glm5ForCausalLM, seq: torch.Tensor) -> int:
    """Queries of layer 0 whose k-th and (k+1)-th best causal index scores are equal."""
    from asyncrl.model.indexer import index_scores

    layer = model.model.layers[0]
    batch = ForwardBatch.packed(seq, torch.tensor([0, len(seq)]))
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(seq))
        rotations = model.model.rotary_emb(batch.positions)
        q_resid = layer.self_attn.q_a_layernorm(layer.self_attn.q_a_proj(x))
        indexer = layer.self_attn.indexer
        q, w = indexer.queries(x, q_resid, rotations)
        scores = index_scores(q[None], w[None], indexer.keys(x, rotations)[None], indexer.softmax_scale)[0]
    k, ties = indexer.index_topk, 0
    for t in range(k, len(seq)):
        ranked = scores[t, : t + 1].sort(descending=True).values
        ties += int(ranked[k - 1] == ranked[k])
    return ties


def test_greedy_generation_matches_transformers_generate(parity_model, load_hf, tmp_path):
    from asyncrl.model.generate import greedy_generate
    from asyncrl.model.io import save_pretrained

    save_pretrained(parity_model, tmp_path)
    reference = load_hf(tmp_path)
    prompts = [s.tolist() for s in _sequences([12, 30, 7], seed=9)]
    ours = greedy_generate(parity_model, prompts, max_new_tokens=40)  # contexts reach 70 > index_topk 16
    for prompt, continuation in zip(prompts, ours):
        theirs = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert continuation == theirs[0, len(prompt) :].tolist()
