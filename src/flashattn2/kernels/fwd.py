"""FlashAttention-2 forward kernel.

One program per (query block, batch, head): the Q tile stays on chip while K/V tiles stream past;
an online softmax keeps the running row max `m_i` and row sum `l_i` (base 2) and an unscaled fp32
accumulator, which is divided by `l_i` once at the end. Only O and the logsumexp are written.
Softcap, ALiBi, a local window and a learnable sink (a logit per head in every row's denominator, joined once
after the key loop) are constexpr flags: when off they cost nothing.
"""

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    alibi_bias,
    dropout_keep,
    head_constants,
    key_block_range,
    load_tile,
    query_program,
    sink_join,
    store_tile,
    tanh,
    tile_src,
    visible,
)


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    start_m,
    n_lo,
    n_hi,
    seqlen_q,
    seqlen_k,
    stride_ks,
    stride_vs,
    qk_scale,
    softcap_in,
    softcap_out,
    slope2,
    window_left,
    window_right,
    seed,
    rng_row0,
    max_seqlen_k,
    dropout_p,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr,
    HOST_DESC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        k = load_tile(k_src, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or SOFTCAP or ALIBI:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            # scores in base 2: softcap * tanh(qk * scale / softcap), then the ALiBi bias
            if SOFTCAP:
                s = tanh(qk * softcap_in) * softcap_out
            else:
                s = qk * qk_scale
            if ALIBI:
                s += alibi_bias(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, slope2)
            if MASKED:
                mask = visible(
                    offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL
                )
                s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_shift[:, None])
            alpha = tl.math.exp2(m_i - m_shift)
        else:
            # the common case: the scale folded into one FMA, the max taken before scaling (scale >= 0)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            # the normaliser keeps every score; only the values mixed into O are dropped
            keep = dropout_keep(seed, rng_row0, start_m, start_n, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N, False)
            p = tl.where(keep, p, 0.0)
        v = load_tile(v_src, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA, UPCAST, HOST_DESC)
        # [BLOCK_M, BLOCK_DV]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Alibi,
    Sinks,
    CuSeqlensQ,
    CuSeqlensK,
    Seed,
    SeqOrder,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lse_b,
    stride_lse_h,
    stride_alibi_b,
    batch,
    nheads,
    max_seqlen_q,
    max_seqlen_k,
    group_size,
    window_left,
    window_right,
    sm_scale,
    softcap,
    dropout_p,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    SINK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SORTED: tl.constexpr,
    USE_TMA: tl.constexpr,
    HOST_DESC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # varlen: programs cover max_seqlen_q; those past their own sequence's end return at once
    start_m, off_bh, off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k = query_program(
        batch,
        nheads,
        group_size,
        max_seqlen_q,
        max_seqlen_k,
        CuSeqlensQ,
        CuSeqlensK,
        CAUSAL,
        IS_VARLEN,
        BLOCK_M,
        SeqOrder,
        SORTED,
    )
    if start_m >= seqlen_q:
        return
    qk_scale = sm_scale * LOG2E
    softcap_in = sm_scale / softcap
    softcap_out = softcap * LOG2E
    slope2, seed = head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, ALIBI, DROPOUT)
    rng_row0 = off_bh.to(tl.int64) * max_seqlen_q

    q_src = tile_src(
        Q,
        off_b,
        q_start,
        off_h,
        stride_qb,
        stride_qs,
        stride_qh,
        seqlen_q,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        USE_TMA,
        HOST_DESC,
    )
    k_src = tile_src(
        K,
        off_b,
        k_start,
        off_hk,
        stride_kb,
        stride_ks,
        stride_kh,
        seqlen_k,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_D,
        USE_TMA,
        HOST_DESC,
    )
    v_src = tile_src(
        V,
        off_b,
        k_start,
        off_hk,
        stride_vb,
        stride_vs,
        stride_vh,
        seqlen_k,
        HEAD_DIM_V,
        BLOCK_N,
        BLOCK_DV,
        USE_TMA,
        HOST_DESC,
    )
    o_src = tile_src(
        Out,
        off_b,
        q_start,
        off_h,
        stride_ob,
        stride_os,
        stride_oh,
        seqlen_q,
        HEAD_DIM_V,
        BLOCK_M,
        BLOCK_DV,
        USE_TMA,
        HOST_DESC,
    )

    q = load_tile(q_src, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_lo, full_lo, full_hi, n_end = key_block_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL, BLOCK_M, BLOCK_N
    )
    if LOCAL:
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            start_m,
            n_lo,
            full_lo,
            seqlen_q,
            seqlen_k,
            stride_ks,
            stride_vs,
            qk_scale,
            softcap_in,
            softcap_out,
            slope2,
            window_left,
            window_right,
            seed,
            rng_row0,
            max_seqlen_k,
            dropout_p,
            True,
            CAUSAL,
            LOCAL,
            SOFTCAP,
            ALIBI,
            DROPOUT,
            USE_TMA,
            HOST_DESC,
            UPCAST,
            DOT_PRECISION,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM_V,
            BLOCK_DV,
        )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        start_m,
        full_lo,
        full_hi,
        seqlen_q,
        seqlen_k,
        stride_ks,
        stride_vs,
        qk_scale,
        softcap_in,
        softcap_out,
        slope2,
        window_left,
        window_right,
        seed,
        rng_row0,
        max_seqlen_k,
        dropout_p,
        False,
        CAUSAL,
        LOCAL,
        SOFTCAP,
        ALIBI,
        DROPOUT,
        USE_TMA,
        HOST_DESC,
        UPCAST,
        DOT_PRECISION,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM_V,
        BLOCK_DV,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        start_m,
        full_hi,
        n_end,
        seqlen_q,
        seqlen_k,
        stride_ks,
        stride_vs,
        qk_scale,
        softcap_in,
        softcap_out,
        slope2,
        window_left,
        window_right,
        seed,
        rng_row0,
        max_seqlen_k,
        dropout_p,
        True,
        CAUSAL,
        LOCAL,
        SOFTCAP,
        ALIBI,
        DROPOUT,
        USE_TMA,
        HOST_DESC,
        UPCAST,
        DOT_PRECISION,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM_V,
        BLOCK_DV,
    )

    if SINK:
        m_i, l_i, alpha = sink_join(m_i, l_i, tl.load(Sinks + off_h) * LOG2E)
        acc = acc * alpha[:, None]
    # a row that sees no key: output 0 and logsumexp +inf (flash-attn 2's convention; with a sink, the sink's logit)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    store_tile(o_src, acc, start_m, seqlen_q, stride_os, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA, HOST_DESC)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    lse_row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
    tl.store(Lse + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
