"""Architecture of the GLM-5 MoE + MLA + DSA model (HF `model_type: glm_moe_dsa`).

Field names are exactly those of the Hugging Face `config.json`, so a config moves between asyncrl,
transformers, SGLang and Megatron bridges unchanged. This module imports no torch: loading a run
config (and `--help`) stays instant.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"


@dataclass
class ModelConfig:
    """GLM-5 hyper-parameters. Defaults are GLM-5.1's; configs/model/*.yaml override them."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    """Width of the dense SwiGLU MLP used by the first `first_k_dense_replace` layers."""
    moe_intermediate_size: int = 2048
    """Width of each routed expert (and, times n_shared_experts, of the shared expert)."""
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    """MLA has no GQA: kept equal to num_attention_heads, present for HF compatibility."""
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    """Expert groups for group-limited routing (keep `topk_group` groups, then top-k experts)."""
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = 0
    eos_token_id: Any = 1
    """An int or a list of ints (HF allows both)."""
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    """HF >= 5 rope dict: rope_type, rope_theta, and yarn keys (factor, mscale_all_dim, ...)."""
    attention_bias: bool = False
    first_k_dense_replace: int = 3
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: Optional[list[str]] = None
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's top-k).
    None: every layer is full. Read it through `layer_indexer_types`."""
    mlp_layer_types: Optional[list[str]] = None
    """Per layer "dense" or "sparse"; None derives it from first_k_dense_replace (`layer_mlp_types`)."""
    num_nextn_predict_layers: int = 0
    """MTP layers (asyncrl.model.mtp), stored after the decoder layers as model.layers.{num_hidden_layers + i}."""
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        self.validate()

    # Derived values (fields stay None when unset, so a yaml override of num_hidden_layers
    # re-derives them instead of inheriting 78 entries from the defaults) ----------------------
    @property
    def layer_indexer_types(self) -> list[str]:
        return list(self.indexer_types) if self.indexer_types is not None else ["full"] * self.num_hidden_layers

    @property
    def layer_mlp_types(self) -> list[str]:
        if self.mlp_layer_types is not None:
            return list(self.mlp_layer_types)
        n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        return ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)

    def indexer_type(self, layer_idx: int) -> str:
        """Of a decoder layer, or "full" for an MTP layer (idx >= num_hidden_layers): it runs alone,
        so there is no previous layer's top-k to share (SGLang builds its NextN attention with an indexer)."""
        return self.layer_indexer_types[layer_idx] if layer_idx < self.num_hidden_layers else "full"

    def mlp_type(self, layer_idx: int) -> str:
        """Of a decoder layer, or "sparse" for an MTP layer (SGLang: `_is_layer_sparse` is True when is_nextn)."""
        return self.layer_mlp_types[layer_idx] if layer_idx < self.num_hidden_layers else "sparse"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per layer: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def validate(self) -> None:
        """Fail at construction with a message naming the inconsistent field."""
        indexer_types, mlp_types = self.layer_indexer_types, self.layer_mlp_types
        checks = [
            (len(indexer_types) == self.num_hidden_layers, "indexer_types must have num_hidden_layers entries"),
            (set(indexer_types) <= {"full", "shared"}, "indexer_types entries must be 'full' or 'shared'"),
            (not indexer_types or indexer_types[0] == "full", "indexer_types[0] must be 'full'"),
            (len(mlp_types) == self.num_hidden_layers, "mlp_layer_types must have num_hidden_layers entries"),
            (set(mlp_types) <= {"dense", "sparse"}, "mlp_layer_types entries must be 'dense' or 'sparse'"),
            (self.n_routed_experts % self.n_group == 0, "n_routed_experts must be divisible by n_group"),
            (self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
             "group-limited routing ranks groups by their top-2 experts: n_group > 1 needs >= 2 experts per group"),
            (self.hidden_act == "silu", "hidden_act must be 'silu' (the SwiGLU of GLM-5)"),
            (self.topk_group <= self.n_group, "topk_group must be <= n_group"),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (interleaved RoPE pairs)"),
            (self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim must be >= qk_rope_head_dim"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"ModelConfig: {message}")

    # HF interop ----------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` transformers' GlmMoeDsaConfig reads."""
        out = dataclasses.asdict(self)
        out.update(model_type=MODEL_TYPE, architectures=[ARCHITECTURE], num_local_experts=self.n_routed_experts,
                   indexer_types=self.layer_indexer_types, mlp_layer_types=self.layer_mlp_types)
        out["dtype"] = out.pop("torch_dtype")
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an HF config dict; unknown keys are ignored, legacy rope keys are folded in."""
        if raw.get("model_type", MODEL_TYPE) not in (MODEL_TYPE, "deepseek_v32"):
            raise ValueError(f"ModelConfig: model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        if "rope_parameters" not in raw or raw["rope_parameters"] is None:
            rope = dict(raw.get("rope_scaling") or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
            kwargs["rope_parameters"] = rope
        if "torch_dtype" not in kwargs and isinstance(raw.get("dtype"), str):
            kwargs["torch_dtype"] = raw["dtype"]
        if "indexer_types" not in kwargs or kwargs["indexer_types"] is None:
            kwargs["indexer_types"] = _indexer_types_from_schedule(raw, int(kwargs.get("num_hidden_layers", 78)))
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2))


def _indexer_types_from_schedule(raw: dict[str, Any], num_layers: int) -> list[str]:
    """HF's derivation: an `index_topk_pattern` ("FFSF...") wins, else the freq/offset schedule."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]
