"""Merging partial attention results by their logsumexp: the step that joins the blocks of a sequence
computed apart (context parallelism's ring). One pass over the rows: the fp32 accumulator and its
logsumexp are rescaled to the merged logsumexp and the block's output is added with its weight.

    lse   = log(exp(lse_acc) + exp(lse_blk))
    acc   = acc * exp(lse_acc - lse) + out_blk * exp(lse_blk - lse)

A row no block has reached has lse -inf (FIRST copies the block instead of merging into nothing); a
block's row that saw no key (lse -inf, or flash_attn's +inf) adds nothing. A NaN on either side (a NaN
logsumexp, a NaN output) gives a NaN row, lse and output, as the attention over all the keys would."""

import triton
import triton.language as tl


@triton.jit
def merge_kernel(
    Acc,
    Lse,
    Out,
    BLse,
    acc_strides,  # (batch, row, head)
    lse_strides,  # (batch, head)
    out_strides,  # (batch, row, head)
    blse_strides,  # (batch, head)
    seqlen,
    head_dim,
    FIRST: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows [pid0 * BLOCK_S, +BLOCK_S) of head pid1, batch pid2; the last dimension (head_dim) and the
    logsumexps' row axis are contiguous."""
    stride_acc_b, stride_acc_s, stride_acc_h = acc_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_out_b, stride_out_s, stride_out_h = out_strides
    stride_blse_b, stride_blse_h = blse_strides
    pid_s = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    mask = row_ok[:, None] & (cols < head_dim)[None, :]
    rows64 = rows.to(tl.int64)

    blse_ptrs = BLse + batch * stride_blse_b + head * stride_blse_h + rows64
    b_lse = tl.load(blse_ptrs, mask=row_ok, other=float("-inf"))
    b_lse = tl.where(b_lse == float("inf"), float("-inf"), b_lse)
    # [BLOCK_S, BLOCK_D]
    out_ptrs = Out + batch * stride_out_b + head * stride_out_h + rows64[:, None] * stride_out_s + cols[None, :]
    b_out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    b_out = tl.where(b_lse[:, None] == float("-inf"), 0.0, b_out)
    lse_ptrs = Lse + batch * stride_lse_b + head * stride_lse_h + rows64
    acc_ptrs = Acc + batch * stride_acc_b + head * stride_acc_h + rows64[:, None] * stride_acc_s + cols[None, :]
    if FIRST:
        tl.store(acc_ptrs, b_out, mask=mask)
        tl.store(lse_ptrs, b_lse, mask=row_ok)
    else:
        a_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        acc = tl.load(acc_ptrs, mask=mask, other=0.0)
        # a NaN logsumexp on either side makes top NaN, so the merged lse and acc are NaN (the GPU's default
        # maximum would return the other side and drop it)
        top = tl.maximum(a_lse, b_lse, propagate_nan=tl.PropagateNan.ALL)
        # rows neither side has reached stay -inf with weights 0, not NaN
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        w_a = tl.exp(a_lse - safe_top)
        w_b = tl.exp(b_lse - safe_top)
        total = w_a + w_b  # >= 1 where either side has reached the row, else 0
        total = tl.where(total > 0, total, 1.0)
        lse = tl.where(top == float("-inf"), top, safe_top + tl.log(total))
        inv = 1.0 / total
        acc = acc * (w_a * inv)[:, None] + b_out * (w_b * inv)[:, None]
        tl.store(acc_ptrs, acc, mask=mask)
        tl.store(lse_ptrs, lse, mask=row_ok)
