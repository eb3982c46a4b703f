"""Interleaved partial RoPE, as transformers >= 5.16 applies it to GLM-5 (MLA and the DSA indexer).

Only `qk_rope_head_dim` channels rotate. DeepSeek lays them out as interleaved pairs (x0, x1), (x2, x3),
... each pair rotated by one frequency: a complex multiplication. transformers writes the rotated pairs
de-interleaved ([evens | odds]); we keep them interleaved (fewer ops). Rotated vectors are only ever
dotted with each other (queries with keys, including cached keys, which also come from here), and a dot
product does not depend on a common channel order, so scores equal transformers'.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asyncrl.model.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim / 2] and the cos/sin scale ("default" or "yarn" rope_type)."""
    params = config.rope_parameters
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(config, inv_freq)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, yarn)")


def _yarn_frequencies(config: ModelConfig, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp in between (HF's formula)."""
    params = config.rope_parameters
    dim, base = config.qk_rope_head_dim, config.rope_theta
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """MLA softmax scale: qk_head_dim^-0.5, times mscale^2 when YaRN sets mscale_all_dim."""
    scale = config.qk_head_dim**-0.5
    params = config.rope_parameters
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin of each position for the rotated channels."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [...] -> rotations [..., rope_dim / 2] complex64 (scale * e^(i * pos * inv_freq))."""
        angles = positions[..., None].float() * self.inv_freq
        return torch.polar(torch.full_like(angles, self.attention_scaling), angles)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of x [..., rope_dim]; rotations broadcast to [..., rope_dim / 2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [..., rope_dim / 2]
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)
