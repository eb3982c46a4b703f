"""Wire types of the engine HTTP API (docs/protocols/engine.md = SGLang's native API).

Names follow SGLang's io_struct (`GenerateReqInput` -> `GenerateRequest`, ...). Unknown keys are
ignored (SGLang clients send many optional fields), except SGLang options this engine does not implement
and whose absence would change the answer (penalties, constrained decoding, LoRA, multimodal or embedding
inputs, ...): set to anything but their neutral value they are a 400 naming the field, as is a value of
the wrong type or range: numbers and booleans are strict (`true` is not a token id, `"1"` not a
temperature), token ids and seeds are non-negative, and what depends on the model (ids below the
vocabulary size, the context length) is checked by the engine when a request is submitted. A batch request (`input_ids` as a list of lists, or `text` as a list) is
split once, here, into single `GenerateItem`s; nothing downstream handles the single-or-batch union.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from asyncrl.protocols.fields import LongIds

Float = Annotated[float, Strict()]
"""A JSON number (an integer too), never a string or a boolean."""
TokenId = Annotated[int, Strict(), Field(ge=0)]
MAX_SEED = 2 ** 64 - 1
"""Seeds are unsigned 64-bit (the sampler's counter-based generator)."""
GREEDY_TEMPERATURE = 1e-6
"""A temperature below this samples greedily (SGLang's _SAMPLING_EPS): dividing logits by it overflows."""
MAX_ITEMS_PER_REQUEST = 4096
"""Prompts x n of one /generate call: n is multiplied out into requests before anything else."""


class _Lenient(BaseModel):
    """Unknown fields are ignored (clients send SGLang options this engine has no use for), except the
    `UNSUPPORTED` ones set to a non-neutral value: ignoring those would silently change the answer."""

    model_config = ConfigDict(extra="ignore")
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {}
    """field -> is this value neutral (what the field's absence means)"""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in cls.UNSUPPORTED.items():
                if data.get(name) is not None and not neutral(data[name]):
                    raise ValueError(f"{name}: not supported by this engine (got {data[name]!r})")
        return data


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def _empty(v: Any) -> bool:
    return not v


class SamplingParams(_Lenient):
    """SGLang sampling parameters; null means the default."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "frequency_penalty": _is(0), "presence_penalty": _is(0), "repetition_penalty": _is(1), "json_schema": _empty,
        "regex": _empty, "ebnf": _empty, "structural_tag": _empty, "logit_bias": _empty, "custom_params": _empty}

    temperature: Float = Field(1.0, ge=0.0)
    """Below GREEDY_TEMPERATURE (0 included): greedy."""
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1)
    """-1 (or 0) disables top-k."""
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: StrictInt = Field(128, ge=0)
    min_new_tokens: StrictInt = Field(0, ge=0)
    stop: list[Annotated[str, Strict(), Field(min_length=1)]] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    spaces_between_special_tokens: StrictBool = True
    sampling_seed: Optional[Annotated[int, Strict(), Field(ge=0, le=MAX_SEED)]] = None
    """Seeds this request's own generator: its samples do not depend on what else is batched."""
    n: StrictInt = Field(1, ge=1, le=MAX_ITEMS_PER_REQUEST)
    """Parallel samples of the prompt (SGLang's n): the request fans out into n copies (split_batch)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
            if isinstance(data.get("stop"), str):
                data["stop"] = [data["stop"]]
        return data

    @field_validator("temperature")
    @classmethod
    def _greedy_below_eps(cls, v: float) -> float:
        return 0.0 if v < GREEDY_TEMPERATURE else v


LogprobStart = Annotated[int, Strict(), Field(ge=-1)]
TopLogprobs = Annotated[int, Strict(), Field(ge=0)]


class GenerateRequest(_Lenient):
    """POST /generate body (single or batch)."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "input_embeds": _empty, "image_data": _empty, "video_data": _empty, "audio_data": _empty, "lora_path": _empty,
        "return_hidden_states": _empty, "token_ids_logprob": _empty,
        "custom_logit_processor": _empty}

    rid: Optional[Union[StrictStr, list[StrictStr]]] = None
    text: Optional[Union[StrictStr, list[StrictStr]]] = None
    input_ids: Optional[Annotated[Union[list[TokenId], list[list[TokenId]]], LongIds]] = None
    sampling_params: Optional[Union[SamplingParams, list[SamplingParams]]] = None
    return_logprob: Union[StrictBool, list[StrictBool]] = False
    logprob_start_len: Union[LogprobStart, list[LogprobStart]] = -1
    """First prompt position whose log-prob is returned; -1: none of the prompt."""
    top_logprobs_num: Union[TopLogprobs, list[TopLogprobs]] = 0
    return_text_in_logprobs: StrictBool = False
    return_routed_experts: Union[StrictBool, list[StrictBool]] = False
    """meta_info.routed_experts of the finished request (server started with --enable-return-routed-experts)."""
    stream: StrictBool = False

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' or 'input_ids' must be given")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    @property
    def parallel_samples(self) -> int:
        """SGLang's n: one value for the whole request (a batch's sampling_params must agree on it)."""
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        counts = {p.n if p is not None else 1 for p in params} or {1}
        if len(counts) > 1:
            raise ValueError(f"sampling_params: every prompt of a batch needs the same n (got {sorted(counts)})")
        return counts.pop()

    @property
    def returns_list(self) -> bool:
        """A batch, or n > 1, answers with a list (prompt-major: prompt 0's n samples first)."""
        return self.is_batch or self.parallel_samples > 1


class GenerateItem(BaseModel):
    """One request after batch splitting: what the scheduler runs."""

    rid: str
    input_ids: Optional[list[int]] = None
    text: Optional[str] = None
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False


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


# Responses -------------------------------------------------------------------------------------
LogprobEntry = list  # [logprob or None, token_id, text or None]


class WeightVersionSpan(BaseModel):
    """asyncrl extension: output tokens [start, end) were generated under `version`."""

    version: str
    start: int
    end: int


def version_spans(versions: list[Any], spans: Optional[list[dict[str, Any]]] = None, offset: int = 0
                  ) -> list[dict[str, Any]]:
    """Per-token weight versions -> `weight_versions` spans [{"version", "start", "end"}] (versions as strings).
    Given `spans` (of the tokens before `offset`), extends them in place with the tokens from `offset` on."""
    spans = [] if spans is None else spans
    for i, version in enumerate(map(str, versions), start=offset):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


class MetaInfo(BaseModel):
    id: str
    finish_reason: Optional[dict[str, Any]] = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[WeightVersionSpan]
    e2e_latency: float
    input_token_logprobs: Optional[list[LogprobEntry]] = None
    output_token_logprobs: Optional[list[LogprobEntry]] = None
    input_top_logprobs: Optional[list[Optional[list[LogprobEntry]]]] = None
    output_top_logprobs: Optional[list[list[LogprobEntry]]] = None
    routed_experts: Optional[str] = None
    """base64 of int32 [prompt + output tokens - 1, layers, num_experts_per_tok] (see routed_experts())."""


def routed_experts(meta: MetaInfo, num_tokens: int) -> np.ndarray:
    """SGLang's meta_info.routed_experts -> int32 [num_tokens, layers x top_k] (reshape to [.., layers, top_k]
    with the model's sizes): the experts each MoE layer sent token t of prompt + output to, for the tokens
    that went through a forward (a finished request: all but the last output token). This engine writes -1
    on dense layers; SGLang leaves whatever its buffer holds there."""
    if meta.routed_experts is None:
        raise ValueError("the response has no routed_experts: ask with return_routed_experts=True")
    flat = np.frombuffer(base64.b64decode(meta.routed_experts), dtype=np.int32)
    if num_tokens <= 0 or flat.size % num_tokens:
        raise ValueError(f"routed_experts holds {flat.size} expert ids: not a row per token for {num_tokens} tokens")
    return flat.reshape(num_tokens, -1)


class GenerateResponse(BaseModel):
    text: Optional[str] = None
    output_ids: list[int]
    meta_info: MetaInfo


class StreamAccumulator:
    """Cumulative snapshots from /generate stream events of either SGLang mode. A cumulative event
    (the default) carries all output so far: it replaces the snapshot. An incremental one
    (--incremental-streaming-output) carries fewer output_ids than meta_info.completion_tokens: its ids,
    text, output log-prob entries and weight-version spans extend the snapshot. Only the event itself is
    validated, so reading an incremental stream costs O(new tokens) per event plus list copies."""

    def __init__(self) -> None:
        self.snapshot: Optional[GenerateResponse] = None

    def add(self, event: dict[str, Any]) -> GenerateResponse:
        """-> the snapshot after `event` (a new object: earlier snapshots stay as they were)."""
        part = GenerateResponse.model_validate(event)
        if self.snapshot is None or len(part.output_ids) == part.meta_info.completion_tokens:
            self.snapshot = part
            return part
        done, meta = self.snapshot, part.meta_info
        if len(done.output_ids) + len(part.output_ids) != meta.completion_tokens:
            raise ValueError(f"stream event of {len(part.output_ids)} new tokens after {len(done.output_ids)} does "
                             f"not add up to completion_tokens {meta.completion_tokens}")
        update: dict[str, Any] = {"weight_versions": _join_spans(done.meta_info.weight_versions, meta.weight_versions)}
        for key in ("output_token_logprobs", "output_top_logprobs"):
            earlier, new = getattr(done.meta_info, key), getattr(meta, key)
            if earlier is not None or new is not None:
                update[key] = (earlier or []) + (new or [])
        self.snapshot = GenerateResponse.model_construct(
            text=(done.text or "") + (part.text or ""), output_ids=done.output_ids + part.output_ids,
            meta_info=meta.model_copy(update=update))
        return self.snapshot


def _join_spans(spans: list[WeightVersionSpan], new: list[WeightVersionSpan]) -> list[WeightVersionSpan]:
    """Spans of the tokens so far followed by those of the next tokens, merging a version that continues."""
    if spans and new and spans[-1].version == new[0].version and spans[-1].end == new[0].start:
        return [*spans[:-1], spans[-1].model_copy(update={"end": new[0].end}), *new[1:]]
    return [*spans, *new]


# Control endpoints -----------------------------------------------------------------------------
class AbortRequest(_Lenient):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(_Lenient):
    """POST /release_memory_occupation and /resume_memory_occupation (SGLang's): which memory, by tag
    ("weights", "kv_cache", "cuda_graph"); none or empty: all of it."""

    tags: Optional[list[str]] = None


class UpdateWeightVersionRequest(_Lenient):
    """POST /update_weight_version (SGLang's): a new version label for the current weights."""

    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameRequest(_Lenient):
    """GET/POST /get_weights_by_name (SGLang's, for checking a weight sync): the first `truncate_size`
    rows of one HF-named tensor."""

    name: str
    truncate_size: int = Field(100, ge=1)


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_Lenient):
    serialized_named_tensors: list[StrictStr]
    """One entry per tensor-parallel rank (one here). With load_format `asyncrl_safetensors_b64`
    each entry is a base64 string of a safetensors blob holding the named tensors (docs/engine.md)."""
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    flush_cache: bool = True


class InitWeightsUpdateGroupRequest(_Lenient):
    master_address: StrictStr = Field(min_length=1)
    """Host name or IP of rank 0 (the trainer); the engine checks that it resolves before joining."""
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2)
    group_name: StrictStr = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _rank_in_group(self) -> "InitWeightsUpdateGroupRequest":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedRequest(_Lenient):
    names: list[StrictStr]
    dtypes: list[Literal["float32", "bfloat16", "float16"]]
    shapes: list[list[Annotated[int, Strict(), Field(ge=0)]]]
    group_name: str = "weight_update_group"
    weight_version: Optional[str] = None
    flush_cache: bool = True

    @model_validator(mode="after")
    def _aligned(self) -> "UpdateWeightsFromDistributedRequest":
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("'names', 'dtypes' and 'shapes' must have the same length")
        return self


class DestroyWeightsUpdateGroupRequest(_Lenient):
    group_name: str = "weight_update_group"


class WeightsUpdateResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class StatusResponse(BaseModel):
    status: str = "ok"


class LoadEntry(BaseModel):
    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int = 0
    num_tokens: int = 0
    """SGLang's load figure: KV tokens in use plus tokens waiting for admission."""
    max_total_num_tokens: int = 0


class LoadsResponse(BaseModel):
    loads: list[LoadEntry]
