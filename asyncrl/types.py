"""Token-level records that cross process boundaries: a finished trajectory (Sample) and a GRPO group.

Encoding (documented contract, see docs/store.md): a Sample is one msgpack map. The four per-token
arrays are packed little-endian bytes, not lists: tokens int32, loss_mask uint8, rollout_logprobs
float32, weight_versions int32. A 4k-token sample is ~52 KB instead of ~150 KB of JSON floats, and
decoding is a zero-copy `np.frombuffer`. `SCHEMA_VERSION` is bumped on any incompatible change.
Two optional arrays follow, each left out of the encoding when None: `temperatures` (float32 [tokens], the
temperature of each log-prob) and, for routing replay, `routed_experts` (int16 [tokens, layers x top_k]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np

SCHEMA_VERSION = 1

SAMPLE_STATUSES = ("completed", "failed", "truncated", "aborted")
"""completed / truncated (the model ran out of turns or tokens): model outcomes, trained; failed: the
environment or the infrastructure broke (env error, sandbox, LLM endpoint, deadline, env service), dropped
by the trainer and invalid for the group rule; aborted: cancelled or re-dispatched (never reaches the
trainer). The class and reason of the outcome are in metadata["info"] (Sample.outcome_class, .outcome_reason;
docs/envs.md "Outcomes")."""

_ARRAYS = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "rollout_logprobs": np.dtype("<f4"),
    "weight_versions": np.dtype("<i4"),
}
_ROUTING_DTYPE = np.dtype("<i2")  # expert ids: GLM-5 has 256 routed experts
_TEMPERATURE_DTYPE = np.dtype("<f4")
_OPTIONAL_ARRAYS = ("routed_experts", "temperatures")


@dataclass
class Sample:
    """One trajectory segment: the exact token sequence the model saw and produced.

    Per-token arrays are aligned with `tokens`: loss_mask is 1 exactly on model-generated tokens;
    rollout_logprobs is the engine's log-prob of each generated token (0 where mask is 0);
    weight_versions is the weight version that generated each token (-1 where mask is 0).
    """

    sample_id: str
    session_id: str
    group_id: str
    task_id: str
    env: str
    status: str
    reward: float
    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    weight_versions: np.ndarray
    num_turns: int = 0
    engines: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Optional[np.ndarray] = None
    """Routing replay (R3): int16 [tokens, layers x top_k], row i the experts the engine's MoE layers sent
    token i to (-1: unknown, e.g. the last token, which no forward saw); None when not recorded."""
    temperatures: Optional[np.ndarray] = None
    """float32 [tokens]: the temperature T of the distribution log_softmax(logits / T) that token i's
    rollout log-prob was taken from (1.0 on prompt tokens and greedy turns); the trainer computes its
    log-probs at the same T. None: 1.0 everywhere."""

    def __post_init__(self) -> None:
        for name, dtype in _ARRAYS.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        if self.temperatures is not None:
            self.temperatures = np.ascontiguousarray(self.temperatures, dtype=_TEMPERATURE_DTYPE)
        n = len(self.tokens)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions", "temperatures"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"Sample {self.sample_id}: {name} has {len(values)} entries, tokens {n}")
        if self.routed_experts is not None:
            self.routed_experts = np.ascontiguousarray(self.routed_experts, dtype=_ROUTING_DTYPE)
            if self.routed_experts.ndim != 2 or len(self.routed_experts) != n:
                raise ValueError(f"Sample {self.sample_id}: routed_experts has shape {self.routed_experts.shape}, "
                                 f"expected [{n}, layers x top_k]")
        if self.status not in SAMPLE_STATUSES:
            raise ValueError(f"Sample {self.sample_id}: status {self.status!r} not in {SAMPLE_STATUSES}")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def outcome_class(self) -> str:
        """model, environment or infrastructure, as the orchestrator finished the session; "" if not recorded."""
        return str(self.metadata.get("info", {}).get("outcome", ""))

    @property
    def outcome_reason(self) -> str:
        """Why the episode ended (completed, max_turns, deadline_exceeded, ...); "" if not recorded."""
        return str(self.metadata.get("info", {}).get("reason", ""))

    @property
    def first_weight_version(self) -> int:
        """Oldest weight version among generated tokens (staleness is measured from it); -1 if none."""
        generated = self.weight_versions[self.loss_mask.astype(bool)]
        return int(generated.min()) if generated.size else -1

    def encode(self) -> bytes:
        payload = {k: v for k, v in self.__dict__.items() if k not in _ARRAYS and k not in _OPTIONAL_ARRAYS}
        payload.update({k: getattr(self, k).tobytes() for k in _ARRAYS})
        if self.temperatures is not None:
            payload["temperatures"] = self.temperatures.tobytes()
        if self.routed_experts is not None:
            payload["routed_experts"] = self.routed_experts.tobytes()
            payload["routed_experts_width"] = self.routed_experts.shape[1]
        payload["v"] = SCHEMA_VERSION
        return msgpack.packb(payload, use_bin_type=True)

    @classmethod
    def decode(cls, blob: bytes) -> "Sample":
        payload = msgpack.unpackb(blob, raw=False)
        version = payload.pop("v", None)
        if version != SCHEMA_VERSION:
            raise ValueError(f"Sample schema version {version} (this build reads {SCHEMA_VERSION})")
        for name, dtype in _ARRAYS.items():
            payload[name] = np.frombuffer(payload[name], dtype=dtype)
        if "temperatures" in payload:
            payload["temperatures"] = np.frombuffer(payload["temperatures"], dtype=_TEMPERATURE_DTYPE)
        if "routed_experts" in payload:
            width = payload.pop("routed_experts_width")
            payload["routed_experts"] = np.frombuffer(payload["routed_experts"], dtype=_ROUTING_DTYPE).reshape(-1, width)
        return cls(**payload)


def agent_health(samples: list[Sample]) -> dict[str, float]:
    """Per sample means of the agent's turns and tool use (docs/run.md "Agent metrics"): model turns, tool
    calls the gateway parsed from the model's replies, tool calls it opened that did not parse, and tool errors
    the env's tool log counted (refused calls, failed commands; the episode's count, on its first segment).
    The trainer logs them per step, `asyncrl eval` per held-out split: one definition for both."""
    def mean(values) -> float:
        return float(np.mean(list(values))) if samples else 0.0

    return {"turns_mean": mean(s.num_turns for s in samples),
            "tool_calls_mean": mean(s.metadata.get("tool_calls", 0) for s in samples),
            "tool_call_parse_failures_mean": mean(s.metadata.get("tool_call_parse_failures", 0) for s in samples),
            "tool_errors_mean": mean(_tool_errors(s) for s in samples)}


def _tool_errors(sample: Sample) -> int:
    if sample.metadata.get("segment", 0) != 0:
        return 0
    return int(((sample.metadata.get("info") or {}).get("tools") or {}).get("errors", 0))


@dataclass
class GroupRecord:
    """A complete GRPO group: every member episode finished or was given up.

    `sample_refs` are stream ids in the samples stream (one per recorded segment; a member whose
    episode failed contributes its failed sample, so the trainer can apply the padding rule).
    """

    group_id: str
    task_id: str
    env: str
    sample_refs: list[str]
    group_size: int
    created_at: float = 0.0
    filtered_before: int = 0
    """Groups the orchestrator's dynamic sampling filtered (equal rewards, never appended) since the
    record before this one: summed over a step's groups, the uninformative groups it took to fill it."""

    def encode(self) -> dict[str, bytes]:
        return {"group_id": self.group_id, "v": str(SCHEMA_VERSION),
                "data": msgpack.packb(self.__dict__, use_bin_type=True)}

    @classmethod
    def decode(cls, fields: dict[bytes, bytes]) -> "GroupRecord":
        return cls(**msgpack.unpackb(fields[b"data"], raw=False))


@dataclass
class TrainingGroup:
    """What the trainer consumes: a group record with its decoded samples and its stream id."""

    stream_id: str
    record: GroupRecord
    samples: list[Sample]


@dataclass
class TrainedTokens:
    """What the trainer made of one sample (the `trained` hash, keyed by the sample's stream id): the
    trainer's own log-prob of every token, taken at the step's forward before its update (the log-prob the
    importance ratio uses), and which loss tokens the trust band kept. Arrays are aligned with the sample's
    `tokens`, like its rollout_logprobs: index i is token i given tokens < i (0 / 0 where not a loss token).
    Dashboards put it side by side with the rollout's log-probs (docs/store.md)."""

    sample_ref: str
    step: int
    """The optimizer step that trained the sample."""
    weight_version: int
    """The trainer's weight version during that step (the weights these log-probs come from)."""
    trainer_logprobs: np.ndarray
    kept: np.ndarray
    """uint8: 1 on loss tokens inside the trust band (they carried gradient), 0 elsewhere."""

    def __post_init__(self) -> None:
        self.trainer_logprobs = np.ascontiguousarray(self.trainer_logprobs, dtype="<f4")
        self.kept = np.ascontiguousarray(self.kept, dtype="u1")
        if len(self.kept) != len(self.trainer_logprobs):
            raise ValueError(f"TrainedTokens {self.sample_ref}: kept has {len(self.kept)} entries, "
                             f"trainer_logprobs {len(self.trainer_logprobs)}")

    def encode(self) -> bytes:
        return msgpack.packb({"v": SCHEMA_VERSION, "sample_ref": self.sample_ref, "step": self.step,
                              "weight_version": self.weight_version,
                              "trainer_logprobs": self.trainer_logprobs.tobytes(), "kept": self.kept.tobytes()},
                             use_bin_type=True)

    @classmethod
    def decode(cls, blob: bytes) -> "TrainedTokens":
        payload = msgpack.unpackb(blob, raw=False)
        if payload.pop("v", None) != SCHEMA_VERSION:
            raise ValueError("TrainedTokens of another schema version")
        payload["trainer_logprobs"] = np.frombuffer(payload["trainer_logprobs"], dtype="<f4")
        payload["kept"] = np.frombuffer(payload["kept"], dtype="u1")
        return cls(**payload)
