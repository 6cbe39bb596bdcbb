"""What the launchers need from Triton's runtime: the kernels (imported on first use, so that
TRITON_INTERPRET set after `import flashattn2` still takes effect), whether they run in the
interpreter, allocation (poisonable by tests) and the TMA scratch allocator."""
from __future__ import annotations

import functools
import types

import torch
import triton

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
    from ..kernels import bwd, fwd

    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


@torch.compiler.assume_constant_result
def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().fwd.attn_fwd_kernel, InterpretedFunction)


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator; Triton keeps it in a ContextVar,
    so a fresh thread (autograd's backward thread) starts without one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
