"""Attention over a KV cache (flash_attn_with_kvcache): decoding, speculative decoding and
chunked prefill.

Grid: (batch * nheads_k, row blocks, splits) -- batch * nheads_k first: CUDA caps the other
two axes at 65535. The query heads that share a K/V head are packed
into the rows of one program (row r is query r // group of head hk * group + r % group), so K/V
are read once per group. The keys of sequence b are cache positions [leftpad, cache_seqlens +
seqlen_new), read through the block table when paged (a gather per key row: any page size).

Paged prefill (flash_attn_varlen_func with block_table): VARLEN_Q reads sequence b's queries
from rows cu_seqlens_q[b] .. of a packed (total_q, nheads, headdim) q.

Split-KV: split s covers keys [s * chunk, (s + 1) * chunk) -- a fixed chunk of keys, so a row's
reduction order depends on its own keys only -- and writes a partial output and logsumexp in
fp32; attn_combine_kernel merges them. Without splits the program writes out and lse directly.
"""
import triton
import triton.language as tl

from .common import LN2, LOG2E, alibi_bias, tanh, visible


@triton.jit
def attn_kvcache_kernel(
    Q, K, V, Out, Lse, CacheSeqlens, CacheBatchIdx, LeftPad, BlockTable, Alibi, CuSeqlensQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lh,
    stride_bt, stride_alibi_b,
    nheads, nheads_k, seqlen_q, seqlen_new, cache_seqlen, chunk,
    window_left, window_right, sm_scale, softcap,
    CAUSAL: tl.constexpr, LOCAL: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, LEFTPAD: tl.constexpr, SEQLENS_TENSOR: tl.constexpr,
    SPLIT: tl.constexpr, VARLEN_Q: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    off_bhk = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    off_b = (off_bhk // nheads_k).to(tl.int64)
    off_hk = (off_bhk % nheads_k).to(tl.int64)
    group = nheads // nheads_k

    q_start = 0
    if VARLEN_Q:  # paged prefill: q rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of a (total_q, ...) tensor
        q_start = tl.load(CuSeqlensQ + off_b).to(tl.int64)
        seqlen_q = (tl.load(CuSeqlensQ + off_b + 1) - q_start).to(tl.int32)
        if pid_m * BLOCK_M >= seqlen_q * group:
            return
    if SEQLENS_TENSOR:
        cache_seqlen = tl.load(CacheSeqlens + off_b)
    key_end = cache_seqlen + seqlen_new  # physical end of this sequence's keys
    left_pad = 0
    if LEFTPAD:
        left_pad = tl.load(LeftPad + off_b)
    seqlen_k = key_end - left_pad  # keys are cache positions left_pad + j, j in [0, seqlen_k)

    # packed rows: query qi of head hk * group + g
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // group
    heads = off_hk * group + rows % group
    row_ok = qi < seqlen_q
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    # [BLOCK_M, BLOCK_D]
    q = tl.load(Q + off_b * stride_qb + (q_start + qi.to(tl.int64))[:, None] * stride_qs + heads[:, None] * stride_qh
                + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # this split's keys, narrowed to what the block's rows can see
    n_lo = split * chunk
    n_hi = tl.minimum(n_lo + chunk, seqlen_k)
    diag = seqlen_k - seqlen_q
    qi_first = pid_m * BLOCK_M // group
    qi_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    if CAUSAL:
        n_hi = tl.minimum(n_hi, qi_last + diag + 1)
    if LOCAL:
        n_hi = tl.minimum(n_hi, qi_last + diag + window_right + 1)
        n_lo = tl.maximum(n_lo, (qi_first + diag - window_left) // BLOCK_N * BLOCK_N)

    if PAGED:
        bt_row = BlockTable + off_b * stride_bt
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
    else:
        cache_row = off_b
        if BATCH_IDX:
            cache_row = tl.load(CacheBatchIdx + off_b).to(tl.int64)
        k_base = K + cache_row * stride_kb + off_hk * stride_kh
        v_base = V + cache_row * stride_vb + off_hk * stride_vh

    qk_scale = sm_scale * LOG2E
    softcap_in = sm_scale / softcap
    softcap_out = softcap * LOG2E
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        slope2 = tl.load(Alibi + off_b * stride_alibi_b + heads, mask=row_ok, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        kj = start_n + tl.arange(0, BLOCK_N)
        k_ok = kj < n_hi
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0 and not LEFTPAD:  # the block (start_n: a multiple of BLOCK_N) is in one page
                page = tl.load(bt_row + start_n // PAGE_SIZE).to(tl.int64)
                in_page = (start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
            else:  # a page per key row (int32 math; PAGE_SIZE a constant: shifts for powers of two)
                pos = kj + left_pad
                page = tl.load(bt_row + pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
                in_page = (pos % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kb + in_page * stride_ks
            v_off = page * stride_vb + in_page * stride_vs
        else:
            pos = (kj + left_pad).to(tl.int64)
            k_off = pos * stride_ks
            v_off = pos * stride_vs
        kv_mask = k_ok[:, None] & col_ok[None, :]
        # [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + k_off[:, None] + cols[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        # [BLOCK_M, BLOCK_N]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            s = tanh(qk * softcap_in) * softcap_out
        else:
            s = qk * qk_scale
        if ALIBI:
            s += alibi_bias(qi[:, None], kj[None, :], seqlen_q, seqlen_k, slope2[:, None])
        mask = visible(qi[:, None], kj[None, :], seqlen_q, seqlen_k, window_left, window_right, CAUSAL, LOCAL)
        s = tl.where(mask & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_off[:, None] + cols[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    # a split (or a row) that saw no key: lse -inf for the combine, +inf in the final result
    lse = tl.where(empty, float("-inf") if SPLIT else float("inf"), lse)
    o_ptrs = (Out + split * stride_os + off_b * stride_ob + (q_start + qi.to(tl.int64))[:, None] * stride_oq
              + heads[:, None] * stride_oh + cols[None, :])
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(Lse + split * stride_ls + off_b * stride_lb + heads * stride_lh + q_start + qi, lse, mask=row_ok)


@triton.jit
def attn_combine_kernel(
    OutPart, LsePart, Out, Lse,
    stride_ps, stride_ls, stride_lb, stride_lh,
    seqlen_q, nheads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one row: out = sum_s exp(lse_s - lse) out_s with lse = log sum_s
    exp(lse_s); a row that no split saw gets out 0 and lse +inf. Row r (the program) is (batch,
    query, head) in the order of the contiguous (batch, seqlen_q, nheads, headdim) out and of
    each split's part; the logsumexps are (splits,) batch, nheads, seqlen_q with the given
    strides. One program per row, the splits read CHUNK_S at a time: a batch of one sequence
    has few rows and up to 128 splits, so rows are the parallel axis, not splits."""
    r = tl.program_id(0).to(tl.int64)
    b = r // (seqlen_q * nheads)
    i = (r // nheads) % seqlen_q
    h = r % nheads
    lse_off = b * stride_lb + h * stride_lh + i
    s = tl.arange(0, BLOCK_S)
    lse_s = tl.load(LsePart + s.to(tl.int64) * stride_ls + lse_off, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.math.exp2((lse_s - m_shift) * LOG2E), 0)
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
        w = tl.math.exp2((lse_c - lse) * LOG2E)  # 0 for a split without keys (and for all when empty)
        part = tl.load(OutPart + sc.to(tl.int64)[:, None] * stride_ps + row_off + cols[None, :],
                       mask=ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tl.where(w[:, None] > 0.0, part * w[:, None], 0.0), 0)
    tl.store(Out + row_off + cols, acc.to(Out.dtype.element_ty), mask=col_ok)
    tl.store(Lse + lse_off, lse)
