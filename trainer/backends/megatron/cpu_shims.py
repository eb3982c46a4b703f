"""Every workaround megatron-core needs to run without CUDA, in one place (docs/megatron.md, "Shims").

megatron-core 0.19 is written for GPUs: it allocates buffers on `torch.cuda.current_device()`, seeds
CUDA RNG trackers, moves tensors with `.cuda()`, and imports a triton kernel module unconditionally.
`install()` makes those calls work on a CPU-only host and changes nothing where CUDA is present
(except the triton stub, which is only installed when triton is missing). Call it before the first
`import megatron.core`. Each patch names the megatron call site it exists for. The `torch.cuda`
patches are process-wide (on CPU-only hosts, where those functions could only raise); the
device-literal rewrite is scoped (`cuda_on_cpu`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

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
        _patch_rng_tracker()
        _patch_alltoall_split_sizes()
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
    # DDP's param_and_grad_buffer.start_grad_sync orders its collectives on CUDA streams/events
    torch.cuda.current_stream = torch.cuda.default_stream = lambda device=None: _NO_STREAM
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


_CUDA_RNG_STANDIN = torch.Generator()
"""Plays the CUDA default generator for megatron's RNG tracker (model_parallel_cuda_manual_seed, the
sequence-parallel embedding's `get_cuda_rng_tracker().fork()`), so seeding it leaves the global CPU
RNG untouched."""


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.manual_seed = torch.cuda.manual_seed_all = _CUDA_RNG_STANDIN.manual_seed
    torch.cuda.get_rng_state = lambda device="cuda": _CUDA_RNG_STANDIN.get_state()
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: _CUDA_RNG_STANDIN.get_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: _CUDA_RNG_STANDIN.set_state(state)


def _patch_alltoall_split_sizes() -> None:
    """The alltoall MoE dispatcher (expert parallelism) turns its split-size tensors into numpy via
    moe_utils.maybe_move_tensor_to_cpu, which converts only CUDA tensors; all_to_all_single then
    refuses the CPU tensors it gets here. Convert those too."""
    from megatron.core.transformer.moe import token_dispatcher

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class _NoStream:
    """A CUDA stream / event on a host without CUDA: CPU work is already ordered, so every wait,
    record and synchronize is a no-op (returning a stand-in, e.g. for `stream.record_event()`)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: _NO_STREAM


_NO_STREAM = _NoStream()


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Within: tensors megatron asks for on 'cuda' (`device='cuda'` literals, `.cuda()`) land on the CPU.

    Scoped, not global, because a TorchFunctionMode sees every torch call: it wraps only megatron's
    setup and optimizer code (DDP buffers, optimizer scale tensors, clip_grads), never the model's
    forward. Does nothing where CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CudaToCpu():
        yield


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # clip_grads asserts 'torch.cuda.FloatTensor'
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False
