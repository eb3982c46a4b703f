"""The built-in CPU engine: model + KV pool + scheduler, driven by one engine thread.

The HTTP layer (server.py and the parts it calls: generation.py, control.py, weight_updates.py) never
touches model state. It submits requests and control commands; the engine thread runs them between
forward steps, so a weight update, an abort or a pause always lands on a step boundary and every
generated token knows the weight version that produced it.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from asyncrl.model.io import dtype_from_name, load_pretrained, load_weights
from asyncrl.model.kv_cache import KVCache
from asyncrl.tokenizer import Tokenizer, load_tokenizer
from asyncrl.protocols.engine import GenerateItem
from rollout.request import Req
from rollout.scheduler import Scheduler, SchedulerConfig
from rollout.weights import offload_weights, restore_weights

log = logging.getLogger("rollout.engine")

VERSION = "asyncrl-cpu-engine/0.1 (sglang-native-api 0.5.23 subset)"
MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
"""SGLang's release/resume_memory_occupation tags (no tags: all of them)."""
RELEASABLE = frozenset({"weights", "kv_cache"})
"""The tags that hold memory here: the CPU engine captures no CUDA graphs."""


@dataclass
class EngineArgs:
    """Server arguments (reported by /get_server_info, SGLang style)."""

    model_path: str
    tokenizer_path: Optional[str] = None
    """tokenizer.json file/dir or builtin:tiny; None = the model dir's tokenizer.json, else builtin:tiny."""
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    max_running_requests: int = 128
    max_total_tokens: int = 65536
    chunked_prefill_size: int = 512
    context_length: Optional[int] = None
    """Longest prompt + output; None = min(max_position_embeddings, max_total_tokens)."""
    random_seed: int = 0
    """Seeds requests that bring no sampling_seed (each still gets its own stream)."""
    weight_version: str = "0"
    num_threads: int = 1
    """torch intra-op threads for the forward (the tiny model is fastest single-threaded)."""
    served_model_name: str = "asyncrl"
    disable_radix_cache: bool = False
    stream_interval: int = 1
    """SGLang's: a stream gets an event at its first token, then every stream_interval tokens, and at the end."""
    incremental_streaming_output: bool = False
    """SGLang's: stream events carry only what is new since the request's previous event (default: all so far)."""
    enable_return_routed_experts: bool = False
    """SGLang's: record every token's routed experts (4 bytes x layers x top-k per KV slot) so that requests
    may ask for them (return_routed_experts, for rollout routing replay)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """SGLang's --api-key: every route but /health*, /metrics wants `Authorization: Bearer <key>` (never reported)."""
    speculative_algorithm: Optional[str] = None
    """SGLang's: NEXTN or EAGLE (the same here) drafts with the checkpoint's MTP layer and verifies the drafts
    with rejection sampling (rollout/speculative.py); None: off."""
    speculative_num_steps: int = 2
    """SGLang's: drafts per decode step, the one MTP layer reused for each (GLM-5: 2)."""
    speculative_eagle_topk: int = 1
    """SGLang's: draft branches per step; only chains (1)."""
    speculative_num_draft_tokens: Optional[int] = None
    """SGLang's: tokens verified per step, num_steps + 1 for a chain (None: that)."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body, bytes (413 beyond): ~1M prompt tokens as input_ids; update_weights_from_tensor,
    which carries whole models, has none. Parsing and tokenizing hold the GIL in part (~25 ms a MiB), so a
    larger limit lets one request stall /health for longer."""


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.startup_time = time.time()
        """Reported by /get_server_info, as SGLang's (wall-clock seconds)."""
        torch.set_num_threads(args.num_threads)
        self.model = load_pretrained(args.model_path, dtype_from_name(args.dtype)).eval()
        self.config = self.model.config
        self.tokenizer = _load_tokenizer(args)
        context = args.context_length or min(self.config.max_position_embeddings, args.max_total_tokens)
        self.context_length = context
        self.num_draft_tokens = _draft_tokens(args, self.config.num_nextn_predict_layers)
        self.cache: Optional[KVCache] = self._new_cache()
        self.kv_bytes_per_token = self.cache.bytes_per_token
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_running_requests, args.max_total_tokens, args.chunked_prefill_size, context,
                            args.disable_radix_cache, self.num_draft_tokens),
            forward=self._forward, decode_text=lambda ids: self.tokenizer.decode(ids),
            read_routing=lambda slots: self.cache.routed_experts.index_select(0, slots),
            draft_forward=self._draft_forward, read_hidden=lambda slots: self.cache.hidden.index_select(0, slots))
        self.scheduler.weight_version = args.weight_version
        self.eos_ids = frozenset(self.config.eos_token_ids)
        self._rng = random.Random(args.random_seed)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.steps = 0
        self.generated_tokens = 0
        self.released: frozenset[str] = frozenset()
        """Memory given up by release_memory_occupation (tags of RELEASABLE)."""
        self._weights_backup: Optional[Path] = None
        self._weights_shapes: dict[str, torch.Size] = {}

    # Lifecycle --------------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Abort what is in flight (clients get finish_reason abort), then end the thread."""
        if self._thread.is_alive():
            self.call(lambda: self.scheduler.abort(None, "engine shutting down")).result(timeout=30)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        if self._weights_backup is not None:  # stopped while the weights were released
            shutil.rmtree(self._weights_backup, ignore_errors=True)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # Cross-thread API -------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread at the next step boundary."""
        command = _Command(fn)
        self._inbox.put(command)
        self._wake.set()
        return command.future

    def request(self, item: GenerateItem, on_update: Callable[[Req], None]) -> Req:
        """Tokenize and validate one item (raises ValueError, naming the field, for a request it can never
        serve). Any thread: a long text is tokenized without the GIL, so callers may run this off their loop."""
        prompt = item.input_ids if item.input_ids is not None else self.tokenizer.encode(item.text)
        self._validate(item, prompt)
        params = item.sampling
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seed = params.sampling_seed if params.sampling_seed is not None else self._rng.getrandbits(63)
        return Req(item=item, prompt=list(prompt), seed=seed, stop_ids=stop_ids, on_update=on_update)

    def submit(self, req: Req) -> Req:
        """Enqueue a request made by `request`."""
        self.call(lambda: self.scheduler.add(req))
        return req

    def _validate(self, item: GenerateItem, prompt: list[int]) -> None:
        vocab = self.config.vocab_size
        if not prompt:
            raise ValueError("input_ids: the prompt is empty")
        if len(prompt) + item.sampling.max_new_tokens > self.context_length:  # before the O(prompt) scan below
            raise ValueError(f"input_ids: prompt ({len(prompt)}) + max_new_tokens ({item.sampling.max_new_tokens}) "
                             f"exceeds the context length {self.context_length}")
        if item.input_ids is not None and max(prompt) >= vocab:
            bad = [t for t in prompt if t >= vocab]
            raise ValueError(f"input_ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if any(t >= vocab for t in item.sampling.stop_token_ids):
            raise ValueError(f"sampling_params.stop_token_ids: ids outside the vocabulary [0, {vocab}): "
                             f"{[t for t in item.sampling.stop_token_ids if t >= vocab][:5]}")
        if item.return_logprob and item.logprob_start_len > len(prompt):
            raise ValueError(f"logprob_start_len: {item.logprob_start_len} is larger than the prompt "
                             f"({len(prompt)} tokens)")
        if item.top_logprobs_num > vocab:
            raise ValueError(f"top_logprobs_num: must be in [0, {vocab}]")
        if item.sampling.min_new_tokens > item.sampling.max_new_tokens:
            raise ValueError("sampling_params.min_new_tokens: must be <= max_new_tokens")
        if item.return_routed_experts and not self.args.enable_return_routed_experts:
            raise ValueError("return_routed_experts: the engine records routing only when started with "
                             "--enable-return-routed-experts")

    # Control (each runs on the engine thread, between steps) --------------------------------
    def update_weights(self, receive: Callable[[], dict[str, torch.Tensor]], strict: bool, version: Optional[str],
                       flush_cache: bool, abort_all: bool = False) -> Future:
        """Load the HF-named tensors `receive` returns in place (strict: every tensor of the model); running
        requests continue with them (their weight_versions spans split). flush_cache drops the radix
        cache, whose KV was computed with the old weights. While the weights are released the update is
        refused, but `receive` still runs: a broadcast must be taken, or the trainer hangs in it."""
        def apply() -> str:
            if "weights" in self.released:
                receive()
                self._require_weights("update them")
            if abort_all:
                self.scheduler.abort(None, "aborted for a weight update")
            tensors = receive()
            load_weights(self.model, tensors, strict=strict)
            count = len(tensors)
            if flush_cache:
                self.scheduler.flush_cache()
            if version is not None:
                self.scheduler.weight_version = version
            log.info("updated %d tensors; weight_version %s", count, self.weight_version)
            return f"Updated {count} tensors."
        return self.call(apply)

    def weights_by_name(self, name: str, rows: int) -> list:
        """SGLang's get_weights_by_name (engine thread): the first `rows` rows of an HF-named tensor, fp32."""
        self._require_weights("read them")
        tensors = self.model.state_dict()
        if name not in tensors:
            raise ValueError(f"no tensor named {name!r} (HF names, e.g. model.layers.0.self_attn.q_a_proj.weight)")
        return tensors[name][:rows].float().tolist()

    def _require_weights(self, action: str) -> None:
        if "weights" in self.released:
            raise ValueError(f"the weights are released (release_memory_occupation): resume_memory_occupation "
                             f"with tag 'weights' before you {action}")

    def release_memory(self, tags: frozenset[str]) -> str:
        """SGLang's release_memory_occupation (engine thread): free the KV pool and/or the weights of an
        idle engine. Until everything is resumed no step runs; requests that arrive meanwhile wait."""
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        if running or waiting:
            raise ValueError(f"release_memory_occupation needs an idle engine ({running} running, {waiting} waiting "
                             "requests); abort or finish them first")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.scheduler.flush_cache()
            self.cache = None
        if "weights" in tags and "weights" not in self.released:
            self._weights_backup = Path(tempfile.mkdtemp(prefix="asyncrl-released-weights-"))
            self._weights_shapes = offload_weights(self.model, self._weights_backup)
        self.released |= tags & RELEASABLE
        gc.collect()  # reference cycles (a failed command's traceback, say) can keep the pool's tensors alive
        log.info("memory released: %s", sorted(self.released))
        return f"Released {sorted(tags)}."

    def resume_memory(self, tags: frozenset[str]) -> str:
        """SGLang's resume_memory_occupation (engine thread): the KV pool comes back empty, the weights as
        they were released."""
        if "weights" in tags and "weights" in self.released:
            restore_weights(self.model, self._weights_backup, self._weights_shapes)
            shutil.rmtree(self._weights_backup, ignore_errors=True)
            self._weights_backup = None
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.cache = self._new_cache()
        self.released -= tags
        log.info("memory resumed: %s; still released: %s", sorted(tags), sorted(self.released))
        return f"Resumed {sorted(tags)}."

    # Engine thread ----------------------------------------------------------------------------
    def _new_cache(self) -> KVCache:
        return KVCache(self.config, self.args.max_total_tokens, dtype=self.model.dtype,
                       record_routing=self.args.enable_return_routed_experts, mtp=self.num_draft_tokens > 0)

    def _forward(self, batch) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.forward_batch(batch, self.cache)

    def _draft_forward(self, hidden: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return self.model.draft_batch(hidden, batch, self.cache)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            try:
                worked = not self.released and self.scheduler.step()
            except Exception:  # a bug must not hang clients: fail what is in flight, keep serving
                log.exception("engine step failed; aborting in-flight requests")
                self.scheduler.abort(None, "engine step failed (see engine log)")
                worked = False
            if worked:
                self.steps += 1
            else:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                command.future.set_result(command.fn())
            except Exception as err:  # reported to the caller, e.g. a 400 for a bad checkpoint
                command.future.set_exception(err)

    # Introspection ----------------------------------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        args = {k: v for k, v in asdict(self.args).items() if k != "api_key"}
        return {**args, "context_length": self.context_length, "version": VERSION,
                "weight_version": self.weight_version, "max_total_num_tokens": self.args.max_total_tokens,
                "kv_cache_bytes_per_token": self.kv_bytes_per_token, "pid": os.getpid(),
                "memory_released": sorted(self.released), "startup_time": self.startup_time,
                "frontend": "python"}  # SGLang's: which of its servers answers (python, not the Rust one)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
                "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
                "served_model_name": self.args.served_model_name,
                # the rest of SGLang's /model_info keys, at its defaults for a text-only model served alone
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False}


def _draft_tokens(args: EngineArgs, mtp_layers: int) -> int:
    """Drafts per decode step (0: no speculative decoding); a ValueError naming the flag it cannot serve."""
    if args.speculative_algorithm is None:
        return 0
    if args.speculative_algorithm not in ("NEXTN", "EAGLE"):
        raise ValueError(f"speculative_algorithm {args.speculative_algorithm!r}: only NEXTN / EAGLE (the MTP layer)")
    if not mtp_layers:
        raise ValueError("speculative_algorithm: the checkpoint has no MTP layer (num_nextn_predict_layers 0)")
    if args.speculative_eagle_topk != 1:
        raise ValueError(f"speculative_eagle_topk {args.speculative_eagle_topk}: only chains (1) are supported")
    if args.speculative_num_steps < 1:
        raise ValueError("speculative_num_steps: must be >= 1")
    chain = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens not in (None, chain):
        raise ValueError(f"speculative_num_draft_tokens {args.speculative_num_draft_tokens}: a chain of "
                         f"{args.speculative_num_steps} steps verifies {chain}")
    return args.speculative_num_steps


def _load_tokenizer(args: EngineArgs) -> Tokenizer:
    if args.tokenizer_path:
        return load_tokenizer(args.tokenizer_path)
    local = Path(args.model_path) / "tokenizer.json"
    return load_tokenizer(local.parent if local.exists() else "builtin:tiny")
