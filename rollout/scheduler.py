"""Continuous batching over a token-slot KV pool with a radix prefix cache.

Every `step()` runs one model forward: either a prefill step (prompt chunks of newly admitted or
resumed requests, at most `chunked_prefill_size` tokens) or a decode step (one token for every
running request). When both kinds of work exist the two alternate, so long prompts never stall
running decodes and decodes never starve admission. Requests join the running batch as soon as they
are admitted and leave it the step they finish.

Memory: the pool holds `max_total_tokens` slots. Slots are allocated just before a forward; when the
pool is short, unlocked radix-cache leaves are evicted (LRU), and if that is not enough the most
recently admitted running request is retracted: its computed KV goes back into the radix cache and
it re-enters the waiting queue at the front, resuming (mostly from cache) when memory frees up.

Isolation: a step has a batched part (forward, sampling), which changes no request, and a
per-request part (log-probs, appending the token, stop checks, detokenizing, the update callback),
guarded request by request. A failure in the per-request part aborts that request alone; a failure
in the batched part re-runs the step one request at a time, so only the requests that cause it are
aborted (finish_reason abort, with the error) and the others continue with the tokens they would
have had (sampling is counter-based: a request's tokens do not depend on its batch).
Nothing runs out of memory and nothing is lost.

Fairness: admission is first-come-first-served with retracted requests ahead of new ones; the
head of the queue is never overtaken (no starvation of long prompts).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.sampling import logprob_temperature
from rollout.drafting import DraftForward, Drafter
from rollout.prefix_cache import RadixCache
from rollout.request import Req
from rollout.sampler import SampleOutput, SamplingBatch, sample
from rollout.speculative import Verdict, draft, verify
from rollout.token_pool import TokenPool

log = logging.getLogger("rollout.scheduler")


@dataclass
class SchedulerConfig:
    max_running_requests: int
    max_total_tokens: int
    chunked_prefill_size: int
    max_context_len: int
    disable_radix_cache: bool = False
    """Never reuse prefixes (baseline for measuring the cache's gain)."""
    num_draft_tokens: int = 0
    """Speculative decoding: MTP drafts per decode step (0: off). Needs `draft_forward` and `read_hidden`."""


@dataclass(slots=True)
class _Extend:
    """One request's share of a forward: `take` pending tokens starting at its num_computed.
    `completes`: afterwards every token of the request has its KV, so the next one is sampled."""

    req: Req
    take: int
    drafts: int = 0
    """Speculative decoding: the last `drafts` of the `take` tokens are drafts, verified by this step."""
    completes: bool = False

    def __post_init__(self) -> None:
        self.completes = self.req.num_computed + self.take - self.drafts == self.req.all_len


@dataclass(slots=True)
class _Step:
    """What the batched part of a step computed, per request."""

    logits: torch.Tensor
    input_rows: dict[Req, list[int]]
    """Rows of `logits` that score each request's prompt tokens (for input log-probs)."""
    sample_index: dict[Req, int]
    """Row of `out` that is each sampled request's next token."""
    out: Optional[SampleOutput]
    tokens: list[int]
    logprobs: list[float]
    mtp_done: dict[Req, int] = field(default_factory=dict)
    """Speculative decoding: each request's mtp_done after the step's MTP catch-up."""
    verdict: Optional[Verdict] = None
    """Speculative decoding: what the verification emits, rows in plan order (sample_index)."""
    verified: list[tuple[list[int], list[float]]] = field(default_factory=list)
    """Speculative decoding: per verdict row, the tokens it emits and their log-probs (plain lists)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, forward: Callable[[ForwardBatch], torch.Tensor],
                 decode_text: Callable[[list[int]], str],
                 read_routing: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 draft_forward: Optional[DraftForward] = None,
                 read_hidden: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """read_routing: slots -> the experts their tokens were routed to (for return_routed_experts).
        draft_forward, read_hidden: the MTP layer and the pool's hidden rows (rollout/drafting.py), for
        config.num_draft_tokens > 0."""
        self.config = config
        self.forward = forward
        self.decode_text = decode_text
        self.read_routing = read_routing
        self.pool = TokenPool(config.max_total_tokens)
        self.cache = RadixCache(self.pool.free)
        self.generation = 0
        self.weight_version = "0"
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.paused = False
        # + the drafts: a verify step near the context's end still writes k draft positions (then frees them)
        width = config.max_context_len + config.num_draft_tokens
        self._req_to_slot = torch.zeros(config.max_running_requests, width, dtype=torch.long)
        self.drafter = (Drafter(draft_forward, read_hidden, self._req_to_slot) if config.num_draft_tokens else None)
        self._free_rows = list(range(config.max_running_requests - 1, -1, -1))
        self._last_step_prefill = False
        self.retractions = 0

    # Public API (engine thread only) ---------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting or self.running)

    def step(self) -> bool:
        """Run one forward if there is work; returns whether it did."""
        if self.paused:
            return False
        self._admit()
        extends = self._next_batch()
        if not extends and self.running:  # the planned requests were all retracted: plan again
            extends = self._next_batch()
        if not extends:
            return False
        self._run(extends)
        return True

    def abort(self, rid: Optional[str], message: str = "aborted by request", prefix: bool = False) -> int:
        """Abort one request (all when rid is None; with `prefix`, every rid starting with it, as SGLang's
        scheduler matches, so a parent rid covers the `{rid}-{j}` samples of an n > 1 request);
        returns how many were aborted."""
        hits = [r for r in [*self.running, *self.waiting]
                if rid is None or r.rid == rid or (prefix and r.rid.startswith(rid))]
        for req in hits:
            req.abort(message)
            self._leave(req)
            req.on_update(req)
        return len(hits)

    def retract_all(self) -> int:
        running = list(self.running)
        for req in reversed(running):
            self._retract(req)
        return len(running)

    def flush_cache(self) -> None:
        """Forget cached prefixes (stale after new weights); running requests keep their own KV."""
        self.cache.flush()
        self.generation += 1

    def loads(self) -> dict[str, int]:
        """num_tokens (SGLang's load figure): KV slots in use plus the tokens still waiting for admission."""
        used = self.config.max_total_tokens - self.pool.available - self.cache.evictable_tokens
        waiting_tokens = sum(req.all_len for req in list(self.waiting))  # list(): one atomic copy (HTTP thread)
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
                "num_used_tokens": used, "num_tokens": used + waiting_tokens,
                "max_total_num_tokens": self.config.max_total_tokens}

    # Admission ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self._free_rows:
            req = self.waiting[0]
            prefix, node = self._match_prefix(req)
            need = req.all_len - len(prefix) + (len(self.running) + 1) * self._decode_take  # + a decode step each
            reclaimable = self.pool.available + self.cache.evictable_tokens - len(prefix)  # its prefix gets locked
            if need > reclaimable and self.running:
                return  # FCFS: the head waits for memory rather than being overtaken
            self.waiting.popleft()
            self._start(req, prefix, node)

    def _match_prefix(self, req: Req) -> tuple[np.ndarray, object]:
        ids = np.asarray(req.prompt + req.output_ids, dtype=np.int64)
        limit = req.all_len - 1  # at least one token is computed: its logits pick the next token
        if req.wants_input_logprobs:
            limit = min(limit, max(req.item.logprob_start_len - 1, 0))
        if self.config.disable_radix_cache:
            limit = 0
        slots, node = self.cache.match_prefix(ids[:limit])
        return slots, node

    def _start(self, req: Req, prefix: np.ndarray, node) -> None:
        req.row = self._free_rows.pop()
        self.cache.lock(node)
        req.prefix_node, req.num_prefix_slots, req.num_computed = node, len(prefix), len(prefix)
        req.mtp_done = max(len(prefix) - 1, 0)  # the cached slots 1..R-1 hold MTP positions 0..R-2 (drafting.py)
        req.kv_generation = self.generation
        if not req.output_ids:
            req.cached_tokens = len(prefix)
        self._req_to_slot[req.row, :len(prefix)] = torch.from_numpy(prefix)
        self.running.append(req)

    # Batch selection -----------------------------------------------------------------------------
    def _next_batch(self) -> list[_Extend]:
        prefilling = [r for r in self.running if r.pending > 1 or r.num_computed == 0]
        decoding = [r for r in self.running if not (r.pending > 1 or r.num_computed == 0)]
        prefer_prefill = prefilling and (not decoding or not self._last_step_prefill)
        self._last_step_prefill = bool(prefer_prefill)
        if prefer_prefill:
            return self._allocate(self._prefill_plan(prefilling))
        return self._allocate([_Extend(r, self._decode_take, drafts=self._decode_take - 1) for r in decoding])

    @property
    def _decode_take(self) -> int:
        """Tokens a decode step computes per request: its pending token, and the drafts."""
        return 1 + self.config.num_draft_tokens

    def _prefill_plan(self, prefilling: list[Req]) -> list[_Extend]:
        budget, plan = self.config.chunked_prefill_size, []
        for req in prefilling:
            if budget <= 0:
                break
            take = min(req.pending, budget)
            plan.append(_Extend(req, take))
            budget -= take
        return plan

    def _allocate(self, plan: list[_Extend]) -> list[_Extend]:
        """Give every planned extend its slots, evicting cache and retracting requests as needed."""
        need = sum(e.take for e in plan)
        if need > self.pool.available:
            self.cache.evict(need - self.pool.available)
        while need > self.pool.available and len(self.running) > 1:
            victim = self.running[-1]
            self._retract(victim)
            plan = [e for e in plan if e.req is not victim]
            need = sum(e.take for e in plan)
            if need > self.pool.available:
                self.cache.evict(need - self.pool.available)
        if need > self.pool.available:  # one request left, larger than the pool (context_length > the pool)
            for e in plan:
                self._fail(e.req, MemoryError(f"KV pool of {self.config.max_total_tokens} tokens cannot hold it "
                                              f"({need} more tokens needed); raise rollout.max_total_tokens"))
            return []
        rows = [e.req.row for e in plan for _ in range(e.take)]
        cols = [e.req.num_computed + j for e in plan for j in range(e.take)]
        self._req_to_slot[rows, cols] = torch.from_numpy(self.pool.alloc(need))
        return plan

    # Forward + sampling --------------------------------------------------------------------------
    def _run(self, plan: list[_Extend]) -> None:
        try:
            step = self._compute(plan)
        except Exception as err:
            if len(plan) == 1:
                self._free_step_slots(plan[0])
                self._fail(plan[0].req, err)
                return
            log.warning("a step of %d requests failed (%s: %s): running them one at a time to find the cause",
                        len(plan), type(err).__name__, err)
            for e in plan:
                self._run([e])
            return
        for e in plan:
            self._apply(e, step)

    def _compute(self, plan: list[_Extend]) -> "_Step":
        """The batched part of a step: forward and sampling. It changes no request (only KV rows of its
        slots), so it can be re-run."""
        if plan[0].drafts:
            return self._compute_verify(plan)
        batch, sample_rows, input_rows = self._forward_batch(plan)
        logits = self.forward(batch)  # [M, V]
        sampled = [e.req for e in plan if e.completes]
        out = None
        if sampled:
            banned = self._banned(sampled, logits.shape[-1])
            out = sample(logits[sample_rows], self._sampling_batch(sampled),
                         banned=None if banned is None else banned[:, 0])
        tokens, logprobs = (out.token_ids.tolist(), out.logprobs.tolist()) if out is not None else ([], [])
        step = _Step(logits, {e.req: rows for e, rows in input_rows}, {req: i for i, req in enumerate(sampled)},
                     out, tokens, logprobs)
        if self.drafter:  # MTP positions whose next token and slot now exist (drafting.py)
            spans = [(e.req, e.req.num_computed + e.take - 1) for e in plan]
            spans = [(req, end) for req, end in spans if end > req.mtp_done]
            if spans:
                self.drafter.catch_up(spans, want_logits=False)
            step.mtp_done = {req: end for req, end in spans}
        return step

    def _compute_verify(self, plan: list[_Extend]) -> "_Step":
        """Speculative decode step (drafting.py): catch up the MTP layer, draft k tokens, verify them with
        one target forward over [pending token, drafts], accept by rejection sampling (speculative.py)."""
        reqs, k = [e.req for e in plan], self.config.num_draft_tokens
        starts = [req.num_computed for req in reqs]
        sampling = self._sampling_batch(reqs)
        logits, hidden = self.drafter.catch_up([(req, c) for req, c in zip(reqs, starts)], want_logits=True)
        banned = self._banned(reqs, logits.shape[-1], k + 1)  # [B, k + 1, V]: the drafts' and verification's
        drafts, probs = [], []
        for i in range(k):
            if i:
                logits, hidden = self.drafter.chain(reqs, [c + i - 1 for c in starts], drafts[-1], hidden)
            token, q = draft(logits, sampling.shifted(i), None if banned is None else banned[:, i])
            drafts.append(token)
            probs.append(q)
        ids = torch.stack([torch.tensor([req.pending_ids(1)[0] for req in reqs]), *drafts], 1)  # [B, k + 1]
        context_lens = torch.tensor(starts) + k + 1
        batch = ForwardBatch(input_ids=ids.flatten(), extend_lens=torch.full((len(reqs),), k + 1),
                             context_slots=self._req_to_slot[[req.row for req in reqs], :int(context_lens.max())],
                             context_lens=context_lens)
        target = self.forward(batch).view(len(reqs), k + 1, -1)
        verdict = verify(target, torch.stack(drafts, 1), torch.stack(probs, 1), sampling, banned)
        verified = [(tokens[:n + 1], logprobs[:n + 1]) for tokens, logprobs, n in
                    zip(verdict.tokens.tolist(), verdict.logprobs.tolist(), verdict.accepted.tolist())]
        return _Step(target, {}, {req: i for i, req in enumerate(reqs)}, None, [], [],
                     mtp_done=dict(zip(reqs, starts)), verdict=verdict, verified=verified)

    def _apply(self, e: _Extend, step: "_Step") -> None:
        """One request's part of a step; a failure here aborts that request alone."""
        req = e.req
        # The KV of the whole take is written. A verification keeps less (_take_verified sets num_computed
        # to what it emits and frees the rest); counting all of it first means a failure before that
        # still frees the drafts' slots in _release.
        start, req.num_computed = req.num_computed, req.num_computed + e.take
        req.mtp_done = step.mtp_done.get(req, req.mtp_done)
        try:
            if step.verdict is not None:
                self._take_verified(e, step, start)
            if req in step.input_rows:
                self._record_input_logprobs(req, start, step.logits[step.input_rows[req]])
            if req in step.sample_index and step.verdict is None:
                self._take_sample(req, step, step.sample_index[req])
            if req.finished:
                self._release(req, finished=True)
            if e.completes or req.finished:
                req.on_update(req)
        except Exception as err:
            self._fail(req, err)

    def _fail(self, req: Req, err: Exception) -> None:
        """Abort one request for an error it caused; the rest of the batch carries on."""
        log.error("request %s failed in the engine; aborting it alone", req.rid, exc_info=err)
        req.finish_reason = {"type": "abort", "message": f"request failed in the engine: {type(err).__name__}: {err}"}
        self._leave(req)
        try:
            req.on_update(req)
        except Exception:
            log.exception("request %s: its update callback failed", req.rid)

    def _free_step_slots(self, e: _Extend) -> None:
        """The slots allocated for a step that did not run (its KV is not computed)."""
        req = e.req
        self.pool.free(self._req_to_slot[req.row, req.num_computed:req.num_computed + e.take].numpy().copy())

    def _leave(self, req: Req) -> None:
        """Take a finished (aborted) request out of the running batch or the waiting queue."""
        if req in self.running:
            self._release(req, finished=True)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _forward_batch(self, plan: list[_Extend]):
        ids, extend_lens, context_lens, rows = [], [], [], []
        sample_rows, input_rows, offset = [], [], 0
        for e in plan:
            req = e.req
            ids.extend(req.pending_ids(e.take))
            extend_lens.append(e.take)
            context_lens.append(req.num_computed + e.take)
            rows.append(req.row)
            if req.wants_input_logprobs and req.num_computed < len(req.prompt):
                lo = max(req.item.logprob_start_len - 1, req.num_computed)
                hi = min(len(req.prompt) - 1, req.num_computed + e.take)
                if hi > lo:
                    input_rows.append((e, list(range(offset + lo - req.num_computed, offset + hi - req.num_computed))))
            offset += e.take
            if e.completes:
                sample_rows.append(offset - 1)
        wanted = sorted({r for _, rs in input_rows for r in rs} | set(sample_rows))
        position = {r: i for i, r in enumerate(wanted)}
        width = max(context_lens)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            extend_lens=torch.tensor(extend_lens, dtype=torch.long),
            context_slots=self._req_to_slot[rows, :width],
            context_lens=torch.tensor(context_lens, dtype=torch.long),
            logits_indices=torch.tensor(wanted, dtype=torch.long),
        )
        return batch, [position[r] for r in sample_rows], [(e, [position[r] for r in rs]) for e, rs in input_rows]

    def _record_input_logprobs(self, req: Req, start: int, logits: torch.Tensor) -> None:
        """Log-probs of prompt tokens (position p scores prompt[p + 1]), first entry None; `start`: the
        request's computed tokens before this step."""
        first_scored = max(req.item.logprob_start_len, start + 1)
        if req.item.logprob_start_len == 0 and start == 0:
            req.input_logprobs.append(None)
            req.input_top_logprobs.append(None)
        targets = torch.tensor(req.prompt[first_scored:first_scored + logits.shape[0]], dtype=torch.long)
        temperature = logprob_temperature(req.item.sampling.temperature)
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        req.input_logprobs.extend(logprobs.gather(-1, targets[:, None]).squeeze(-1).tolist())
        if req.item.top_logprobs_num > 0:
            req.input_top_logprobs.extend(_top(logprobs, req.item.top_logprobs_num))

    def _take_sample(self, req: Req, step: "_Step", i: int) -> None:
        """Row i of the step's sample becomes the request's next token (or finishes a prefill-only request)."""
        if req.item.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            return
        top = _top(step.out.logprob_rows[i:i + 1], req.item.top_logprobs_num)[0] if req.item.top_logprobs_num else None
        req.append_token(step.tokens[i], step.logprobs[i], self.weight_version, top)
        req.check_stop_strings(self.decode_text)

    def _take_verified(self, e: _Extend, step: "_Step", start: int) -> None:
        """The tokens verification emits for the request (up to a stop or max_new_tokens); the target KV of
        the drafts after the last emitted token is dropped (its slots freed)."""
        req, i, verdict = e.req, step.sample_index[e.req], step.verdict
        req.spec_verify_ct += 1
        emitted = 0
        if req.item.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        for j, (token, logprob) in enumerate(zip(*step.verified[i])):
            if req.finished:
                break
            rows = verdict.logprob_rows[i, j:j + 1]
            top = _top(rows, req.item.top_logprobs_num)[0] if req.item.top_logprobs_num else None
            req.append_token(token, logprob, self.weight_version, top)
            req.check_stop_strings(self.decode_text)
            emitted += 1
        req.num_computed = start + max(emitted, 1)  # the pending token and the drafts kept before the last one
        self.pool.free(self._req_to_slot[req.row, req.num_computed:start + e.take].numpy().copy())

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        params = [r.item.sampling for r in reqs]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            seeds=np.array([r.seed for r in reqs], dtype=np.uint64),
            counters=np.array([len(r.output_ids) for r in reqs], dtype=np.uint64),
        )

    @staticmethod
    def _banned(reqs: list[Req], vocab: int, positions: int = 1) -> Optional[torch.Tensor]:
        """[B, positions, V]: the tokens each request may not draw at its next `positions` output positions
        (None: no ban anywhere). Stop tokens are banned before min_new_tokens; they stay in the reported
        log-probs."""
        short = [(i, r, r.item.sampling.min_new_tokens - len(r.output_ids)) for i, r in enumerate(reqs)]
        short = [(i, r, min(n, positions)) for i, r, n in short if n > 0]
        if not short:
            return None
        mask = torch.zeros(len(reqs), positions, vocab, dtype=torch.bool)
        for i, req, n in short:
            mask[i, :n, [t for t in req.stop_ids if t < vocab]] = True
        return mask

    # Release -----------------------------------------------------------------------------------
    def _release(self, req: Req, finished: bool) -> None:
        """Leave the running batch: computed KV goes to the radix cache (if not stale), rest freed."""
        self.running.remove(req)
        if finished and req.item.return_routed_experts:  # read before the slots are freed or reused
            computed = min(req.num_computed, req.all_len - 1)
            req.routed_experts = self.read_routing(self._req_to_slot[req.row, :computed])
        slots = self._req_to_slot[req.row, :req.num_computed].numpy().copy()
        if req.kv_generation == self.generation and req.num_computed > 0 and not self.config.disable_radix_cache:
            # with MTP rows, only slots whose MTP row is computed are shared (slot j: MTP position j - 1)
            cached = min(req.num_computed, req.mtp_done + 1) if self.drafter else req.num_computed
            # tokens [0, already) were cached before: the prefix's own slots, or duplicates to free
            already = self.cache.insert(np.asarray(req.computed_ids()[:cached], dtype=np.int64), slots[:cached])
            self.pool.free(slots[req.num_prefix_slots:already])
            self.pool.free(slots[cached:])
        else:
            self.pool.free(slots[req.num_prefix_slots:])
        self.cache.unlock(req.prefix_node)
        self._free_rows.append(req.row)
        req.row, req.prefix_node = -1, None

    def _retract(self, req: Req) -> None:
        self._release(req, finished=False)
        req.num_computed, req.num_prefix_slots, req.mtp_done = 0, 0, 0
        self.waiting.appendleft(req)
        log.info("retracted %s (%d tokens) to free KV memory", req.rid, req.all_len)
        self.retractions += 1


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
