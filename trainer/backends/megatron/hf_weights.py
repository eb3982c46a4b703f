"""HF <-> megatron weight conversion for GLM-5, both ways, for any tensor / expert parallel layout.

HF names are transformers' GlmMoeDsaForCausalLM safetensors names (asyncrl.model.io
`checkpoint_tensors` / `load_weights`); megatron names are the GPTModel built by model.py.

Layouts are the same except two things:
* SwiGLU: HF keeps gate_proj and up_proj; megatron one linear_fc1 = [gate; up] (dense MLP, shared
  expert, every routed expert).
* Sharding: TP-sharded parameters carry megatron's `tensor_model_parallel` / `partition_dim`
  attributes (a GLU's gate and up halves are sharded separately); routed experts are numbered
  locally on their expert-parallel rank (global = ep_rank * local_count + local). Everything else is
  replicated.
RoPE channels need no permutation: megatron runs MLA and the indexer with `mla_rotary_interleaved`,
which reads the same interleaved pairs HF's weights produce.

    full = hf_to_megatron(hf)                 # unsharded megatron names (global expert numbers)
    load_hf_weights(model, hf)                # each rank copies its shards
    hf = gather_hf_weights(model)             # every rank gets the full HF state dict
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.indexer.wq_b.weight": "self_attention.core_attention.indexer.linear_wq_b.weight",
    "self_attn.indexer.wk.weight": "self_attention.core_attention.indexer.linear_wk.weight",
    "self_attn.indexer.k_norm.weight": "self_attention.core_attention.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "self_attention.core_attention.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "self_attention.core_attention.indexer.linear_weights_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_MG_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_HF_GLU = re.compile(r"^(.*)(gate|up)_proj\.weight$")
_EXPERT_RENAMES = {"down_proj.weight": "linear_fc2.weight", "linear_fc2.weight": "down_proj.weight"}
_MG_TO_HF = {v: k for k, v in LAYER_RENAMES.items()}


# Names ------------------------------------------------------------------------------------------
def hf_to_megatron(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> unsharded megatron tensors (routed experts keep their global number)."""
    out: dict[str, torch.Tensor] = {}
    glu: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        layer = _HF_LAYER.match(name)
        if layer is None:
            out[_lookup(GLOBAL_RENAMES, name)] = tensor
            continue
        prefix, rest = f"decoder.layers.{layer.group(1)}.", layer.group(2)
        expert = _HF_EXPERT.match(rest)
        if expert:
            prefix, rest = f"{prefix}mlp.experts.local_experts.{expert.group(1)}.", expert.group(2)
        half = _HF_GLU.match(rest)
        if half:  # mlp. / mlp.shared_experts. / (expert) "" + gate|up
            fc1 = prefix + ("" if expert else _fc1_prefix(half.group(1))) + "linear_fc1.weight"
            glu.setdefault(fc1, {})[half.group(2)] = tensor
        else:
            out[prefix + _lookup(_EXPERT_RENAMES if expert else LAYER_RENAMES, rest)] = tensor
    for fc1, halves in glu.items():
        if set(halves) != {"gate", "up"}:
            raise ValueError(f"{fc1}: HF checkpoint has only the {sorted(halves)} projection")
        out[fc1] = torch.cat([halves["gate"], halves["up"]], dim=0)  # [2I, H]
    return out


def megatron_to_hf(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded megatron tensors (global expert numbers) -> HF tensors."""
    hf_globals = {v: k for k, v in GLOBAL_RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        layer = _MG_LAYER.match(name)
        if layer is None:
            out[_lookup(hf_globals, name)] = tensor
            continue
        prefix, rest = f"model.layers.{layer.group(1)}.", layer.group(2)
        expert = _MG_EXPERT.match(rest)
        if expert:
            prefix, rest = f"{prefix}mlp.experts.{expert.group(1)}.", expert.group(2)
        if rest.endswith("linear_fc1.weight"):
            stem = prefix + ("" if expert else "mlp." + ("shared_experts." if "shared_experts" in rest else ""))
            gate, up = tensor.chunk(2, dim=0)
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = gate, up
        else:
            out[prefix + _lookup(_EXPERT_RENAMES if expert else _MG_TO_HF, rest)] = tensor
    return out


def _fc1_prefix(hf_stem: str) -> str:
    """'mlp.' -> 'mlp.', 'mlp.shared_experts.' -> 'mlp.shared_experts.' (megatron keeps both stems)."""
    if hf_stem not in ("mlp.", "mlp.shared_experts."):
        raise ValueError(f"unexpected SwiGLU projection under {hf_stem!r}")
    return hf_stem


def _lookup(table: dict[str, str], name: str) -> str:
    if name not in table:
        raise ValueError(f"no HF <-> megatron mapping for {name!r}")
    return table[name]


# Shards -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ranks:
    """This process's place in the tensor- and expert-parallel groups (None group: size 1)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_megatron(cls) -> "Ranks":
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group())


def model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The megatron tensors that hold HF weights: parameters and the routers' expert_bias buffers."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer


def global_name(local_name: str, experts_per_rank: int, ranks: Ranks) -> str:
    """local_experts.{local} -> local_experts.{ep_rank * experts_per_rank + local}."""
    def renumber(match: re.Match) -> str:
        return f"local_experts.{ranks.ep_rank * experts_per_rank + int(match.group(1))}."

    return re.sub(r"local_experts\.(\d+)\.", renumber, local_name)


def is_tp_sharded(name: str, param: torch.Tensor, ranks: Ranks) -> bool:
    """Routed experts are never TP-split (model.py sets expert_tensor_parallel_size=1)."""
    return getattr(param, "tensor_model_parallel", False) and ranks.tp_size > 1 and "local_experts." not in name


def shard(full: torch.Tensor, name: str, param: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """This TP rank's slice of a full tensor (GLU fc1: gate and up halves sliced separately)."""
    if not is_tp_sharded(name, param, ranks):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(ranks.tp_size, dim)[ranks.tp_rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(ranks.tp_size, dim)[ranks.tp_rank]


def unshard(local: torch.Tensor, name: str, param: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Inverse of `shard`: all-gather the TP slices (every rank gets the full tensor)."""
    if not is_tp_sharded(name, param, ranks):
        return local
    dim = param.partition_dim
    pieces = _all_gather(local.contiguous(), ranks.tp_group, ranks.tp_size)
    if name.endswith("linear_fc1.weight"):
        halves = [piece.chunk(2, dim) for piece in pieces]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(pieces, dim)


def _all_gather(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], size: int) -> list[torch.Tensor]:
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor, group=group)
    return pieces


def experts_per_rank(model: torch.nn.Module) -> int:
    return max((int(m.group(1)) + 1 for name, _ in model_tensors(model)
                if (m := re.search(r"local_experts\.(\d+)\.", name))), default=0)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf: dict[str, torch.Tensor], ranks: Ranks) -> None:
    """Copy an HF state dict (without MTP tensors) into this rank's shards; every weight must be there."""
    full = hf_to_megatron(hf)
    per_rank = experts_per_rank(model)
    expected = set()
    for name, tensor in model_tensors(model):
        key = global_name(name, per_rank, ranks)
        expected.add(key)
        if key not in full:
            raise ValueError(f"HF checkpoint lacks the weight for megatron {key!r}")
        piece = shard(full[key], name, tensor, ranks)
        if piece.shape != tensor.shape:
            raise ValueError(f"{name}: shard {tuple(piece.shape)} does not fit the parameter {tuple(tensor.shape)}")
        tensor.copy_(piece)
    unused = sorted(set(full) - expected - _other_ranks_experts(full, expected))
    if unused:
        raise ValueError(f"HF tensors without a megatron parameter: {unused[:8]}")


def _other_ranks_experts(full: dict, expected: set) -> set:
    return {name for name in full if "local_experts." in name and name not in expected}


@torch.no_grad()
def gather_hf_weights(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """Every rank: the full HF state dict (TP slices and EP experts gathered; collective call)."""
    per_rank = experts_per_rank(model)
    full: dict[str, torch.Tensor] = {}
    for name, tensor in model_tensors(model):
        whole = unshard(tensor.detach(), name, tensor, ranks)
        if "local_experts." in name and ranks.ep_size > 1:
            for ep_rank, piece in enumerate(_all_gather(whole.contiguous(), ranks.ep_group, ranks.ep_size)):
                full[global_name(name, per_rank, Ranks(ep_rank=ep_rank))] = piece
        else:
            full[global_name(name, per_rank, ranks)] = whole
    return megatron_to_hf(full)
