"""S_dmask, the testing aid flash_attn returns with dropout and return_attn_probs: for each score,
exp(score - rowmax) where kept and -exp(score - rowmax) where dropped (0 where not visible).
A second pass after the forward, recomputing the scores and the dropout mask."""

import triton
import triton.language as tl

from .constexprs import DmaskScoring, Drop
from .common import LOG2E, alibi_bias, dropout_keep, head_constants, key_block_range, load_rows, query_program, visible


@triton.jit
def _scores(
    q,
    k_rows,
    start_n,
    offs_m,
    scoring,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    ALIBI: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] base-2 scores of keys [start_n, start_n + BLOCK_N), -inf where not visible. k_rows = (the
    first key row of this (batch, head), the row stride); scoring: constexprs.DmaskScoring."""
    k_base, stride_ks = k_rows
    seqlen_q, seqlen_k = scoring.seqlen_q, scoring.seqlen_k
    k = load_rows(k_base, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, False, UPCAST)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scoring.qk_scale
    if ALIBI:
        s += alibi_bias(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, scoring.slope2)
    mask = visible(
        offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, scoring.window_left, scoring.window_right, CAUSAL, LOCAL
    )
    return tl.where(mask, s, float("-inf")), offs_n


@triton.jit
def attn_dropout_mask_kernel(
    Q,
    K,
    SDmask,
    Alibi,
    CuSeqlensQ,
    CuSeqlensK,
    Seed,
    q_strides,
    k_strides,
    sdmask_strides,
    stride_alibi_b,
    shape,
    score,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # q's and k's strides (batch, row, head), SDmask's (batch, head, row); shape: constexprs.AttnShape; score:
    # constexprs.DmaskScore
    stride_qb, stride_qs, stride_qh = q_strides
    stride_kb, stride_ks, stride_kh = k_strides
    stride_sb, stride_sh, stride_sm = sdmask_strides
    window_left, window_right = score.window_left, score.window_right
    start_m, off_bh, off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k = query_program(
        shape, CuSeqlensQ, CuSeqlensK, CuSeqlensQ, False, IS_VARLEN, False, BLOCK_M
    )
    if start_m >= seqlen_q:
        return
    qk_scale = score.sm_scale * LOG2E
    slope2, seed = head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, ALIBI, True)
    rng_row0 = off_bh.to(tl.int64) * shape.max_seqlen_q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_rows(
        Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh,
        start_m,
        seqlen_q,
        stride_qs,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        False,
        UPCAST,
    )
    k_rows = (K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh, stride_ks)
    scoring = DmaskScoring(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        qk_scale=qk_scale,
        slope2=slope2,
        window_left=window_left,
        window_right=window_right,
    )
    drop = Drop(seed=seed, rng_row0=rng_row0, max_seqlen_k=shape.max_seqlen_k, dropout_p=score.dropout_p)
    n_lo, full_lo, full_hi, n_end = key_block_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL, BLOCK_M, BLOCK_N
    )
    # pass 1: each row's final max
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start_n in range(n_lo, n_end, BLOCK_N):
        s, offs_n = _scores(
            q, k_rows, start_n, offs_m, scoring, CAUSAL, LOCAL, ALIBI, UPCAST, DOT_PRECISION, HEAD_DIM, BLOCK_N, BLOCK_D
        )
        m_i = tl.maximum(m_i, tl.max(s, 1))
    m_shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    # pass 2: exp(score - rowmax), negated where dropped
    out_base = SDmask + off_b * stride_sb + off_h * stride_sh
    for start_n in range(n_lo, n_end, BLOCK_N):
        s, offs_n = _scores(
            q, k_rows, start_n, offs_m, scoring, CAUSAL, LOCAL, ALIBI, UPCAST, DOT_PRECISION, HEAD_DIM, BLOCK_N, BLOCK_D
        )
        p = tl.math.exp2(s - m_shift[:, None])
        keep = dropout_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, False)
        val = tl.where(keep, p, -p)
        ptrs = out_base + offs_m.to(tl.int64)[:, None] * stride_sm + offs_n[None, :]
        tl.store(
            ptrs, val.to(SDmask.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None] & (offs_n < seqlen_k)[None, :]
        )
