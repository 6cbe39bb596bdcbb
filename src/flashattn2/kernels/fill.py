"""Varlen: rows past cu_seqlens[-1] belong to no sequence. This fills them (0 for outputs and
gradients, +inf for the logsumexp) without a host sync: the first unused row is read on device.
One launch fills up to three tensors (out and lse; dq, dk and dv), each with its own
cu_seqlens, row count, strides and value."""

from typing import NamedTuple

import triton
import triton.language as tl


class FillSlot(NamedTuple):
    """One tensor of fill_tail_kernel (`slot0` .. `slot2`): one scalar parameter per field, in field order; built by
    keyword (ops.launch.launch_triton.TailFill), read by name."""

    total_rows: int  # the tensor's rows (the packed total)
    stride_r: int  # a row's stride
    stride_c: int  # a column's stride
    ncols: int  # columns of a row
    value: float  # what the rows past the sequences get


@triton.jit
def _fill_rows(X, CuSeqlens, slot, batch, start_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [start_r, start_r + BLOCK_R) of X that lie past cu_seqlens[batch] get `value`; slot: X's FillSlot."""
    total_rows = slot.total_rows
    first_unused = tl.load(CuSeqlens + batch)
    if (start_r + BLOCK_R > first_unused) & (start_r < total_rows):
        rows = start_r + tl.arange(0, BLOCK_R)
        row_mask = (rows >= first_unused) & (rows < total_rows)
        for c0 in range(0, slot.ncols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            # [BLOCK_R, BLOCK_C]
            ptrs = X + rows.to(tl.int64)[:, None] * slot.stride_r + cols.to(tl.int64)[None, :] * slot.stride_c
            fill = tl.full([BLOCK_R, BLOCK_C], slot.value, dtype=X.dtype.element_ty)
            tl.store(ptrs, fill, mask=row_mask[:, None] & (cols < slot.ncols)[None, :])


@triton.jit
def fill_tail_kernel(
    X0,
    CuSeqlens0,
    slot0,  # X0's FillSlot
    X1,
    CuSeqlens1,
    slot1,
    X2,
    CuSeqlens2,
    slot2,
    batch,
    SLOTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    start_r = tl.program_id(0) * BLOCK_R
    _fill_rows(X0, CuSeqlens0, slot0, batch, start_r, BLOCK_R, BLOCK_C)
    if SLOTS > 1:
        _fill_rows(X1, CuSeqlens1, slot1, batch, start_r, BLOCK_R, BLOCK_C)
    if SLOTS > 2:
        _fill_rows(X2, CuSeqlens2, slot2, batch, start_r, BLOCK_R, BLOCK_C)
