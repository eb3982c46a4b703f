"""HF-format checkpoints: config.json + safetensors (one file, or shards + model.safetensors.index.json).

Tensor names are exactly those transformers reads and writes for GlmMoeDsaForCausalLM (experts per
expert, mlp.gate.e_score_correction_bias, self_attn.indexer.*), so a directory written here loads in
transformers and vice versa. Tied embeddings save no lm_head.weight (as HF). MTP layers load into and save
from `model.model.mtp_layers` under their HF names (model.layers.{num_hidden_layers + i}.*); an MTP layer's
copies of the embedding or head (embed_tokens.weight, shared_head.head.weight), when a checkpoint has them,
must equal the main model's tensors and are written back from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from asyncrl.model.config import ModelConfig
from asyncrl.model.model import FP32_TENSORS, Glm5ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""MTP-layer tensor -> the main model tensor it copies (SGLang skips them and uses the main model's)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (one of {sorted(_DTYPES)})")
    return _DTYPES[name]


def load_pretrained(path: str | Path, dtype: Optional[torch.dtype] = None) -> Glm5ForCausalLM:
    """Build the model a checkpoint directory describes and load its weights (dtype: the config's if None)."""
    config = ModelConfig.from_pretrained(path)
    dtype = dtype or dtype_from_name(config.torch_dtype)
    with torch.random.fork_rng(devices=[]):
        model = Glm5ForCausalLM(config).cast(dtype)
    load_weights(model, read_tensors(path))
    return model


def load_weights(model: Glm5ForCausalLM, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy HF-named tensors into the model (converting dtypes). strict=False accepts a subset
    (a weight update), but each MoE layer's experts come all together or not at all."""
    tensors = dict(tensors)
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    copies = {name: tensors.pop(name) for name in list(tensors) if _shared_copy_of(name, model.config)}
    for name, tensor in copies.items():
        main = tensors.get(_shared_copy_of(name, model.config))
        if main is not None and not torch.equal(tensor, main):
            raise ValueError(f"{name} differs from the main model's {_shared_copy_of(name, model.config)}")
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or (strict and missing):
        raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.mtp_shared_copies.update(copies)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, sharded or not."""
    path = Path(path)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(path / shard))
        return tensors
    return load_file(path / SINGLE_FILE)


def checkpoint_tensors(model: Glm5ForCausalLM, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """HF name -> contiguous tensor, as saved (cast to dtype except FP32_TENSORS; MTP layers included)."""
    state = model.state_dict()
    state.update({name: state[_shared_copy_of(name, model.config)] for name in sorted(model.mtp_shared_copies)})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    cast = (lambda name, t: t) if dtype is None else (
        lambda name, t: t if name.endswith(FP32_TENSORS) or not t.is_floating_point() else t.to(dtype))
    return {name: cast(name, t).contiguous() for name, t in state.items()}


def save_pretrained(model: Glm5ForCausalLM, path: str | Path, dtype: Optional[torch.dtype] = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write config.json and the weights; shards (with the index json) when larger than max_shard_bytes."""
    save_tensors(checkpoint_tensors(model, dtype), model.config, path, dtype or model.dtype, max_shard_bytes)


def save_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, path: str | Path, dtype: torch.dtype,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """An HF checkpoint directory from HF-named tensors (e.g. a trainer's weights, on any device):
    config.json with `torch_dtype` = dtype, then the safetensors files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu() for name, t in tensors.items()}
    config = ModelConfig.from_hf_dict(config.to_hf_dict())
    config.torch_dtype = str(dtype).removeprefix("torch.")
    config.save(path)
    shards = _split(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save_shard(tensors, path / SINGLE_FILE)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, path / name)
        weight_map.update({tensor_name: name for tensor_name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _save_shard(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Expert tensors are views into one stacked parameter; safetensors wants unshared storage."""
    save_file({name: t.clone() for name, t in tensors.items()}, file, metadata={"format": "pt"})


def _split(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _shared_copy_of(name: str, config: ModelConfig) -> Optional[str]:
    """The main tensor an MTP layer's embedding / head copy duplicates, or None for any other name."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) < config.num_hidden_layers:
        return None
    return _SHARED_COPIES.get(name[match.end():])
