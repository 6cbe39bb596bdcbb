"""FlashAttention-2 backward kernels: after D = rowsum(dO * O) (bwd_preprocess.py), dK/dV per key block, then dQ
per query block in its own pass (no atomics: every run gives bitwise-identical gradients).

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
from .constexprs import DkdvChunk, DkdvHead, DqChunk, DqRows, Drop, Scoring


@triton.constexpr_function
def chunk_width(block, dsplit):
    """The columns of one of DSPLIT programs' chunk of a block of columns: block / dsplit, 16 at least (a dot's
    dims are)."""
    return block // dsplit if block // dsplit >= 16 else 16


@triton.jit
def _scores_bwd(qk, qi, kj, lse2, scoring, MASKED: tl.constexpr, MODS: tl.constexpr):
    """P = exp(S - L) recomputed, and dS's softcap factor 1 - tanh^2 (1.0 without softcap). scoring:
    constexprs.Scoring.

    Orientation-free: qk is [M, N] with qi [M, 1], kj [1, N], lse2 [M, 1], or all transposed.
    """
    grad_factor = 1.0
    if MODS.SOFTCAP:
        t = tanh(qk * scoring.softcap_in)
        s = t * scoring.softcap_out
        grad_factor = 1.0 - t * t
    else:
        s = qk * scoring.qk_scale
    if MODS.ALIBI:
        s += alibi_bias(qi, kj, scoring.seqlen_q, scoring.seqlen_k, scoring.slope2)
    p = tl.math.exp2(s - lse2)
    if MASKED:
        mask = visible(
            qi,
            kj,
            scoring.seqlen_q,
            scoring.seqlen_k,
            scoring.window_left,
            scoring.window_right,
            MODS.CAUSAL,
            MODS.LOCAL,
        )
        p = tl.where(mask, p, 0.0)
    return p, grad_factor


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    head,
    cols,
    start_n,
    m_lo,
    m_hi,
    scoring,
    drop,
    MASKED: tl.constexpr,
    MODS: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
    DSPLIT: tl.constexpr,
):
    """dK and dV of key block start_n from query blocks [m_lo, m_hi) of one query head (MASKED: with the mask
    applied): head: constexprs.DkdvHead; cols: constexprs.DkdvChunk; scoring: constexprs.Scoring; drop:
    constexprs.Drop."""
    seqlen_q, qk_scale = scoring.seqlen_q, scoring.qk_scale
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    CWK: tl.constexpr = chunk_width(BLOCK_D, DSPLIT)
    CWV: tl.constexpr = chunk_width(BLOCK_DV, DSPLIT)
    DOT_PRECISION: tl.constexpr = PATH.DOT_PRECISION
    offs_n = start_n + tl.arange(0, BLOCK_N)
    for start_m in range(m_lo, m_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(head.q, start_m, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
        # rows past seqlen_q load lse = +inf, so their P is exactly 0
        lse2 = load_vec(head.lse, start_m, seqlen_q, BLOCK_M, float("inf")) * LOG2E
        # P^T, [BLOCK_N, BLOCK_M]: computed transposed so dV and dK need no transpose of P or dS
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASKED or MODS.SOFTCAP or MODS.ALIBI:
            pT, factorT = _scores_bwd(qkT, offs_m[None, :], offs_n[:, None], lse2[None, :], scoring, MASKED, MODS)
        else:
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        do = load_tile(head.do, start_m, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)
        # dv: [BLOCK_N, BLOCK_DV]
        if MODS.DROPOUT:
            keepT = dropout_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, True)
            inv_keep = 1.0 / (1.0 - drop.dropout_p)
            pT_kept = tl.where(keepT, pT * inv_keep, 0.0)
        else:
            pT_kept = pT
        if DSPLIT == 1:
            dv = tl.dot(pT_kept.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        else:  # this program's columns of dV: dO's chunk
            do_c = load_rows(
                cols.do_cols, start_m, seqlen_q, head.do.stride, cols.ncols_v, BLOCK_M, CWV, False, PATH.UPCAST
            )
            dv = tl.dot(pT_kept.to(do_c.dtype), do_c, dv, input_precision=DOT_PRECISION)
        delta = load_vec(head.delta, start_m, seqlen_q, BLOCK_M, 0.0)
        # [BLOCK_N, BLOCK_M]
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if MODS.DROPOUT:
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        dsT = pT * (dpT - delta[None, :])
        if MODS.SOFTCAP:
            dsT = dsT * factorT
        dsT = dsT.to(q.dtype)
        if DSPLIT == 1:
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        else:  # this program's columns of dK: Q's chunk
            q_c = load_rows(
                cols.q_cols, start_m, seqlen_q, head.q.stride, cols.ncols_k, BLOCK_M, CWK, False, PATH.UPCAST
            )
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
    q_strides,
    k_strides,
    v_strides,
    dout_strides,
    dk_strides,
    dv_strides,
    lse_strides,
    stride_alibi_b,
    shape,
    score,
    MODS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SORTED: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
    DSPLIT: tl.constexpr,
):
    # one program per (key block, batch, K/V head); the query heads of a GQA group are summed here. DSPLIT > 1 (head
    # dims past 256): DSPLIT programs per key block (the grid's second axis), each P and dS whole and its own
    # 1 / DSPLIT of dK's and dV's columns, so that the accumulators fit the registers. Strides: (batch, row, head),
    # Lse's (batch, head); shape: constexprs.DkdvShape; score: constexprs.AttnScore
    nheads_k, group_size = shape.nheads_k, shape.group_size
    max_seqlen_q, max_seqlen_k = shape.max_seqlen_q, shape.max_seqlen_k
    window_left, window_right = score.window_left, score.window_right
    sm_scale, softcap, dropout_p = score.sm_scale, score.softcap, score.dropout_p
    stride_qb, stride_qs, stride_qh = q_strides
    stride_dob, stride_dos, stride_doh = dout_strides
    stride_dkb, stride_dks, stride_dkh = dk_strides
    stride_dvb, stride_dvs, stride_dvh = dv_strides
    stride_lse_b, stride_lse_h = lse_strides
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    CWK: tl.constexpr = chunk_width(BLOCK_D, DSPLIT)
    CWV: tl.constexpr = chunk_width(BLOCK_DV, DSPLIT)
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
    no_slope, seed = head_constants(Alibi, stride_alibi_b, off_b, 0, Seed, False, MODS.DROPOUT)

    k_tile = tile_src((K, k_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
    v_tile = tile_src((V, v_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
    k = load_tile(k_tile, start_n, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
    v = load_tile(v_tile, start_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
    dk = tl.zeros([BLOCK_N, CWK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, CWV], dtype=tl.float32)

    m_lo, full_lo, full_hi, m_end = query_block_range(
        start_n, seqlen_q, seqlen_k, window_left, window_right, MODS.CAUSAL, MODS.LOCAL, BLOCK_M, BLOCK_N
    )
    # num_stages=1: this loop is never pipelined. Where the inner loops fold away (seqlen_q == 1, which Triton
    # specializes into a constant) it would be the innermost loop, and the pipeliner cannot predicate the
    # descriptors made in it (tile_src with USE_TMA: 'ttng.tensormap_create' ... doesn't know how to predicate)
    for g in tl.range(0, group_size, num_stages=1):
        off_h = off_hk * group_size + g
        q_tile = tile_src((Q, q_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
        do_tile = tile_src((DOut, dout_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)
        row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
        q_cols, do_cols = Q, DOut  # (read only with DSPLIT > 1, where they are pointers: no host descriptors)
        if DSPLIT > 1:
            q_cols = Q + off_b * stride_qb + q_start * stride_qs + off_h * stride_qh + chunk * CWK
            do_cols = DOut + off_b * stride_dob + q_start * stride_dos + off_h * stride_doh + chunk * CWV
        slope2, no_seed = head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, MODS.ALIBI, False)
        rng_row0 = (off_b * shape.nheads + off_h) * max_seqlen_q
        head = DkdvHead(q=q_tile, do=do_tile, lse=Lse + row0, delta=Delta + row0)
        cols = DkdvChunk(q_cols=q_cols, do_cols=do_cols, ncols_k=ncols_k, ncols_v=ncols_v)
        scoring = Scoring(
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            qk_scale=qk_scale,
            softcap_in=softcap_in,
            softcap_out=softcap_out,
            slope2=slope2,
            window_left=window_left,
            window_right=window_right,
        )
        drop = Drop(seed=seed, rng_row0=rng_row0, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, head, cols, start_n, m_lo, full_lo, scoring, drop, True, MODS, PATH, TILE, DSPLIT
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, head, cols, start_n, full_lo, full_hi, scoring, drop, False, MODS, PATH, TILE, DSPLIT
        )
        if MODS.LOCAL:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, head, cols, start_n, full_hi, m_end, scoring, drop, True, MODS, PATH, TILE, DSPLIT
            )

    dk_tile = tile_src((DK, dk_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
    dv_tile = tile_src((DV, dv_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
    if DSPLIT == 1:
        store_tile(dk_tile, dk * sm_scale, start_n, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
        store_tile(dv_tile, dv, start_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
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
    rows,
    k_tile,
    v_tile,
    cols,
    start_m,
    n_lo,
    n_hi,
    scoring,
    drop,
    MASKED: tl.constexpr,
    MODS: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
    DSPLIT: tl.constexpr,
):
    """dQ of query block start_m from key blocks [n_lo, n_hi) (MASKED: with the mask applied): rows: constexprs.DqRows;
    k_tile, v_tile: tile_src's; cols: constexprs.DqChunk; scoring: constexprs.Scoring; drop: constexprs.Drop."""
    q, do, lse2, delta = rows.q, rows.do, rows.lse2, rows.delta
    seqlen_k, qk_scale = scoring.seqlen_k, scoring.qk_scale
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    CWK: tl.constexpr = chunk_width(BLOCK_D, DSPLIT)
    DOT_PRECISION: tl.constexpr = PATH.DOT_PRECISION
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_tile, start_n, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MODS.SOFTCAP or MODS.ALIBI:
            p, factor = _scores_bwd(qk, offs_m[:, None], offs_n[None, :], lse2[:, None], scoring, MASKED, MODS)
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        v = load_tile(v_tile, start_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if MODS.DROPOUT:
            keep = dropout_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, False)
            dp = tl.where(keep, dp * (1.0 / (1.0 - drop.dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if MODS.SOFTCAP:
            ds = ds * factor
        if DSPLIT == 1:  # [BLOCK_M, BLOCK_D]
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        else:  # this program's columns of dQ: K's chunk
            k_c = load_rows(
                cols.k_cols, start_n, seqlen_k, k_tile.stride, cols.ncols_k, BLOCK_N, CWK, False, PATH.UPCAST
            )
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
    q_strides,
    k_strides,
    v_strides,
    dout_strides,
    dq_strides,
    lse_strides,
    stride_alibi_b,
    shape,
    score,
    MODS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SORTED: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
    DSPLIT: tl.constexpr,
):
    # Strides: (batch, row, head), Lse's (batch, head); shape: constexprs.AttnShape; score: constexprs.AttnScore
    window_left, window_right = score.window_left, score.window_right
    sm_scale, softcap, dropout_p = score.sm_scale, score.softcap, score.dropout_p
    stride_kb, stride_ks, stride_kh = k_strides
    stride_dqb, stride_dqs, stride_dqh = dq_strides
    stride_lse_b, stride_lse_h = lse_strides
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    start_m, off_bh, off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k = query_program(
        shape, CuSeqlensQ, CuSeqlensK, SeqOrder, MODS.CAUSAL, IS_VARLEN, SORTED, BLOCK_M
    )
    if start_m >= seqlen_q:
        return
    # DSPLIT > 1 (head dims past 256): DSPLIT programs per query block (the grid's second axis), each dS whole and
    # its own 1 / DSPLIT of dQ's columns
    CWK: tl.constexpr = chunk_width(BLOCK_D, DSPLIT)
    chunk = tl.program_id(1)
    ncols_k = HEAD_DIM - chunk * CWK
    k_cols = K  # (read only with DSPLIT > 1, where it is a pointer: no host descriptors)
    if DSPLIT > 1:
        k_cols = K + off_b * stride_kb + k_start * stride_ks + off_hk * stride_kh + chunk * CWK
    qk_scale = sm_scale * LOG2E
    softcap_in = sm_scale / softcap
    softcap_out = softcap * LOG2E
    slope2, seed = head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, MODS.ALIBI, MODS.DROPOUT)
    rng_row0 = off_bh.to(tl.int64) * shape.max_seqlen_q
    scoring = Scoring(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        qk_scale=qk_scale,
        softcap_in=softcap_in,
        softcap_out=softcap_out,
        slope2=slope2,
        window_left=window_left,
        window_right=window_right,
    )
    drop = Drop(seed=seed, rng_row0=rng_row0, max_seqlen_k=shape.max_seqlen_k, dropout_p=dropout_p)

    q_tile = tile_src((Q, q_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
    do_tile = tile_src((DOut, dout_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)
    k_tile = tile_src((K, k_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
    v_tile = tile_src((V, v_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
    q = load_tile(q_tile, start_m, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
    do = load_tile(do_tile, start_m, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)
    row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
    lse2 = load_vec(Lse + row0, start_m, seqlen_q, BLOCK_M, float("inf")) * LOG2E
    delta = load_vec(Delta + row0, start_m, seqlen_q, BLOCK_M, 0.0)
    dq = tl.zeros([BLOCK_M, CWK], dtype=tl.float32)
    rows = DqRows(q=q, do=do, lse2=lse2, delta=delta)
    cols = DqChunk(k_cols=k_cols, ncols_k=ncols_k)

    # the last key block is masked even without causal: zero-filled K rows past seqlen_k would
    # otherwise give P = exp(-L), harmless only while it stays finite
    n_lo, full_lo, full_hi, n_end = key_block_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, MODS.CAUSAL, MODS.LOCAL, BLOCK_M, BLOCK_N
    )
    if MODS.LOCAL:
        dq = _dq_inner(
            dq, rows, k_tile, v_tile, cols, start_m, n_lo, full_lo, scoring, drop, True, MODS, PATH, TILE, DSPLIT
        )
    dq = _dq_inner(
        dq, rows, k_tile, v_tile, cols, start_m, full_lo, full_hi, scoring, drop, False, MODS, PATH, TILE, DSPLIT
    )
    dq = _dq_inner(
        dq, rows, k_tile, v_tile, cols, start_m, full_hi, n_end, scoring, drop, True, MODS, PATH, TILE, DSPLIT
    )

    dq_tile = tile_src((DQ, dq_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
    if DSPLIT == 1:
        store_tile(dq_tile, dq * sm_scale, start_m, HEAD_DIM, BLOCK_M, BLOCK_D, PATH)
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
