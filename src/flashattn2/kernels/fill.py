"""Varlen: rows past cu_seqlens[-1] belong to no sequence. This fills them (0 for outputs and
gradients, +inf for the logsumexp) without a host sync: the first unused row is read on device."""
import triton
import triton.language as tl


@triton.jit
def fill_tail_kernel(X, CuSeqlens, batch, total_rows, stride_r, stride_c, ncols, value,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    first_unused = tl.load(CuSeqlens + batch)
    start_r = tl.program_id(0) * BLOCK_R
    if start_r + BLOCK_R <= first_unused:
        return
    rows = start_r + tl.arange(0, BLOCK_R)
    row_mask = (rows >= first_unused) & (rows < total_rows)
    for c0 in range(0, ncols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        # [BLOCK_R, BLOCK_C]
        ptrs = X + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
        fill = tl.full([BLOCK_R, BLOCK_C], value, dtype=X.dtype.element_ty)
        tl.store(ptrs, fill, mask=row_mask[:, None] & (cols < ncols)[None, :])
