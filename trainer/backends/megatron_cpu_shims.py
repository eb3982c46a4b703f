"""Every workaround megatron-core needs to run without CUDA, in one place (docs/megatron.md, "Shims").

megatron-core 0.19 is written for GPUs: it allocates buffers on `torch.cuda.current_device()`, seeds
CUDA RNG trackers, moves tensors with `.cuda()`, and imports a triton kernel module unconditionally.
`install()` makes those calls work on a CPU-only host and changes nothing where CUDA is present
(except the triton stub, which is only installed when triton is missing). Call it before the first
`import megatron.core`. Each patch names the megatron call site it exists for.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
_installed = False


def install() -> None:
    """Idempotent. Only the triton stub on CUDA hosts without triton; everything on CPU-only hosts."""
    global _installed
    if _installed:
        return
    if importlib.util.find_spec("triton") is None:
        _stub_paged_stash_kernels()
    if not torch.cuda.is_available():
        _patch_cuda_calls()
    _installed = True


def _stub_paged_stash_kernels() -> None:
    """megatron/core/transformer/moe/paged_stash.py imports these triton kernels at import time
    (gpt_model -> paged_stash), although only the MoE paged-stash offload feature (off by default,
    CUDA-only) runs them. A stub module takes their place; calling one raises. A fake top-level
    `triton` package instead would break torch._dynamo, which probes for it."""
    module = types.ModuleType(_PAGED_STASH)
    module.GLOBAL_BLOCK_SIZE = 1024

    def unavailable(*args, **kwargs):
        raise RuntimeError("megatron paged-stash kernels need triton (moe_paged_stash is not supported here)")

    module.paged_stash_copy_kernel = module.paged_stash_pop_kernel = unavailable
    sys.modules[_PAGED_STASH] = module


def _patch_cuda_calls() -> None:
    torch.cuda.current_device = _cpu_device  # buffers, rotary inv_freq, router weights (".to(current_device())")


def _cpu_device() -> torch.device:
    return torch.device("cpu")
