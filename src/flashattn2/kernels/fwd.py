"""FlashAttention-2 forward kernel.

One program per (query block, batch, head): the Q tile stays on chip while K/V tiles stream past;
an online softmax keeps the running row max `m_i` and row sum `l_i` (base 2) and an unscaled fp32
accumulator, which is divided by `l_i` once at the end. Only O and the logsumexp are written.
Softcap, ALiBi, a local window and a learnable sink (a logit per head in every row's denominator, joined once
after the key loop) are constexpr flags: when off they cost nothing. FP8 (PATH.FP8, FA3's forward): e4m3 q, k, v with
a float32 descale per (batch, kv head); the q and k descales join the score scale, the v descale the output.
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
from .fp8 import e4m3_decode, e4m3_encode
from .constexprs import Drop, Scoring, VtSrc


@triton.jit
def fp8_operand(x, PATH: tl.constexpr):
    """An e4m3 tile as the dots take it (constexprs.FP8_*): as loaded, or its uint8 codes decoded."""
    if PATH.FP8 == "bf16":
        x = e4m3_decode(x).to(tl.bfloat16)
    elif PATH.FP8 == "fp32" or PATH.FP8 == "e4m3-interp":
        x = e4m3_decode(x)
    return x


@triton.jit
def vt_src(Vt, vt_strides, off_b, off_hk, col0, seqlen_k, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """The e4m3 dots' V: a transposed copy (launch_triton.Forward: each kv head's (HEAD_DIM_V, keys) rows, keys
    contiguous), so that V meets wgmma K-major as its e4m3 operands must be, straight from shared memory (V itself
    would be transposed through registers on every key block). col0: the sequence's first key's column, 16-aligned
    (TMA's base alignment). A constexprs.VtSrc for vt_load: a TMA descriptor of the sequence's keys (zeros past them)
    or the rows' base pointer."""
    stride_b, stride_d, stride_h = vt_strides
    base = Vt + off_b * stride_b + off_hk * stride_h + col0
    if USE_TMA:
        src = tl.make_tensor_descriptor(
            base, shape=[HEAD_DIM_V, tl.maximum(seqlen_k, 1)], strides=[stride_d, 1], block_shape=[BLOCK_DV, BLOCK_N]
        )
        return VtSrc(src=src, seqlen_k=seqlen_k, stride_d=stride_d)
    else:
        return VtSrc(src=base, seqlen_k=seqlen_k, stride_d=stride_d)


@triton.jit
def vt_load(vt, start_n, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
            USE_TMA: tl.constexpr):  # fmt: skip
    """Keys [start_n, start_n + BLOCK_N) of a vt_src: [BLOCK_DV, BLOCK_N], zeros past either edge."""
    if USE_TMA:
        return vt.src.load([0, start_n])
    else:
        d = tl.arange(0, BLOCK_DV)
        n = start_n + tl.arange(0, BLOCK_N)
        mask = (d[:, None] < HEAD_DIM_V) & (n[None, :] < vt.seqlen_k)
        return tl.load(vt.src + d.to(tl.int64)[:, None] * vt.stride_d + n[None, :], mask=mask, other=0.0)


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_tile,
    v_tile,
    start_m,
    n_lo,
    n_hi,
    scoring,
    drop,
    MASKED: tl.constexpr,
    MODS: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
):
    """The online softmax over key blocks [n_lo, n_hi) (MASKED: with the mask applied). k_tile, v_tile: tile_src's;
    scoring: constexprs.Scoring; drop: constexprs.Drop."""
    seqlen_q, seqlen_k, qk_scale = scoring.seqlen_q, scoring.seqlen_k, scoring.qk_scale
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        k = fp8_operand(load_tile(k_tile, start_n, TILE.HEAD_DIM, BLOCK_N, TILE.BLOCK_D, PATH), PATH)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=PATH.DOT_PRECISION)
        if MASKED or MODS.SOFTCAP or MODS.ALIBI:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            # scores in base 2: softcap * tanh(qk * scale / softcap), then the ALiBi bias
            if MODS.SOFTCAP:
                s = tanh(qk * scoring.softcap_in) * scoring.softcap_out
            else:
                s = qk * qk_scale
            if MODS.ALIBI:
                s += alibi_bias(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, scoring.slope2)
            if MASKED:
                mask = visible(
                    offs_m[:, None],
                    offs_n[None, :],
                    seqlen_q,
                    seqlen_k,
                    scoring.window_left,
                    scoring.window_right,
                    MODS.CAUSAL,
                    MODS.LOCAL,
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
        if MODS.DROPOUT:
            # the normaliser keeps every score; only the values mixed into O are dropped
            keep = dropout_keep(drop, start_m, start_n, BLOCK_M, BLOCK_N, False)
            p = tl.where(keep, p, 0.0)
        if PATH.FP8 == "e4m3" or PATH.FP8 == "e4m3-interp":
            # V transposed (vt_src); P rounded to e4m3 (its rows' running max makes it <= 1), as the GPU rounds it in
            # the interpreter's run too
            acc = acc * alpha[:, None]
            vt = fp8_operand(vt_load(v_tile, start_n, TILE.HEAD_DIM_V, BLOCK_N, TILE.BLOCK_DV, PATH.VT_TMA), PATH)
            if PATH.FP8 == "e4m3-interp":
                p = e4m3_decode(e4m3_encode(p))
            acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc, input_precision=PATH.DOT_PRECISION)
        else:
            v = fp8_operand(load_tile(v_tile, start_n, TILE.HEAD_DIM_V, BLOCK_N, TILE.BLOCK_DV, PATH), PATH)
            # [BLOCK_M, BLOCK_DV]; P in v's type
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PATH.DOT_PRECISION)
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
    QDescale,
    KDescale,
    VDescale,
    q_strides,
    k_strides,
    v_strides,
    out_strides,
    lse_strides,
    stride_alibi_b,
    descale_strides,
    shape,
    score,
    MODS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SORTED: tl.constexpr,
    PATH: tl.constexpr,
    TILE: tl.constexpr,
):
    # (batch, row, head) strides per tensor, Lse's (batch, head); shape: constexprs.AttnShape; score:
    # constexprs.AttnScore; FP8: the descales' (batch, kv head) strides, q's, k's and v's ((0, 0) for one not given,
    # whose pointer is None; None without FP8, as the descale pointers)
    window_left, window_right = score.window_left, score.window_right
    sm_scale, softcap, dropout_p = score.sm_scale, score.softcap, score.dropout_p  # (sm_scale: times the descales)
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    # varlen: programs cover max_seqlen_q; those past their own sequence's end return at once
    start_m, off_bh, off_b, off_h, off_hk, q_start, seqlen_q, k_start, seqlen_k = query_program(
        shape, CuSeqlensQ, CuSeqlensK, SeqOrder, MODS.CAUSAL, IS_VARLEN, SORTED, BLOCK_M
    )
    if start_m >= seqlen_q:
        return
    if PATH.FP8 != "":  # each descale given: its (batch, kv head) value; None: 1
        qd_b, qd_h, kd_b, kd_h, vd_b, vd_h = descale_strides
        if QDescale is not None:
            sm_scale = sm_scale * tl.load(QDescale + off_b * qd_b + off_hk * qd_h)
        if KDescale is not None:
            sm_scale = sm_scale * tl.load(KDescale + off_b * kd_b + off_hk * kd_h)
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
    k_tile = tile_src((K, k_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, PATH)
    if PATH.FP8 == "e4m3" or PATH.FP8 == "e4m3-interp":  # V is its transposed copy (vt_src), v_strides its strides
        vt_col0 = k_start
        if IS_VARLEN:  # each sequence's keys start 16-aligned in the copy (ops.launch.launch_triton.Forward.vt_columns)
            vt_col0 = (k_start + 15) // 16 * 16 + 16 * off_b
        v_tile = vt_src(V, v_strides, off_b, off_hk, vt_col0, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH.VT_TMA)
    else:
        v_tile = tile_src((V, v_strides), off_b, k_start, off_hk, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, PATH)
    o_tile = tile_src((Out, out_strides), off_b, q_start, off_h, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)

    q = fp8_operand(load_tile(q_tile, start_m, HEAD_DIM, BLOCK_M, BLOCK_D, PATH), PATH)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_lo, full_lo, full_hi, n_end = key_block_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, MODS.CAUSAL, MODS.LOCAL, BLOCK_M, BLOCK_N
    )
    if MODS.LOCAL:
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_tile, v_tile, start_m, n_lo, full_lo, scoring, drop, True, MODS, PATH, TILE
        )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_tile, v_tile, start_m, full_lo, full_hi, scoring, drop, False, MODS, PATH, TILE
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_tile, v_tile, start_m, full_hi, n_end, scoring, drop, True, MODS, PATH, TILE
    )

    if MODS.SINK:
        m_i, l_i, alpha = sink_join(m_i, l_i, tl.load(Sinks + off_h) * LOG2E)
        acc = acc * alpha[:, None]
    # a row that sees no key: output 0 and logsumexp +inf (flash-attn 2's convention; with a sink, the sink's logit)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if MODS.DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    if PATH.FP8 != "" and VDescale is not None:
        acc = acc * tl.load(VDescale + off_b * vd_b + off_hk * vd_h)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    store_tile(o_tile, acc, start_m, HEAD_DIM_V, BLOCK_M, BLOCK_DV, PATH)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    stride_lse_b, stride_lse_h = lse_strides
    lse_row0 = off_b * stride_lse_b + off_h * stride_lse_h + q_start
    tl.store(Lse + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
