"""Attention over a KV cache (flash_attn_with_kvcache): decoding, speculative decoding and
chunked prefill.

Grid: (batch * nheads_k, 1, splits), or (batch * nheads_k * row blocks, 1, splits) with several row blocks
(ROW_BLOCKS_ADJACENT); CUDA caps the second and third axes at 65535. The query heads that share a K/V head are packed
into the rows of one program (row r is query r // group of head hk * group + r % group), so K/V
are read once per group. The keys of sequence b are cache positions [leftpad, cache_seqlens +
seqlen_new), read through the block table when paged (a gather per key row: any page size).

Paged prefill (flash_attn_varlen_func with block_table): VARLEN_Q reads sequence b's queries
from rows cu_seqlens_q[b] .. of a packed (total_q, nheads, headdim) q.

Split-KV: split s covers keys [s * chunk, (s + 1) * chunk) -- a fixed chunk of keys, so a row's
reduction order depends on its own keys only -- and writes a partial output and logsumexp in
fp32; attn_combine_kernel merges them. Without splits the program writes out and lse directly.

q's and k's head dim that is two powers of two (576 = 512 + 64, the MLA decode's; 192 = 128 + 64) is two column
blocks, BLOCK_D and BLOCK_D_LO (planning.geometry.column_parts), each a load and a dot of its own, rather than one block
padded to the next power of two (1024, 256); BLOCK_D_LO is 0 otherwise.

ROW_BLOCKS_ADJACENT (more than one row block): the grid's first axis holds batch * nheads_k * row_blocks programs,
the row blocks of one (batch, kv head) consecutive, which run at the same time: its keys and values come from HBM once
and from L2 for the other row blocks, rather than once per row block (row blocks on the second axis would put
batch * nheads_k programs between two of one sequence, and cap them at CUDA's 65535).

KV_TMA (with V_FROM_K, a second column block and a paged cache whose pages are contiguous rows, a key block in
one page, no left padding, TMA's 16-byte alignment: ops.planning's DECODE_LOADS): whole key blocks are TMA copies
into shared memory, which the dots read there, rather than loads through registers (at MLA's 64 query rows a
program the 64 x 512 fp32 accumulator leaves no registers for the key tile); the last partial block takes the
pointer loop, whose masked loads zero the keys past the end.

V_FROM_K: the V cache is the K cache's first columns (MLA: v_cache = k_cache[..., :512], one latent head), so the
key tile's first column block is also the value tile: one load of the cache per key block, not two.

A learnable sink (SINK: a logit per query head in every row's denominator) joins once: in the program's
final step without splits, in the combine with them (never in a split's partial logsumexp).

FP8 (DecodeFp8): K and V (KV_E4M3), and q (Q_E4M3), may be float8_e4m3fn codes, passed as uint8 and converted in
registers -- by the GPU on sm_89+ (NATIVE), else by kernels.fp8.e4m3_decode (exact, integer arithmetic) -- into the dots' dtype
(q's, bf16 for an e4m3 q; fp32 with UPCAST): half the bytes of a 16-bit cache read. The descales (FA3's, float32
(batch, nheads_k), absent = 1) are the program's (batch row, kv head)'s: q's and k's fold into the score scale (so
softcap and ALiBi see the real scores), v's multiplies the normalized accumulator (a split's part too: the combine is
linear).
"""

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import LN2, LOG2E, alibi_bias, sink_join, tanh, visible
from .constexprs import Scoring
from .fp8 import e4m3_decode


class DecodeMods(NamedTuple):
    """How attn_kvcache_kernel forms and masks the scores (flash_attn's score options resolved, no dropout)."""

    CAUSAL: bool  # bottom-right causal mask
    LOCAL: bool  # sliding window (window_left, window_right); excludes CAUSAL
    SOFTCAP: bool  # softcap * tanh(s / softcap)
    ALIBI: bool  # per-head ALiBi slopes (Alibi, stride_alibi_b)
    SINK: bool  # a learnable logit per query head in the denominator (Sinks)


class CacheLayout(NamedTuple):
    """The cache as the decode and append kernels address it (ops.launch.kvcache.Cache)."""

    PAGED: bool  # pages through BlockTable, else a cache row per sequence
    BATCH_IDX: bool  # sequence b's cache row is CacheBatchIdx[b] (not paged)
    LEFTPAD: bool  # sequence b's keys start at LeftPad[b]
    SEQLENS_TENSOR: bool  # cache_seqlens per sequence in CacheSeqlens, else the one runtime cache_seqlen
    PAGE_SIZE: int  # rows of a page (1 when not paged)


class DecodePath(NamedTuple):
    """Which of attn_kvcache_kernel's paths a launch takes: its grid, its outputs, how it reads K/V."""

    SPLIT: bool  # split-KV: partial out and lse in fp32, merged by attn_combine_kernel
    VARLEN_Q: bool  # paged prefill: q rows from CuSeqlensQ of a packed (total_q, nheads, headdim) q
    CHECK: bool  # values out of range set Err
    PDL: bool  # the combine is a programmatic dependent launch (sm90)
    V_FROM_K: bool  # V is K's first column block: the key tile is the value tile
    ROW_BLOCKS_ADJACENT: bool  # several row blocks, consecutive on the grid's first axis
    KV_TMA: bool  # whole key blocks by TMA into shared memory (ops.planning.DECODE_LOADS' kv_tma row)


class DecodeDots(NamedTuple):
    """How attn_kvcache_kernel's dots compute."""

    UPCAST: bool  # q, k and v to fp32 before the dots (fp32 inputs, the interpreter)
    DOT_PRECISION: str  # tl.dot's input_precision: "ieee" or "tf32"
    ROW_EXACT: bool  # _row_exact_dot instead of tl.dot (the batch-invariant mode in the interpreter)


class DecodeFp8(NamedTuple):
    """Which of attn_kvcache_kernel's inputs are float8_e4m3fn codes (uint8 views) and which descales it reads."""

    Q_E4M3: bool  # q is e4m3 codes (its dots in bf16)
    KV_E4M3: bool  # the K and V caches are e4m3 codes
    Q_DESCALE: bool  # QDescale[b, h_k] multiplies q (else 1)
    K_DESCALE: bool
    V_DESCALE: bool
    # the codes converted by the GPU (sm_89+: cvt from e4m3x2, through the e4m3 type Triton has there), else by
    # kernels.fp8.e4m3_decode's integer arithmetic (sm_80/86, the interpreter)
    NATIVE: bool = False


class DecodeTile(NamedTuple):
    """attn_kvcache_kernel's head dims and tile (ops/planning/decoding.py)."""

    HEAD_DIM: int  # q's and k's head dim
    BLOCK_M: int  # packed rows (query heads x queries) per program
    BLOCK_N: int  # keys per block
    BLOCK_D: int  # q's and k's first column block
    HEAD_DIM_V: int  # v's head dim
    BLOCK_DV: int  # v's columns, a power of two
    BLOCK_D_LO: int  # q's and k's second column block (HEAD_DIM = BLOCK_D + BLOCK_D_LO), or 0


# The run-time bundles: each flattens into one scalar parameter per field, in field order; the launcher
# (ops.launch.kvcache) builds them by keyword, the kernels read them by name.
class DecodeShape(NamedTuple):
    """attn_kvcache_kernel's sizes (`shape`)."""

    nheads: int  # query heads
    nheads_k: int  # K/V heads
    seqlen_q: int  # queries per sequence (VARLEN_Q: each sequence's from CuSeqlensQ)
    seqlen_new: int  # new keys appended this call, the last of each sequence's keys
    cache_seqlen: int  # keys in the cache before them (SEQLENS_TENSOR: each sequence's from CacheSeqlens)
    chunk: int  # keys per split
    capacity: int  # positions of a cache row (paged: of a sequence's pages)
    n_rows: int  # cache rows (paged: pages)
    row_blocks: int  # BLOCK_M blocks of a (batch, kv head)'s packed rows
    seqlen_limit: int  # the largest cache_seqlen in range (CHECK)


class DecodeScore(NamedTuple):
    """attn_kvcache_kernel's score scalars (`score`)."""

    window_left: int  # keys left of the diagonal a query sees (MODS.LOCAL; a bound that cannot bind otherwise)
    window_right: int  # keys right of the diagonal a query sees, likewise
    sm_scale: float  # the scores' scale
    softcap: float  # MODS.SOFTCAP's cap (1.0 without)


class CombineShape(NamedTuple):
    """attn_combine_kernel's sizes (`shape`)."""

    seqlen_q: int  # queries per sequence (varlen: the packed total)
    nheads: int  # query heads
    num_splits: int  # splits of the keys


@triton.jit
def attn_kvcache_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    CacheSeqlens,
    CacheBatchIdx,
    LeftPad,
    BlockTable,
    Alibi,
    Sinks,
    CuSeqlensQ,
    Err,
    QDescale,
    KDescale,
    VDescale,
    q_strides,  # (batch, query, head)
    k_strides,  # (batch or page, position, head)
    v_strides,
    out_strides,  # (split, batch, query, head)
    lse_strides,  # (split, batch, head)
    stride_bt,
    stride_alibi_b,
    shape,  # DecodeShape
    score,  # DecodeScore
    descale_strides,  # (batch, kv head) of QDescale, KDescale, VDescale: six strides
    MODS: tl.constexpr,
    CACHE: tl.constexpr,
    PATH: tl.constexpr,
    DOTS: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
):
    stride_qb, stride_qs, stride_qh = q_strides
    stride_kb, stride_ks, stride_kh = k_strides
    stride_vb, stride_vs, stride_vh = v_strides
    stride_os, stride_ob, stride_oq, stride_oh = out_strides
    stride_ls, stride_lb, stride_lh = lse_strides
    nheads_k, seqlen_new, chunk = shape.nheads_k, shape.seqlen_new, shape.chunk
    capacity, n_rows = shape.capacity, shape.n_rows
    seqlen_q, cache_seqlen = shape.seqlen_q, shape.cache_seqlen  # (VARLEN_Q, SEQLENS_TENSOR: each sequence's)
    window_left, window_right, softcap = score.window_left, score.window_right, score.softcap
    sm_scale = score.sm_scale  # (FP8: times the q and k descales)
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_M: tl.constexpr = TILE.BLOCK_M
    BLOCK_N: tl.constexpr = TILE.BLOCK_N
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    BLOCK_D_LO: tl.constexpr = TILE.BLOCK_D_LO
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    PAGE_SIZE: tl.constexpr = CACHE.PAGE_SIZE
    if PATH.PDL:  # the combine kernel may be scheduled now: it waits (gdc_wait) for this grid's writes
        gdc_launch_dependents()
    if PATH.ROW_BLOCKS_ADJACENT:  # a flat first axis: consecutive programs take the row blocks of one (batch, kv head)
        flat = tl.program_id(0).to(tl.int64)
        off_bhk = flat // shape.row_blocks
        pid_m = flat % shape.row_blocks
    else:
        off_bhk = tl.program_id(0)
        pid_m = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    group = shape.nheads // nheads_k

    q_start = 0
    if PATH.VARLEN_Q:  # paged prefill: q rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of a (total_q, ...) tensor
        q_start = tl.load(CuSeqlensQ + off_b).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + off_b + 1) - q_start).to(tl.int32)
        if pid_m * BLOCK_M >= seqlen_q * group:
            return
    # the values read from memory are clamped into range, so that no value makes the kernel read
    # out of bounds; with CHECK a value out of range (cache_seqlens past seqlen_limit, left
    # padding past the keys, a cache row or page that does not exist) also sets Err, which the
    # host reads after the launch
    bad = tl.full([], 0, tl.int1)
    if CACHE.SEQLENS_TENSOR:
        cache_seqlen = tl.load(CacheSeqlens + off_b)
        bad = (cache_seqlen < 0) | (cache_seqlen > shape.seqlen_limit)
        cache_seqlen = tl.minimum(tl.maximum(cache_seqlen, 0), capacity - seqlen_new)
    key_end = cache_seqlen + seqlen_new  # physical end of this sequence's keys
    left_pad = 0
    if CACHE.LEFTPAD:
        left_pad = tl.load(LeftPad + off_b)
        bad |= (left_pad < 0) | (left_pad > cache_seqlen)
        left_pad = tl.minimum(tl.maximum(left_pad, 0), key_end)
    seqlen_k = key_end - left_pad  # keys are cache positions left_pad + j, j in [0, seqlen_k)

    # packed rows: query qi of head hk * group + g
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // group
    heads = off_hk * group + rows % group
    row_ok = qi < seqlen_q
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    cols_v = tl.arange(0, BLOCK_DV)
    col_v_ok = cols_v < HEAD_DIM_V
    # [BLOCK_M, BLOCK_D]
    q = tl.load(
        Q
        + off_b * stride_qb
        + (q_start + qi.to(tl.int64))[:, None] * stride_qs
        + heads[:, None] * stride_qh
        + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    q = _q_tile(q, DOTS, FP8)
    if BLOCK_D_LO > 0:  # q's second column block (HEAD_DIM = BLOCK_D + BLOCK_D_LO)
        cols_lo = BLOCK_D + tl.arange(0, BLOCK_D_LO)
        q_lo = tl.load(
            Q
            + off_b * stride_qb
            + (q_start + qi.to(tl.int64))[:, None] * stride_qs
            + heads[:, None] * stride_qh
            + cols_lo[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        q_lo = _q_tile(q_lo, DOTS, FP8)

    # this split's keys, narrowed to what the block's rows can see
    n_lo = split * chunk
    n_hi = tl.minimum(n_lo + chunk, seqlen_k)
    diag = seqlen_k - seqlen_q
    qi_first = pid_m * BLOCK_M // group
    qi_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    if MODS.CAUSAL:
        n_hi = tl.minimum(n_hi, qi_last + diag + 1)
    if MODS.LOCAL:
        n_hi = tl.minimum(n_hi, qi_last + diag + window_right + 1)
        n_lo = tl.maximum(n_lo, (qi_first + diag - window_left) // BLOCK_N * BLOCK_N)

    if CACHE.PAGED:
        bt_row = BlockTable + off_b * stride_bt
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
    else:
        cache_row = off_b
        if CACHE.BATCH_IDX:
            cache_row = tl.load(CacheBatchIdx + off_b).to(tl.int64)
            bad |= (cache_row < 0) | (cache_row >= n_rows)
            cache_row = tl.minimum(tl.maximum(cache_row, 0), n_rows - 1)
        k_base = K + cache_row * stride_kb + off_hk * stride_kh
        v_base = V + cache_row * stride_vb + off_hk * stride_vh

    # FP8: the descales of q and k fold into the score scale, v's into the output (DecodeFp8)
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h = descale_strides
    if FP8.Q_DESCALE:
        sm_scale *= tl.load(QDescale + off_b * sq_b + off_hk * sq_h)
    if FP8.K_DESCALE:
        sm_scale *= tl.load(KDescale + off_b * sk_b + off_hk * sk_h)
    qk_scale = sm_scale * LOG2E
    softcap_in = sm_scale / softcap
    softcap_out = softcap * LOG2E
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MODS.ALIBI:
        slope2 = tl.load(Alibi + off_b * stride_alibi_b + heads, mask=row_ok, other=0.0) * LOG2E
    # what _softmax_step masks and scales by (slope2: a row's, [BLOCK_M])
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

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    page_bad = tl.full([], 0, tl.int1)
    if PATH.KV_TMA:
        # whole key blocks by TMA into shared memory, where the dots read them (the page's rows: k_base's rows of
        # the pages, stride_ks apart); a last partial block goes to the loop below (pointers: keys past the end
        # read as zeros, so the values' garbage rows there never meet p = 0)
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[n_rows * PAGE_SIZE, HEAD_DIM], strides=[stride_ks, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        k_lo_desc = tl.make_tensor_descriptor(
            k_base + BLOCK_D, shape=[n_rows * PAGE_SIZE, BLOCK_D_LO], strides=[stride_ks, 1],
            block_shape=[BLOCK_N, BLOCK_D_LO],
        )  # fmt: skip
        tl.static_assert(
            PATH.V_FROM_K and BLOCK_D_LO > 0 and CACHE.PAGED and not CACHE.LEFTPAD and not FP8.KV_E4M3,
            "KV_TMA: ops.planning.DECODE_LOADS' kv_tma row's cache (16-bit)",
        )
        n_full = n_lo + tl.maximum(n_hi - n_lo, 0) // BLOCK_N * BLOCK_N
        for start_n in range(n_lo, n_full, BLOCK_N):
            kj = start_n + tl.arange(0, BLOCK_N)
            page = tl.load(bt_row + start_n // PAGE_SIZE)
            page_bad |= (page < 0) | (page >= n_rows)
            row = (tl.minimum(tl.maximum(page, 0), n_rows - 1) * PAGE_SIZE + start_n % PAGE_SIZE).to(tl.int32)
            k = k_desc.load([row, 0])
            k_lo = k_lo_desc.load([row, 0])
            if DOTS.UPCAST:
                k, k_lo = k.to(tl.float32), k_lo.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOTS.DOT_PRECISION)
            qk = tl.dot(q_lo, tl.trans(k_lo), qk, input_precision=DOTS.DOT_PRECISION)
            p, alpha, l_i, m_i = _softmax_step(qk, kj, kj < n_hi, qi, m_i, l_i, scoring, MODS)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(k.dtype), k, acc, input_precision=DOTS.DOT_PRECISION)  # v: k's first block (V_FROM_K)
        n_lo = n_full
    for start_n in range(n_lo, n_hi, BLOCK_N):
        kj = start_n + tl.arange(0, BLOCK_N)
        k_ok = kj < n_hi
        if CACHE.PAGED:
            # the block (start_n: a multiple of BLOCK_N) is in one page
            if PAGE_SIZE % BLOCK_N == 0 and not CACHE.LEFTPAD:
                page = tl.load(bt_row + start_n // PAGE_SIZE)
                page_bad |= (page < 0) | (page >= n_rows)
                in_page = (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
            else:  # a page per key row (int32 math; PAGE_SIZE a constant: shifts for powers of two)
                pos = kj + left_pad
                page = tl.load(bt_row + pos // PAGE_SIZE, mask=k_ok, other=0)
                page_bad |= tl.max((k_ok & ((page < 0) | (page >= n_rows))).to(tl.int32), 0) > 0
                in_page = (pos % PAGE_SIZE).to(tl.int64)
            page = tl.minimum(tl.maximum(page, 0), n_rows - 1).to(tl.int64)
            k_off = page * stride_kb + in_page * stride_ks
            v_off = page * stride_vb + in_page * stride_vs
        else:
            pos = (kj + left_pad).to(tl.int64)
            k_off = pos * stride_ks
            v_off = pos * stride_vs
        # [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + k_off[:, None] + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        k = _kv_tile(k, q.dtype, DOTS, FP8)
        # [BLOCK_M, BLOCK_N]
        if DOTS.ROW_EXACT:
            qk = _row_exact_dot(q, tl.trans(k))
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOTS.DOT_PRECISION)
        if BLOCK_D_LO > 0:
            k_lo = tl.load(k_base + k_off[:, None] + cols_lo[None, :], mask=k_ok[:, None], other=0.0)
            k_lo = _kv_tile(k_lo, q.dtype, DOTS, FP8)
            if DOTS.ROW_EXACT:
                qk += _row_exact_dot(q_lo, tl.trans(k_lo))
            else:
                qk = tl.dot(q_lo, tl.trans(k_lo), qk, input_precision=DOTS.DOT_PRECISION)
        p, alpha, l_i, m_new = _softmax_step(qk, kj, k_ok, qi, m_i, l_i, scoring, MODS)
        if PATH.V_FROM_K:  # v is k's first column block (ops.launch.kvcache.v_from_k): the tile already loaded
            v = k
        else:  # [BLOCK_N, BLOCK_DV]
            v = tl.load(v_base + v_off[:, None] + cols_v[None, :], mask=k_ok[:, None] & col_v_ok[None, :], other=0.0)
            v = _kv_tile(v, q.dtype, DOTS, FP8)
        acc = acc * alpha[:, None]
        if DOTS.ROW_EXACT:
            acc += _row_exact_dot(p.to(v.dtype), v)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOTS.DOT_PRECISION)
        m_i = m_new

    if PATH.CHECK:
        tl.store(Err, 1, mask=bad | page_bad)
    if MODS.SINK and not PATH.SPLIT:  # with splits, the combine adds the sink
        m_i, l_i, alpha = sink_join(m_i, l_i, tl.load(Sinks + heads, mask=row_ok, other=0.0) * LOG2E)
        acc = acc * alpha[:, None]
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if FP8.V_DESCALE:
        acc = acc * tl.load(VDescale + off_b * sv_b + off_hk * sv_h)
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    # a split (or a row) that saw no key: lse -inf for the combine, +inf in the final result
    lse = tl.where(empty, float("-inf") if PATH.SPLIT else float("inf"), lse)
    o_ptrs = (
        Out
        + split * stride_os
        + off_b * stride_ob
        + (q_start + qi.to(tl.int64))[:, None] * stride_oq
        + heads[:, None] * stride_oh
        + cols_v[None, :]
    )
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_v_ok[None, :])
    tl.store(Lse + split * stride_ls + off_b * stride_lb + heads * stride_lh + q_start + qi, lse, mask=row_ok)


@triton.jit
def _e4m3(codes, dtype: tl.constexpr, FP8: tl.constexpr):
    """uint8 e4m3 codes as dtype (exact: e4m3's values are fp16's and bf16's)."""
    if FP8.NATIVE:
        return codes.to(tl.float8e4nv, bitcast=True).to(dtype)
    return e4m3_decode(codes).to(dtype)


@triton.jit
def _q_tile(q, DOTS: tl.constexpr, FP8: tl.constexpr):
    """q's tile as the dots take it: e4m3 codes decoded (exact in bf16), fp32 with UPCAST."""
    if FP8.Q_E4M3:
        q = _e4m3(q, tl.bfloat16, FP8)
    if DOTS.UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _kv_tile(x, dtype: tl.constexpr, DOTS: tl.constexpr, FP8: tl.constexpr):
    """A key or value tile as the dots take it: e4m3 codes decoded into q's tile's dtype (exact in fp16 and bf16: e4m3's
    values are theirs), fp32 with UPCAST."""
    if FP8.KV_E4M3:
        x = _e4m3(x, dtype, FP8)
    elif DOTS.UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _row_exact_dot(a, b):
    """a @ b in fp32 as elementwise products summed over k: the batch-invariant mode's dots in Triton's interpreter
    (ROW_EXACT), where tl.dot is numpy's GEMM, whose rounding of a row depends on the row's place in the tile
    (OpenBLAS's micro-kernels take the rows in groups), so a prefill's row and the same row decoded alone would
    differ in their last bits. A GPU's MMA computes each row alike wherever it sits: the kernels keep tl.dot there."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _softmax_step(qk, kj, k_ok, qi, m_i, l_i, scoring, MODS: tl.constexpr):
    """One key block's step of the online softmax: the scores of qk (scaled, softcapped, ALiBi, masked; keys
    outside k_ok masked) in base 2. scoring: constexprs.Scoring, its slope2 a row's ([BLOCK_M]). Returns (p, alpha:
    the old accumulator's rescale, l_i, m_i) updated."""
    seqlen_q, seqlen_k = scoring.seqlen_q, scoring.seqlen_k
    if MODS.SOFTCAP:
        s = tanh(qk * scoring.softcap_in) * scoring.softcap_out
    else:
        s = qk * scoring.qk_scale
    if MODS.ALIBI:
        s += alibi_bias(qi[:, None], kj[None, :], seqlen_q, seqlen_k, scoring.slope2[:, None])
    mask = visible(
        qi[:, None], kj[None, :], seqlen_q, seqlen_k, scoring.window_left, scoring.window_right, MODS.CAUSAL, MODS.LOCAL
    )
    s = tl.where(mask & k_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def attn_combine_kernel(
    OutPart,
    LsePart,
    Out,
    Lse,
    Sinks,
    stride_ps,
    lse_strides,  # (split, batch, head) of LsePart; Lse's (batch, head) are the same
    shape,  # CombineShape
    SINK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits of one row: out = sum_s exp(lse_s - lse) out_s with lse = log sum_s
    exp(lse_s) (SINK: and exp(sink) of the row's head, which has no value); a row that no split saw gets out 0
    and lse +inf (SINK: the sink's logit). Row r (the program) is (batch,
    query, head) in the order of the contiguous (batch, seqlen_q, nheads, headdim) out and of
    each split's part; the logsumexps are (splits,) batch, nheads, seqlen_q with the given
    strides. One program per row, the splits read CHUNK_S at a time: a batch of one sequence
    has few rows and up to 128 splits, so rows are the parallel axis, not splits. PDL: launched
    as a programmatic dependent of the split kernel (sm90+), it waits here for that grid's writes."""
    stride_ls, stride_lb, stride_lh = lse_strides
    seqlen_q, nheads, num_splits = shape.seqlen_q, shape.nheads, shape.num_splits
    if PDL:
        gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    b = r // (seqlen_q * nheads)
    i = (r // nheads) % seqlen_q
    h = r % nheads
    lse_off = b * stride_lb + h * stride_lh + i
    s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(LsePart + s.to(tl.int64) * stride_ls + lse_off, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    if SINK:
        sink = tl.load(Sinks + h)
        m = tl.maximum(m, sink)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.math.exp2((lse_s - m_shift) * LOG2E), 0)
    if SINK:
        total += tl.math.exp2((sink - m_shift) * LOG2E)
    empty = total == 0.0
    lse = tl.where(empty, float("inf"), m_shift + tl.math.log2(tl.where(empty, 1.0, total)) * LN2)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    row_off = r * HEAD_DIM
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        ok = sc < num_splits
        lse_c = tl.load(LsePart + sc.to(tl.int64) * stride_ls + lse_off, mask=ok, other=float("-inf"))
        w = tl.math.exp2((lse_c - lse) * LOG2E)  # NaN for every split where lse is NaN
        part = tl.load(
            OutPart + sc.to(tl.int64)[:, None] * stride_ps + row_off + cols[None, :],
            mask=ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        # a split without keys (lse_c -inf; the lanes past num_splits) adds an exact 0, even where its part is NaN
        # (a NaN or inf value of a key it masked, times p = 0); any other split adds part * w, which keeps a NaN
        # (a NaN lse: NaN weights; a NaN part, even at a weight that underflows to 0, as a single pass's p = 0 does)
        acc += tl.sum(tl.where(lse_c[:, None] == float("-inf"), 0.0, part * w[:, None]), 0)
    tl.store(Out + row_off + cols, acc.to(Out.dtype.element_ty), mask=col_ok)
    tl.store(Lse + lse_off, lse)
