"""Wire types of the engine HTTP API (docs/protocols/engine.md = SGLang's native API).

Names follow SGLang's io_struct (`GenerateReqInput` -> `GenerateRequest`, ...). Unknown keys are
ignored (SGLang clients send many optional fields), except SGLang options this engine does not implement
and whose absence would change the answer (penalties, constrained decoding, LoRA, multimodal or embedding
inputs, ...): set to anything but their neutral value they are a 400 naming the field, as is a value of
the wrong type or range: numbers and booleans are strict (`true` is not a token id, `"1"` not a
temperature), token ids and seeds are non-negative, and what depends on the model (ids below the
vocabulary size, the context length) is checked by the engine when a request is submitted. A batch
request (`input_ids` as a list of lists, or `text` as a list) is split once, by rollout/batch.py, into
single `GenerateItem`s; nothing downstream handles the single-or-batch union.

Wire types and their validators only: the logic that reads or builds them lives with its users
(rollout/batch.py, asyncrl/engine_response.py, asyncrl/version_spans.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from asyncrl.protocols.fields import LongIds
from asyncrl.sampling import RESHAPING_SAMPLING, is_greedy

Float = Annotated[float, Strict()]
"""A JSON number (an integer too), never a string or a boolean."""
TokenId = Annotated[int, Strict(), Field(ge=0)]
MAX_SEED = 2 ** 64 - 1
"""Seeds are unsigned 64-bit (the sampler's counter-based generator)."""
MAX_ITEMS_PER_REQUEST = 4096
"""Prompts x n of one /generate call: n is multiplied out into requests before anything else."""


class _SglangRequest(BaseModel):
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


def _empty(v: Any) -> bool:
    return not v


class SamplingParams(_SglangRequest):
    """SGLang sampling parameters; null means the default."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        name: neutral for name, (neutral, _) in RESHAPING_SAMPLING.items()}
    """The distribution-reshaping fields of asyncrl/sampling.py: this engine implements none of them."""

    temperature: Float = Field(1.0, ge=0.0)
    """Greedy below asyncrl/sampling.py's GREEDY_TEMPERATURE (0 included), and 0 from here on."""
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
    """Parallel samples of the prompt (SGLang's n): the request fans out into n copies (rollout/batch.py)."""

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
        return 0.0 if is_greedy(v) else v


LogprobStart = Annotated[int, Strict(), Field(ge=-1)]
TopLogprobs = Annotated[int, Strict(), Field(ge=0)]


class GenerateRequest(_SglangRequest):
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


# Responses -------------------------------------------------------------------------------------
LogprobEntry = list  # [logprob or None, token_id, text or None]


class WeightVersionSpan(BaseModel):
    """asyncrl extension: output tokens [start, end) were generated under `version`."""

    version: str
    start: int
    end: int


class MetaInfo(BaseModel):
    id: str
    finish_reason: Optional[dict[str, Any]] = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[WeightVersionSpan] = Field(default_factory=list)
    """SGLang 0.5.23 sends them (and e2e_latency) on a request's finishing event only; none: all weight_version."""
    e2e_latency: float = 0.0
    input_token_logprobs: Optional[list[LogprobEntry]] = None
    output_token_logprobs: Optional[list[LogprobEntry]] = None
    input_top_logprobs: Optional[list[Optional[list[LogprobEntry]]]] = None
    output_top_logprobs: Optional[list[list[LogprobEntry]]] = None
    output_token_logprobs_length: Optional[int] = None
    """SGLang's: output log-prob entries so far (an incremental stream event's list holds the new ones only)."""
    routed_experts: Optional[str] = None
    """base64 of int32 [prompt + output tokens - 1, layers, num_experts_per_tok]
    (asyncrl.engine_response.routed_experts decodes it)."""
    spec_verify_ct: Optional[int] = None
    """Speculative decoding (SGLang's): verification forwards of the request; accept length =
    completion_tokens / spec_verify_ct. Absent without speculation."""


class GenerateResponse(BaseModel):
    text: Optional[str] = None
    output_ids: list[int]
    meta_info: MetaInfo


# Control endpoints -----------------------------------------------------------------------------
class AbortRequest(_SglangRequest):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(_SglangRequest):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(_SglangRequest):
    """POST /release_memory_occupation and /resume_memory_occupation (SGLang's): which memory, by tag
    ("weights", "kv_cache", "cuda_graph"); none or empty: all of it."""

    tags: Optional[list[str]] = None


class UpdateWeightVersionRequest(_SglangRequest):
    """POST /update_weight_version (SGLang's): a new version label for the current weights."""

    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameRequest(_SglangRequest):
    """GET/POST /get_weights_by_name (SGLang's, for checking a weight sync): the first `truncate_size`
    rows of one HF-named tensor."""

    name: str
    truncate_size: int = Field(100, ge=1)


class UpdateWeightsFromDiskRequest(_SglangRequest):
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_SglangRequest):
    serialized_named_tensors: list[StrictStr]
    """One entry per tensor-parallel rank (one here). With load_format `asyncrl_safetensors_b64`
    each entry is a base64 string of a safetensors blob holding the named tensors (docs/engine.md)."""
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    flush_cache: bool = True


class InitWeightsUpdateGroupRequest(_SglangRequest):
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


class UpdateWeightsFromDistributedRequest(_SglangRequest):
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


class DestroyWeightsUpdateGroupRequest(_SglangRequest):
    group_name: str = "weight_update_group"


class SuccessResponse(BaseModel):
    """SGLang's answer to a control call: {"success", "message"} (a refusal too, with success false)."""

    success: bool
    message: str


class WeightsUpdateResponse(SuccessResponse):
    num_paused_requests: int = 0


class UpdateWeightVersionResponse(SuccessResponse):
    new_version: str


class AbortResponse(BaseModel):
    success: bool
    num_aborted: int


class GenerationStatusResponse(BaseModel):
    message: str = ""
    """SGLang's: "Generation paused successfully." / "Generation continued successfully."."""
    status: str = "ok"


class WeightVersionResponse(BaseModel):
    weight_version: str


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


class RankLoad(BaseModel):
    """One entry of GET /get_load: what sglang-router polls for its load-aware policies."""

    dp_rank: int = 0
    num_reqs: int
    """Running plus waiting requests."""
    num_waiting_reqs: int
    num_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "asyncrl"
    root: str


class ModelList(BaseModel):
    """GET /v1/models (OpenAI's shape): the one served model."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
