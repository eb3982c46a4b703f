"""The CPU-safe payload of /update_weights_from_tensor (load_format "asyncrl_safetensors_b64").

SGLang's own format carries CUDA IPC handles, which only work between processes on one GPU node.
Ours is the base64 text of one safetensors blob of HF-named tensors: portable across processes and
machines, zero-copy to decode, and any subset of the weights may be sent.
"""

from __future__ import annotations

import base64
import binascii

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

TENSOR_LOAD_FORMAT = "asyncrl_safetensors_b64"


def encode_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    blob = save_safetensors_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Raises ValueError when `payload` is not base64 of a safetensors blob (a client's mistake, not a crash)."""
    try:
        return load_safetensors_bytes(base64.b64decode(payload, validate=True))
    except (binascii.Error, SafetensorError) as err:
        raise ValueError(f"not the base64 of a safetensors blob ({type(err).__name__}: {err})") from None
