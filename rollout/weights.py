"""Receivers for the three weight-update paths of engine.md, for the built-in engine.

- disk: an HF checkpoint directory (config.json + safetensors), read and copied into the live model.
- tensor: `load_format="asyncrl_safetensors_b64"` (asyncrl/tensor_codec.py): one base64 safetensors
  blob of HF-named tensors (a subset is fine); CPU-safe, unlike SGLang's CUDA-IPC handles.
- distributed: a torch.distributed group between the trainer (rank 0) and engines (rank_offset + i),
  gloo on CPU, NCCL on GPU; tensors arrive by broadcast from rank 0 in the announced order.

All paths end in `Engine.update_weights` -> `asyncrl.model.io.load_weights`, which copies by HF name
into existing parameters (shapes checked), so the model object, its KV cache and compiled state survive
an update.

`offload_weights` / `restore_weights` serve SGLang's release / resume_memory_occupation (tag `weights`):
the weights go to a local checkpoint and their memory is freed, then come back exactly.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from asyncrl.model.io import dtype_from_name, load_weights, read_tensors, save_pretrained
from asyncrl.network import use_gloo_interface_towards
from asyncrl.tensor_codec import TENSOR_LOAD_FORMAT, decode_named_tensors

log = logging.getLogger("rollout.weights")


def decode_tensors(serialized: list[str], load_format: Optional[str]) -> dict[str, torch.Tensor]:
    if load_format not in (None, TENSOR_LOAD_FORMAT):
        raise ValueError(f"load_format {load_format!r} is not supported by the CPU engine (use {TENSOR_LOAD_FORMAT!r})")
    if len(serialized) != 1:
        raise ValueError(f"serialized_named_tensors must have one entry (tp_size 1), got {len(serialized)}")
    try:
        return decode_named_tensors(serialized[0])
    except ValueError as err:
        raise ValueError(f"serialized_named_tensors[0]: {err}") from None


def offload_weights(model, directory: Path) -> dict[str, torch.Size]:
    """Write the weights to `directory` (an HF checkpoint), then free every parameter's storage.
    -> the parameter shapes, for restore_weights."""
    save_pretrained(model, directory)
    shapes = {}
    for name, param in model.named_parameters():
        shapes[name] = param.shape
        param.data = torch.empty(0, dtype=param.dtype)
    return shapes


def restore_weights(model, directory: Path, shapes: dict[str, torch.Size]) -> int:
    """Give the parameters their storage back and reload the weights offload_weights wrote."""
    for name, param in model.named_parameters():
        param.data = torch.empty(shapes[name], dtype=param.dtype)
    tensors = read_tensors(directory)
    load_weights(model, tensors, strict=True)
    return len(tensors)


class WeightsUpdateGroup:
    """The engine's end of a weight broadcast group (the trainer is rank 0)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 group_name: str, timeout_s: float = 300.0) -> None:
        if dist.is_initialized():
            raise RuntimeError("a weights update group already exists in this engine; destroy it first")
        if backend == "gloo":
            use_gloo_interface_towards(master_address)
        dist.init_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.group_name, self.rank = group_name, rank
        log.info("joined weights update group %s as rank %d of %d (%s)", group_name, rank, world_size, backend)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        tensors = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            buffer = torch.empty(shape, dtype=dtype_from_name(dtype))
            dist.broadcast(buffer, src=0)
            tensors[name] = buffer
        return tensors

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
