"""FlashAttention-2 backward kernels: D = rowsum(dO * O), then dK/dV per key block, then dQ per
query block in its own pass (no atomics: every run gives bitwise-identical gradients).

P is recomputed from the saved logsumexp: P = exp(S - L). With dP = dO V^T and
dS = P * (dP - D): dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K. With softcap,
S = c * tanh(QK^T * scale / c) and dS picks up the factor 1 - tanh^2; the ALiBi bias has no
gradient. With dropout (mask Z, kept scaled by 1 / (1 - p)): dV = (P Z)^T dO and
dS = P * (Z dP - D), the mask regenerated from the same Philox offsets as the forward.
"""

import triton
import triton.language as tl

from .common import (
    LOG2E,
    alibi_bias,
    dropout_keep,
    head_constants,
    key_block_range,
    load_rows,
    load_tile,
    load_vec,
    query_program,
    query_block_range,
    seq_bounds,
    store_rows,
    store_tile,
    tanh,
    tile_src,
    visible,
)


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
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_lse_b,
    stride_lse_h,
    stride_delta_b,
    stride_delta_h,
    stride_acc_b,
    stride_acc_s,
    stride_acc_h,
    nheads,
    max_seqlen_q,
    seqlen_pad,
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
    # Delta = rowsum(dO * O) - dLse, into Delta (strides stride_delta_*; DLse has the logsumexp's). HEAD_DIM is
    # O's and dO's (v's head dim), ACC_DIM the dQ accumulator's (q's; BLOCK_ACC its power of two; read where PADDED).
    # The logsumexp's gradient dS += P * dLse folds into the same term: dS = P * (dP - Delta).
    # The grid covers seqlen_pad rows (max_seqlen_q unless PADDED). PADDED (the Gluon backward,
    # dense inputs only): what that kernel reads besides, written in the same pass -- Delta's rows
    # up to seqlen_pad (0 past max_seqlen_q), the fp32 dQ accumulator's rows (batch, seqlen_pad,
    # nheads, ACC_DIM) zeroed, and with COPY_LSE the logsumexp copied into LsePad (Delta's
    # layout, +inf past max_seqlen_q), so padded rows get P = 0. SINK: the program's share of the learnable
    # sink's gradient, -sum over its rows of exp(sink - lse) * Delta, into SinkPart[program] (0 for a program
    # past its sequence): the launcher sums the shares per head in a fixed order (no atomics).
    num_m_blocks = tl.cdiv(seqlen_pad, BLOCK_M)
    pid_m = tl.program_id(0) % num_m_blocks
    off_bh = tl.program_id(0) // num_m_blocks
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, off_b, max_seqlen_q, IS_VARLEN)
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
    if SINK:  # rows past seqlen_q: lse +inf, weight 0 (delta there is 0 too)
        w = tl.math.exp2((tl.load(Sinks + off_h) - lse) * LOG2E)
        tl.store(SinkPart + tl.program_id(0), -tl.sum(tl.where(w > 0.0, w * delta, 0.0), 0))
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


@triton.jit
def _scores_bwd(
    qk,
    qi,
    kj,
    lse2,
    seqlen_q,
    seqlen_k,
    qk_scale,
    softcap_in,
    softcap_out,
    slope2,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """P = exp(S - L) recomputed, and dS's softcap factor 1 - tanh^2 (1.0 without softcap).

    Orientation-free: qk is [M, N] with qi [M, 1], kj [1, N], lse2 [M, 1], or all transposed.
    """
    grad_factor = 1.0
    if SOFTCAP:
        t = tanh(qk * softcap_in)
        s = t * softcap_out
        grad_factor = 1.0 - t * t
    else:
        s = qk * qk_scale
    if ALIBI:
        s += alibi_bias(qi, kj, seqlen_q, seqlen_k, slope2)
    p = tl.math.exp2(s - lse2)
    if MASKED:
        p = tl.where(visible(qi, kj, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL), p, 0.0)
    return p, grad_factor


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    q_cols,
    do_cols,
    ncols_k,
    ncols_v,
    lse_ptr,
    delta_ptr,
    start_n,
    m_lo,
    m_hi,
    seqlen_q,
    seqlen_k,
    stride_qs,
    stride_dos,
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
    DSPLIT: tl.constexpr,
    CWK: tl.constexpr,
    CWV: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    for start_m in range(m_lo, m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_src, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
        # rows past seqlen_q load lse = +inf, so their P is exactly 0
        lse2 = load_vec(lse_ptr, start_m, seqlen_q, BLOCK_M, float("inf")) * LOG2E
        # P^T, [BLOCK_N, BLOCK_M]: computed transposed so dV and dK need no transpose of P or dS
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASKED or SOFTCAP or ALIBI:
            pT, factorT = _scores_bwd(
                qkT,
                offs_m[None, :],
                offs_n[:, None],
                lse2[None, :],
                seqlen_q,
                seqlen_k,
                qk_scale,
                softcap_in,
                softcap_out,
                slope2,
                window_left,
                window_right,
                MASKED,
                CAUSAL,
                LOCAL,
                SOFTCAP,
                ALIBI,
            )
        else:
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        do = load_tile(do_src, start_m, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA, UPCAST, HOST_DESC)
        # dv: [BLOCK_N, BLOCK_DV]
        if DROPOUT:
            keepT = dropout_keep(seed, rng_row0, start_m, start_n, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N, True)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pT_kept = tl.where(keepT, pT * inv_keep, 0.0)
        else:
            pT_kept = pT
        if DSPLIT == 1:
            dv = tl.dot(pT_kept.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        else:  # this program's columns of dV: dO's chunk
            do_c = load_rows(do_cols, start_m, seqlen_q, stride_dos, ncols_v, BLOCK_M, CWV, False, UPCAST)
            dv = tl.dot(pT_kept.to(do_c.dtype), do_c, dv, input_precision=DOT_PRECISION)
        delta = load_vec(delta_ptr, start_m, seqlen_q, BLOCK_M, 0.0)
        # [BLOCK_N, BLOCK_M]
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * factorT
        dsT = dsT.to(q.dtype)
        if DSPLIT == 1:
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        else:  # this program's columns of dK: Q's chunk
            q_c = load_rows(q_cols, start_m, seqlen_q, stride_qs, ncols_k, BLOCK_M, CWK, False, UPCAST)
            dk = tl.dot(dsT, q_c.to(q.dtype), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    Alibi,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_lse_b,
    stride_lse_h,
    stride_alibi_b,
    nheads,
    nheads_k,
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
    DSPLIT: tl.constexpr,
):
    # one program per (key block, batch, K/V head); the query heads of a GQA group are summed here. DSPLIT > 1 (head
    # dims past 256): DSPLIT programs per key block (the grid's second axis), each P and dS whole and its own
    # 1 / DSPLIT of dK's and dV's columns, so that the accumulators fit the registers
    CWK: tl.constexpr = BLOCK_D // DSPLIT if BLOCK_D // DSPLIT >= 16 else 16  # (a dot's dims are 16 at least)
    CWV: tl.constexpr = BLOCK_DV // DSPLIT if BLOCK_DV // DSPLIT >= 16 else 16
    chunk = tl.program_id(1)
    ncols_k = HEAD_DIM - chunk * CWK
    ncols_v = HEAD_DIM_V - chunk * CWV
    num_n_blocks = tl.cdiv(max_seqlen_k, BLOCK_N)
    pid_n = tl.program_id(0) % num_n_blocks
    off_bhk = tl.program_id(0) // num_n_blocks
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    if SORTED:  # varlen: slot b works on sequence SeqOrder[b] (longest first: a shorter tail)
        off_b = tl.load(SeqOrder + off_b).to(tl.int64)
    start_n = pid_n * BLOCK_N
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, off_b, max_seqlen_q, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(CuSeqlensK, off_b, max_seqlen_k, IS_VARLEN)
    if start_n >= seqlen_k:
        return
    qk_scale = sm_scale * LOG2E
    softcap_in = sm_scale / softcap
    softcap_out = softcap * LOG2E
    no_slope, seed = head_constants(Alibi, stride_alibi_b, off_b, 0, Seed, False, DROPOUT)

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
    k = load_tile(k_src, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
    v = load_tile(v_src, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA, UPCAST, HOST_DESC)
    dk = tl.zeros([BLOCK_N, CWK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, CWV], dtype=tl.float32)

    m_lo, full_lo, full_hi, m_end = query_block_range(
        start_n, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL, BLOCK_M, BLOCK_N
    )
    # num_stages=1: this loop is never pipelined. Where the inner loops fold away (seqlen_q == 1, which Triton
    # specializes into a constant) it would be the innermost loop, and the pipeliner cannot predicate the
    # descriptors made in it (tile_src with USE_TMA: 'ttng.tensormap_create' ... doesn't know how to predicate)
    for g in tl.range(0, group_size, num_stages=1):
        off_h = off_hk * group_size + g
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
        do_src = tile_src(
            DOut,
            off_b,
            q_start,
            off_h,
            stride_dob,
            stride_dos,
            stride_doh,
            seqlen_q,
            HEAD_DIM_V,
            BLOCK_M,
            BLOCK_DV,
            USE_TMA,
            HOST_DESC,
        )
        row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
        q_cols, do_cols = Q, DOut  # (read only with DSPLIT > 1, where they are pointers: no host descriptors)
        if DSPLIT > 1:
            q_cols = Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh + chunk * CWK
            do_cols = DOut + off_b * stride_dob + q_start * stride_dos + off_h * stride_doh + chunk * CWV
        slope2, no_seed = head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, ALIBI, False)
        rng_row0 = (off_b * nheads + off_h) * max_seqlen_q
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_src,
            do_src,
            q_cols,
            do_cols,
            ncols_k,
            ncols_v,
            Lse + row0,
            Delta + row0,
            start_n,
            m_lo,
            full_lo,
            seqlen_q,
            seqlen_k,
            stride_qs,
            stride_dos,
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
            DSPLIT,
            CWK,
            CWV,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_src,
            do_src,
            q_cols,
            do_cols,
            ncols_k,
            ncols_v,
            Lse + row0,
            Delta + row0,
            start_n,
            full_lo,
            full_hi,
            seqlen_q,
            seqlen_k,
            stride_qs,
            stride_dos,
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
            DSPLIT,
            CWK,
            CWV,
        )
        if LOCAL:
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_src,
                do_src,
                q_cols,
                do_cols,
                ncols_k,
                ncols_v,
                Lse + row0,
                Delta + row0,
                start_n,
                full_hi,
                m_end,
                seqlen_q,
                seqlen_k,
                stride_qs,
                stride_dos,
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
                DSPLIT,
                CWK,
                CWV,
            )

    dk_dst = tile_src(
        DK,
        off_b,
        k_start,
        off_hk,
        stride_dkb,
        stride_dks,
        stride_dkh,
        seqlen_k,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_D,
        USE_TMA,
        HOST_DESC,
    )
    dv_dst = tile_src(
        DV,
        off_b,
        k_start,
        off_hk,
        stride_dvb,
        stride_dvs,
        stride_dvh,
        seqlen_k,
        HEAD_DIM_V,
        BLOCK_N,
        BLOCK_DV,
        USE_TMA,
        HOST_DESC,
    )
    if DSPLIT == 1:
        store_tile(dk_dst, dk * sm_scale, start_n, seqlen_k, stride_dks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, HOST_DESC)
        store_tile(dv_dst, dv, start_n, seqlen_k, stride_dvs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA, HOST_DESC)
    else:
        dk_cols = DK + off_b * stride_dkb + k_start * stride_dks + off_hk * stride_dkh + chunk * CWK
        dv_cols = DV + off_b * stride_dvb + k_start * stride_dvs + off_hk * stride_dvh + chunk * CWV
        store_rows(
            dk_cols,
            (dk * sm_scale).to(dk_cols.dtype.element_ty),
            start_n,
            seqlen_k,
            stride_dks,
            ncols_k,
            BLOCK_N,
            CWK,
            False,
        )
        store_rows(
            dv_cols, dv.to(dv_cols.dtype.element_ty), start_n, seqlen_k, stride_dvs, ncols_v, BLOCK_N, CWV, False
        )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_src,
    v_src,
    k_cols,
    ncols_k,
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
    DSPLIT: tl.constexpr,
    CWK: tl.constexpr,
):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_src, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or SOFTCAP or ALIBI:
            p, factor = _scores_bwd(
                qk,
                offs_m[:, None],
                offs_n[None, :],
                lse2[:, None],
                seqlen_q,
                seqlen_k,
                qk_scale,
                softcap_in,
                softcap_out,
                slope2,
                window_left,
                window_right,
                MASKED,
                CAUSAL,
                LOCAL,
                SOFTCAP,
                ALIBI,
            )
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        v = load_tile(v_src, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA, UPCAST, HOST_DESC)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = dropout_keep(seed, rng_row0, start_m, start_n, max_seqlen_k, dropout_p, BLOCK_M, BLOCK_N, False)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * factor
        if DSPLIT == 1:  # [BLOCK_M, BLOCK_D]
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        else:  # this program's columns of dQ: K's chunk
            k_c = load_rows(k_cols, start_n, seqlen_k, stride_ks, ncols_k, BLOCK_N, CWK, False, UPCAST)
            dq = tl.dot(ds.to(k.dtype), k_c.to(k.dtype), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    Alibi,
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
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
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
    DSPLIT: tl.constexpr,
):
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
    # DSPLIT > 1 (head dims past 256): DSPLIT programs per query block (the grid's second axis), each dS whole and
    # its own 1 / DSPLIT of dQ's columns
    CWK: tl.constexpr = BLOCK_D // DSPLIT if BLOCK_D // DSPLIT >= 16 else 16  # (a dot's dims are 16 at least)
    chunk = tl.program_id(1)
    ncols_k = HEAD_DIM - chunk * CWK
    k_cols = K  # (read only with DSPLIT > 1, where it is a pointer: no host descriptors)
    if DSPLIT > 1:
        k_cols = K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh + chunk * CWK
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
    do_src = tile_src(
        DOut,
        off_b,
        q_start,
        off_h,
        stride_dob,
        stride_dos,
        stride_doh,
        seqlen_q,
        HEAD_DIM_V,
        BLOCK_M,
        BLOCK_DV,
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
    q = load_tile(q_src, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, UPCAST, HOST_DESC)
    do = load_tile(do_src, start_m, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA, UPCAST, HOST_DESC)
    row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
    lse2 = load_vec(Lse + row0, start_m, seqlen_q, BLOCK_M, float("inf")) * LOG2E
    delta = load_vec(Delta + row0, start_m, seqlen_q, BLOCK_M, 0.0)
    dq = tl.zeros([BLOCK_M, CWK], dtype=tl.float32)

    # the last key block is masked even without causal: zero-filled K rows past seqlen_k would
    # otherwise give P = exp(-L), harmless only while it stays finite
    n_lo, full_lo, full_hi, n_end = key_block_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL, BLOCK_M, BLOCK_N
    )
    if LOCAL:
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_src,
            v_src,
            k_cols,
            ncols_k,
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
            DSPLIT,
            CWK,
        )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        k_src,
        v_src,
        k_cols,
        ncols_k,
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
        DSPLIT,
        CWK,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        k_src,
        v_src,
        k_cols,
        ncols_k,
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
        DSPLIT,
        CWK,
    )

    dq_dst = tile_src(
        DQ,
        off_b,
        q_start,
        off_h,
        stride_dqb,
        stride_dqs,
        stride_dqh,
        seqlen_q,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        USE_TMA,
        HOST_DESC,
    )
    if DSPLIT == 1:
        store_tile(dq_dst, dq * sm_scale, start_m, seqlen_q, stride_dqs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, HOST_DESC)
    else:
        dq_cols = DQ + off_b * stride_dqb + q_start * stride_dqs + off_h * stride_dqh + chunk * CWK
        store_rows(
            dq_cols,
            (dq * sm_scale).to(dq_cols.dtype.element_ty),
            start_m,
            seqlen_q,
            stride_dqs,
            ncols_k,
            BLOCK_M,
            CWK,
            False,
        )
