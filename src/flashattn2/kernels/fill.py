"""Varlen: rows past cu_seqlens[-1] belong to no sequence. This fills them (0 for outputs and
gradients, +inf for the logsumexp) without a host sync: the first unused row is read on device.
One launch fills up to three tensors (out and lse; dq, dk and dv), each with its own
cu_seqlens, row count, strides and value."""

import triton
import triton.language as tl


@triton.jit
def _fill_rows(
    X,
    CuSeqlens,
    batch,
    total_rows,
    stride_r,
    stride_c,
    ncols,
    value,
    start_r,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows [start_r, start_r + BLOCK_R) of X that lie past cu_seqlens[batch] get `value`."""
    first_unused = tl.load(CuSeqlens + batch)
    if (start_r + BLOCK_R > first_unused) & (start_r < total_rows):
        rows = start_r + tl.arange(0, BLOCK_R)
        row_mask = (rows >= first_unused) & (rows < total_rows)
        for c0 in range(0, ncols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            # [BLOCK_R, BLOCK_C]
            ptrs = X + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
            fill = tl.full([BLOCK_R, BLOCK_C], value, dtype=X.dtype.element_ty)
            tl.store(ptrs, fill, mask=row_mask[:, None] & (cols < ncols)[None, :])


@triton.jit
def fill_tail_kernel(
    X0,
    CuSeqlens0,
    total0,
    stride_r0,
    stride_c0,
    ncols0,
    value0,
    X1,
    CuSeqlens1,
    total1,
    stride_r1,
    stride_c1,
    ncols1,
    value1,
    X2,
    CuSeqlens2,
    total2,
    stride_r2,
    stride_c2,
    ncols2,
    value2,
    batch,
    SLOTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    start_r = tl.program_id(0) * BLOCK_R
    _fill_rows(X0, CuSeqlens0, batch, total0, stride_r0, stride_c0, ncols0, value0, start_r, BLOCK_R, BLOCK_C)
    if SLOTS > 1:
        _fill_rows(X1, CuSeqlens1, batch, total1, stride_r1, stride_c1, ncols1, value1, start_r, BLOCK_R, BLOCK_C)
    if SLOTS > 2:
        _fill_rows(X2, CuSeqlens2, batch, total2, stride_r2, stride_c2, ncols2, value2, start_r, BLOCK_R, BLOCK_C)
