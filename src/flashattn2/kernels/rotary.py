"""Rotary embedding, in place on the first rotary_dim features of each row: GPT-NeoX halves
(features j and j + rotary_dim/2) or GPT-J pairs (2j and 2j + 1). CONJ rotates by minus the
angle, which is the backward. Positions outside [0, seqlen_ro) are left unrotated."""

from typing import NamedTuple

import triton
import triton.language as tl


class RotaryShape(NamedTuple):
    """rotary_kernel's sizes (`shape`): one scalar parameter per field, in field order; built by keyword
    (ops.launch.rotary), read by name."""

    batch: int  # x's sequences
    seqlen: int  # x's rows per sequence (varlen: the longest's, or a bound on it)
    nheads: int  # x's heads
    seqlen_ro: int  # the cos/sin tables' rows (positions)
    half: int  # the tables' columns: the rotated feature pairs


@triton.jit
def rotary_kernel(
    X,
    Cos,
    Sin,
    CuSeqlens,
    Offsets,
    x_strides,  # (batch, row, head)
    stride_cs,
    shape,  # RotaryShape
    offset,
    IS_VARLEN: tl.constexpr,
    OFFSETS_TENSOR: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # grid: (row blocks, sequences), the sequences on the second and third axes (CUDA caps each at 65535): sequence
    # program_id(1) + program_id(2) * num_programs(1)
    stride_xb, stride_xs, stride_xh = x_strides
    seqlen, seqlen_ro, half = shape.seqlen, shape.seqlen_ro, shape.half  # (seqlen: IS_VARLEN, the sequence's)
    pid_m = tl.program_id(0)
    off_b = tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    if off_b >= shape.batch:
        return
    if IS_VARLEN:
        start = tl.load(CuSeqlens + off_b).to(tl.int64)
        seqlen = (tl.load(CuSeqlens + off_b + 1) - start).to(tl.int32)
        base = X + start * stride_xs
    else:
        base = X + off_b * stride_xb
    # rows and positions in int64: x and its table are the caller's (2**31 rows or more), and so is the offset
    first_row = pid_m.to(tl.int64) * BLOCK_M
    if first_row >= seqlen:
        return
    if OFFSETS_TENSOR:
        offset = tl.load(Offsets + off_b)
    rows = first_row + tl.arange(0, BLOCK_M)
    pos = rows + offset
    cols = tl.arange(0, BLOCK_H)
    cs_mask = ((pos >= 0) & (pos < seqlen_ro))[:, None] & (cols < half)[None, :]
    # [BLOCK_M, BLOCK_H]
    cs_off = pos[:, None] * stride_cs + cols[None, :]
    c = tl.load(Cos + cs_off, mask=cs_mask, other=1.0).to(tl.float32)
    s = tl.load(Sin + cs_off, mask=cs_mask, other=0.0).to(tl.float32)
    if CONJ:
        s = -s
    if INTERLEAVED:
        c1 = 2 * cols
        c2 = 2 * cols + 1
    else:
        c1 = cols
        c2 = cols + half
    mask = (rows < seqlen)[:, None] & (cols < half)[None, :]
    # head 0's rows, moved by stride_xh a head: no int32 product h * stride_xh (it passes 2**31 for heads far apart in
    # memory, a head-major view)
    head = base + rows[:, None] * stride_xs
    for h in range(0, shape.nheads):
        p1 = head + c1[None, :]
        p2 = head + c2[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x1 * s + x2 * c
        tl.store(p1, y1.to(X.dtype.element_ty), mask=mask)
        tl.store(p2, y2.to(X.dtype.element_ty), mask=mask)
        head += stride_xh
