"""What the launchers need from Triton's runtime: the kernels, whether they run in the
interpreter, allocation (poisonable by tests) and the TMA scratch allocator.
The kernels are imported on first use. TRITON_INTERPRET=1 must be set before triton is first
imported (torch's custom-op machinery imports it), so in practice before Python starts."""
from __future__ import annotations

import contextlib
import functools
import types

import torch

# Tests set this so every buffer a kernel must fill starts as NaN (or -1 for integers).
POISON = False


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else -1)
    return t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype, t.device)


@functools.cache
def kernels() -> types.SimpleNamespace:
    from ..kernels import bwd, decode, dmask, fill, fwd, rotary

    return types.SimpleNamespace(fwd=fwd, bwd=bwd, fill=fill, dmask=dmask, rotary=rotary, decode=decode)


@torch.compiler.assume_constant_result
def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().fwd.attn_fwd_kernel, InterpretedFunction)


def device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (flash_attn's CUDAGuard)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator; Triton keeps it in a ContextVar,
    so a fresh thread (autograd's backward thread) starts without one."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
