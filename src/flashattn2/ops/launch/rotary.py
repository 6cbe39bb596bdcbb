"""Launcher of the rotary kernel: rotate x's first rotary_dim features in place."""

from __future__ import annotations

import torch

from .. import _runtime
from . import launcher

_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes


def rotate_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    conjugate: bool = False,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """x (batch, seqlen, nheads, headdim) or (total, nheads, headdim) with cu_seqlens (and
    max_seqlen, else the total bounds the programs), last dim contiguous; cos/sin
    (seqlen_ro, rotary_dim / 2). Returns x, rotated in place."""
    if x.numel() == 0:
        return x
    if _runtime.interpreted() and x.dtype != torch.float32:
        # the interpreter's fp32 -> bf16 store truncates: rotate an fp32 copy, let torch round
        buf = x.float()
        rotate_(buf, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate, max_seqlen)
        return x.copy_(buf)
    varlen = cu_seqlens is not None
    if varlen:
        batch, seqlen = cu_seqlens.shape[0] - 1, None
        stride_b, (stride_s, stride_h) = 0, x.stride()[:2]
    else:
        batch, seqlen = x.shape[:2]
        stride_b, stride_s, stride_h = x.stride()[:3]
    if varlen:
        # programs cover the longest sequence; without max_seqlen, the total bounds it
        seqlen = x.shape[0] if max_seqlen is None else int(max_seqlen)
    nheads = x.shape[-2]
    half = cos.shape[1]
    offsets_tensor = isinstance(seqlen_offsets, torch.Tensor)
    block_m = 8 if half > 64 else 16
    block_h = max(1, 1 << (half - 1).bit_length())
    cos, sin = cos.contiguous(), sin.contiguous()
    if offsets_tensor:
        seqlen_offsets = seqlen_offsets.contiguous()
    if varlen:
        cu_seqlens = cu_seqlens.contiguous()
    grid_y = max(1, min(batch, _GRID_YZ))  # sequences on the grid's second axis, the rest on its third
    grid = (-(-seqlen // block_m), grid_y, -(-batch // grid_y))
    rotary = _runtime.kernels().rotary
    shape = rotary.RotaryShape(batch=batch, seqlen=seqlen, nheads=nheads, seqlen_ro=cos.shape[0], half=half)
    with _runtime.device_of(x):
        launcher.launch(
            rotary.rotary_kernel,
            grid,
            x,
            cos,
            sin,
            cu_seqlens,
            seqlen_offsets if offsets_tensor else None,
            (stride_b, stride_s, stride_h),
            cos.stride(0),
            shape,
            0 if offsets_tensor else int(seqlen_offsets),
            IS_VARLEN=varlen,
            OFFSETS_TENSOR=offsets_tensor,
            INTERLEAVED=interleaved,
            CONJ=conjugate,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
        )
    return x
