"""The backward's preprocess, one pass over the query rows before the backward kernels (bwd.py's, or the Gluon
backward's in bwd_hopper.py): D = rowsum(dO * O) - dLse per row, the learnable sink's gradient per program, and
for the Gluon backward its padded inputs (Delta's and the logsumexp's padded rows, the dQ accumulator zeroed)."""

import triton
import triton.language as tl

from .common import LOG2E, load_rows, load_vec, seq_bounds, store_rows


@triton.jit
def attn_bwd_preprocess_kernel(
    Out,
    DOut,
    Delta,
    DLse,
    CuSeqlensQ,
    Lse,
    LsePad,
    DQAcc,
    Sinks,
    SinkPart,
    out_strides,
    dout_strides,
    lse_strides,
    delta_strides,
    dqacc_strides,
    shape,
    HAS_DLSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PADDED: tl.constexpr,
    COPY_LSE: tl.constexpr,
    SINK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC_DIM: tl.constexpr,
    BLOCK_ACC: tl.constexpr,
):
    # Delta = rowsum(dO * O) - dLse, into Delta (strides delta_strides; DLse has the logsumexp's). HEAD_DIM is
    # O's and dO's (v's head dim), ACC_DIM the dQ accumulator's (q's; BLOCK_ACC its power of two; read where PADDED).
    # The logsumexp's gradient dS += P * dLse folds into the same term: dS = P * (dP - Delta).
    # The grid covers seqlen_pad rows (max_seqlen_q unless PADDED). PADDED (the Gluon backward,
    # dense inputs only): what that kernel reads besides, written in the same pass -- Delta's rows
    # up to seqlen_pad (0 past max_seqlen_q), the fp32 dQ accumulator's rows (batch, seqlen_pad,
    # nheads, ACC_DIM) zeroed, and with COPY_LSE the logsumexp copied into LsePad (Delta's
    # layout, +inf past max_seqlen_q), so padded rows get P = 0. SINK: the program's share of the learnable
    # sink's gradient, -sum over its rows of exp(sink - lse) * Delta, into SinkPart[program] (0 for a program
    # past its sequence): the launcher sums the shares per head in a fixed order (no atomics). Strides: (batch, row,
    # head), the logsumexp's and Delta's (batch, head); shape: constexprs.PreprocessShape.
    stride_ob, stride_os, stride_oh = out_strides
    stride_dob, stride_dos, stride_doh = dout_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_delta_b, stride_delta_h = delta_strides
    stride_acc_b, stride_acc_s, stride_acc_h = dqacc_strides
    nheads, seqlen_pad = shape.nheads, shape.seqlen_pad
    num_m_blocks = tl.cdiv(seqlen_pad, BLOCK_M)
    pid_m = tl.program_id(0) % num_m_blocks
    off_bh = tl.program_id(0) // num_m_blocks
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, off_b, shape.max_seqlen_q, IS_VARLEN)
    rows_end = seqlen_pad if PADDED else seqlen_q
    if start_m >= rows_end:
        if SINK:
            tl.store(SinkPart + tl.program_id(0), 0.0)
        return
    o = load_rows(
        Out + off_b * stride_ob + q_start * stride_os + off_h * stride_oh,
        start_m,
        seqlen_q,
        stride_os,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        False,
        True,
    )
    do = load_rows(
        DOut + off_b * stride_dob + q_start * stride_dos + off_h * stride_doh,
        start_m,
        seqlen_q,
        stride_dos,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        False,
        True,
    )
    delta = tl.sum(o * do, 1)
    row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
    if HAS_DLSE:
        delta -= load_vec(DLse + row0, start_m, seqlen_q, BLOCK_M, 0.0)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    out_row0 = off_b * stride_delta_b + off_h * stride_delta_h + q_start
    tl.store(Delta + out_row0 + offs_m, delta, mask=offs_m < rows_end)
    if COPY_LSE or SINK:
        lse = load_vec(Lse + row0, start_m, seqlen_q, BLOCK_M, float("inf"))
    if COPY_LSE:
        tl.store(LsePad + out_row0 + offs_m, lse, mask=offs_m < rows_end)
    if SINK:  # rows past seqlen_q: lse +inf, weight 0, an exact 0 whatever delta; a NaN lse (weight NaN) stays NaN
        w = tl.math.exp2((tl.load(Sinks + off_h) - lse) * LOG2E)
        tl.store(SinkPart + tl.program_id(0), -tl.sum(tl.where(w == 0.0, 0.0, w * delta), 0))
    if PADDED:
        zeros = tl.zeros([BLOCK_M, BLOCK_ACC], dtype=tl.float32)
        store_rows(
            DQAcc + off_b * stride_acc_b + off_h * stride_acc_h,
            zeros,
            start_m,
            rows_end,
            stride_acc_s,
            ACC_DIM,
            BLOCK_M,
            BLOCK_ACC,
            False,
        )
