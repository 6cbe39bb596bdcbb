"""TMA on the host: whether tensors allow it (alignment), and host-built descriptors over dense
(batch, seqlen, heads * headdim) views, for the Triton kernels and (with their shared-memory layout) the Gluon ones."""

from __future__ import annotations

import functools
import math

import torch

from . import launcher
from .. import planning


def use_tma(arch: str, *tensors: torch.Tensor) -> bool:
    """TMA needs Hopper, 16-byte aligned bases and 16-byte multiples for every leading stride.
    Forcing it on (planning.force(tma=True), tests) lifts the Hopper condition, not the alignment one."""
    forced = planning.forced().tma
    if forced is False or (forced is None and arch != "sm90"):
        return False
    for t in tensors:
        es = t.element_size()
        lead = t.stride()[:-1]
        # gcd of the base and the leading strides in bytes: a multiple of 16 iff each one is
        if 0 in lead or math.gcd(t.data_ptr(), *[s * es for s in lead]) % 16:
            return False
    return True


def host_desc(t: torch.Tensor, rows: int, gluon: bool = False, cols: int | None = None) -> launcher.HostDesc:
    """A descriptor over a dense (batch, seqlen, heads, headdim) tensor whose heads are adjacent,
    seen as (batch, seqlen, heads * headdim), with a [1, rows, cols] box (cols: headdim unless
    given); gluon: carrying the shared-memory layout a Gluon kernel is compiled for."""
    b, n, h, d = t.shape
    s = t.stride()
    box = (1, rows, d if cols is None else cols)
    return launcher.HostDesc((t, (b, n, h * d), (s[0], s[1], 1), box, gluon_layout(t.dtype, box) if gluon else None))


@functools.cache
def gluon_layout(dtype: torch.dtype, box: tuple[int, ...]):
    """The shared-memory layout (NVMMASharedLayout) of a Gluon descriptor's box: Gluon's default
    swizzle for it (tools/compile_check.py compiles the Gluon kernels with the same)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {
        torch.float16: gl.float16,
        torch.bfloat16: gl.bfloat16,
        torch.float32: gl.float32,
        torch.float8_e4m3fn: gl.float8e4nv,
    }[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)
