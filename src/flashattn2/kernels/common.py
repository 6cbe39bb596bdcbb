"""Constants and small helpers shared by the attention kernels (Triton only, no torch)."""

import triton
import triton.language as tl

from .constexprs import TileSrc

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in base 2 so exp2 can be used
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts a base-2 logsumexp back to natural log


@triton.jit
def make_desc_or_ptr(
    base,
    seqlen,
    stride_s,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """A (seqlen, HEAD_DIM) matrix of one (batch, head): a TMA descriptor, or the base pointer itself."""
    if USE_TMA:
        # an empty varlen sequence still gets a valid (never read) descriptor
        return tl.make_tensor_descriptor(
            base, shape=[tl.maximum(seqlen, 1), HEAD_DIM], strides=[stride_s, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
        )
    else:
        return base


@triton.jit
def load_rows(
    src,
    start,
    seqlen,
    stride_s,
    HEAD_DIM,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Rows [start, start + BLOCK_ROWS) of a (seqlen, HEAD_DIM) matrix; zeros past either edge. HEAD_DIM is a
    constexpr at most callers, a runtime count for a head-dim chunk (kernels/bwd.py's DSPLIT: src is the chunk's
    first column, HEAD_DIM what is left of the row there, possibly <= 0: all zeros; pointers only)."""
    if USE_TMA:
        x = src.load([start, 0])
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        # [BLOCK_ROWS, BLOCK_D]
        ptrs = src + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
        x = tl.load(ptrs, mask=(rows[:, None] < seqlen) & (cols[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def store_rows(
    dst,
    x,
    start,
    seqlen,
    stride_s,
    HEAD_DIM,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Store a [BLOCK_ROWS, BLOCK_D] tile at rows [start, ...) of a (seqlen, HEAD_DIM) matrix, clipped (HEAD_DIM: as
    load_rows)."""
    if USE_TMA:
        dst.store([start, 0], x)
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = dst + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
        tl.store(ptrs, x, mask=(rows[:, None] < seqlen) & (cols[None, :] < HEAD_DIM))


@triton.jit
def tile_src(
    x,
    off_b,
    row0,
    off_h,
    seqlen,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PATH: tl.constexpr,
):
    """Where the (seqlen, HEAD_DIM) rows of batch entry off_b, head off_h of x = (tensor, its (batch, row, head)
    strides) are read or written: a constexprs.TileSrc for load_tile / store_tile. PATH (constexprs.Path).HOST_DESC:
    the tensor is a descriptor built on the host over (batch, seqlen, heads * HEAD_DIM) with a [1, BLOCK_ROWS,
    HEAD_DIM] box (dense inputs only: row0 is 0), read at column off_h * HEAD_DIM; no descriptor is written per
    program. Otherwise a descriptor made here (USE_TMA) or the base pointer of those rows."""
    X, strides = x
    stride_b, stride_s, stride_h = strides
    if PATH.HOST_DESC:
        return TileSrc(
            src=X, batch=off_b.to(tl.int32), col=(off_h * HEAD_DIM).to(tl.int32), seqlen=seqlen, stride=stride_s
        )
    else:
        base = X + off_b * stride_b + row0 * stride_s + off_h * stride_h
        src = make_desc_or_ptr(base, seqlen, stride_s, HEAD_DIM, BLOCK_ROWS, BLOCK_D, PATH.USE_TMA)
        return TileSrc(src=src, batch=0, col=0, seqlen=seqlen, stride=stride_s)


@triton.jit
def load_tile(tile, start, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PATH: tl.constexpr):
    """load_rows of a tile_src source."""
    if PATH.HOST_DESC:
        x = tile.src.load([tile.batch, start, tile.col]).reshape(BLOCK_ROWS, BLOCK_D)
        if PATH.UPCAST:
            x = x.to(tl.float32)
        return x
    else:
        return load_rows(
            tile.src, start, tile.seqlen, tile.stride, HEAD_DIM, BLOCK_ROWS, BLOCK_D, PATH.USE_TMA, PATH.UPCAST
        )


@triton.jit
def store_tile(
    tile, x, start, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PATH: tl.constexpr
):
    """store_rows of x, cast to the destination's dtype, into a tile_src destination."""
    if PATH.USE_TMA:  # a descriptor's dtype is its element type
        x = x.to(tile.src.dtype)
    else:
        x = x.to(tile.src.dtype.element_ty)
    if PATH.HOST_DESC:
        tile.src.store([tile.batch, start, tile.col], x.reshape(1, BLOCK_ROWS, BLOCK_D))
    else:
        store_rows(tile.src, x, start, tile.seqlen, tile.stride, HEAD_DIM, BLOCK_ROWS, BLOCK_D, PATH.USE_TMA)


@triton.jit
def load_vec(ptr, start, seqlen, BLOCK: tl.constexpr, other):
    """Elements [start, start + BLOCK) of a per-row fp32 vector, `other` past its end."""
    offs = start + tl.arange(0, BLOCK)
    return tl.load(ptr + offs, mask=offs < seqlen, other=other)


@triton.jit
def visible(qi, kj, seqlen_q, seqlen_k, window_left, window_right, CAUSAL: tl.constexpr, LOCAL: tl.constexpr):
    """True where query qi may see key kj; qi and kj broadcast against each other ([M, 1] and
    [1, N], or transposed), so both tile orientations share this code.

    Alignment is bottom-right: with diag = seqlen_k - seqlen_q, causal row i sees keys
    j <= i + diag; a local window sees i + diag - window_left <= j <= i + diag + window_right.
    """
    diag = seqlen_k - seqlen_q
    mask = kj < seqlen_k
    if CAUSAL:
        mask = mask & (kj <= qi + diag)
    if LOCAL:
        mask = mask & (kj <= qi + (diag + window_right)) & (kj >= qi + (diag - window_left))
    return mask


@triton.jit
def key_block_range(
    start_m,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For query rows [start_m, start_m + BLOCK_M): (n_lo, full_lo, full_hi, n_end).

    Key blocks in [full_lo, full_hi) are visible to every row and need no mask; blocks in
    [n_lo, full_lo) (left edge of a local window) and [full_hi, n_end) (the causal diagonal, the
    window's right edge, the end of the keys) are masked; the rest are skipped. n_lo = full_lo = 0
    unless LOCAL.
    """
    diag = seqlen_k - seqlen_q
    n_lo = 0
    full_lo = 0
    n_end = seqlen_k
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        n_end = tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + diag, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N)
        full_hi = tl.minimum(full_hi, n_end)
    if LOCAL:
        n_end = tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + diag + window_right, 0))
        n_lo = tl.minimum(tl.maximum(start_m + diag - window_left, 0) // BLOCK_N * BLOCK_N, n_end)
        # the block's last row has the highest lower bound, its first row the lowest upper bound
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + diag - window_left, 0), BLOCK_N) * BLOCK_N
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + diag + window_right + 1, 0) // BLOCK_N * BLOCK_N)
        full_lo = tl.minimum(tl.maximum(full_lo, n_lo), n_end)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), n_end)
    return n_lo, full_lo, full_hi, n_end


@triton.jit
def query_block_range(
    start_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For key rows [start_n, start_n + BLOCK_N): (m_lo, full_lo, full_hi, m_end).

    Query blocks in [full_lo, full_hi) see all of the key block; [m_lo, full_lo) and
    [full_hi, m_end) see part of it (masked); the rest see none of it and are skipped.
    """
    diag = seqlen_k - seqlen_q
    m_lo = 0
    full_lo = 0
    full_hi = seqlen_q
    m_end = seqlen_q
    if CAUSAL:
        m_lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
    if LOCAL:
        m_end = tl.minimum(seqlen_q, tl.maximum(start_n + BLOCK_N - diag + window_left, 0))
        m_lo = tl.maximum(start_n - diag - window_right, 0) // BLOCK_M * BLOCK_M
        # rows that see the whole block: the block's last key under their upper bound, its
        # first key over their lower bound
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag - window_right, 0), BLOCK_M) * BLOCK_M
        full_hi = tl.minimum(seqlen_q, tl.maximum(start_n - diag + window_left + 1, 0)) // BLOCK_M * BLOCK_M
    m_lo = tl.minimum(m_lo, m_end)
    full_lo = tl.minimum(tl.maximum(full_lo, m_lo), m_end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), m_end)
    return m_lo, full_lo, full_hi, m_end


@triton.jit
def tanh(x):
    """1 - 2 / (exp(2x) + 1): exact limits +-1, no libdevice (the interpreter has none)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def alibi_bias(qi, kj, seqlen_q, seqlen_k, slope2):
    """ALiBi bias in base 2, -slope * log2(e) * |i + seqlen_k - seqlen_q - j|, for broadcasting qi, kj."""
    return -slope2 * tl.abs(qi + (seqlen_k - seqlen_q) - kj).to(tl.float32)


@triton.jit
def seq_bounds(CuSeqlens, off_b, max_seqlen, IS_VARLEN: tl.constexpr):
    """(first row, length) of batch entry off_b: from cu_seqlens in varlen, else (0, max_seqlen)."""
    if IS_VARLEN:
        start = tl.load(CuSeqlens + off_b)
        return start.to(tl.int64), tl.load(CuSeqlens + off_b + 1) - start
    else:
        return tl.zeros([], dtype=tl.int64), max_seqlen


@triton.jit
def dropout_keep(drop, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr):
    """True where the score (query, key) of the tile [start_m, +BLOCK_M) x [start_n, +BLOCK_N)
    is kept ([BLOCK_N, BLOCK_M] when TRANS); drop: constexprs.Drop.

    One Philox call (4 x 32 bits) gives eight 16-bit numbers, for keys 8c .. 8c + 7 of a row, at
    offset (rng_row0 + query) * cdiv(max_seqlen_k, 8) + c: the number of a score does not depend
    on the tiling, so the backward's tiles regenerate the forward's mask. A score is kept when its
    number is >= round(dropout_p * 2^16). start_n and BLOCK_N are multiples of 8."""
    rows = drop.rng_row0 + start_m + tl.arange(0, BLOCK_M).to(tl.int64)
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    # [BLOCK_M, BLOCK_N // 8]
    offsets = rows[:, None] * tl.cdiv(drop.max_seqlen_k, 8) + groups[None, :]
    w0, w1, w2, w3 = tl.randint4x(drop.seed, offsets)
    w = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    # [BLOCK_M, BLOCK_N // 8, 2, 2, 2] -> [BLOCK_M, BLOCK_N]: key 8c + 4i + 2j + h is half h of word 2i + j
    bits = tl.reshape(tl.join(w & 0xFFFF, w >> 16), [BLOCK_M, BLOCK_N])
    if TRANS:
        bits = tl.trans(bits)
    return bits >= tl.cast(drop.dropout_p * 65536.0 + 0.5, tl.uint32)


@triton.jit
def query_block_program(batch, nheads, max_seqlen_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """(start_m, off_bh) of this program in a 1-D grid over query blocks x batch*heads.

    Non-causal: the query blocks of one head run together, sharing its K/V in L2. Causal, heaviest
    (last) blocks first: with more than 8 query blocks per head, those of all heads first (the
    grid's tail is short); with up to 8, head by head (the blocks of a head read its K/V together).
    Interleaved A/B on the H200 (bench/results/provenance-nvidia-h200.md): head by head ran 4-11%
    faster at 512 and 1k tokens, all heads first 3-10% faster from 4k (and 5% at 2k, headdim 256)."""
    num_m_blocks = tl.cdiv(max_seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    off_bh = pid // num_m_blocks
    if CAUSAL:
        if num_m_blocks > 8:
            num_bh = batch * nheads
            pid_m = pid // num_bh
            off_bh = pid % num_bh
        pid_m = num_m_blocks - 1 - pid_m
    return pid_m * BLOCK_M, off_bh


@triton.jit
def query_program(
    shape,
    CuSeqlensQ,
    CuSeqlensK,
    SeqOrder,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Where a program of the query-block grid works: (start_m, off_bh, off_b, off_h, off_hk,
    q_start, seqlen_q, k_start, seqlen_k); off_hk is the K/V head of query head off_h (GQA).
    shape: a constexprs.AttnShape. SORTED (varlen): grid slot s works on sequence SeqOrder[s], longest first,
    so that the heaviest programs start first and the grid's tail is short."""
    nheads = shape.nheads
    start_m, off_bh = query_block_program(shape.batch, nheads, shape.max_seqlen_q, CAUSAL, BLOCK_M)
    off_b = (off_bh // nheads).to(tl.int64)
    off_h = (off_bh % nheads).to(tl.int64)
    if SORTED:
        off_b = tl.load(SeqOrder + off_b).to(tl.int64)
        off_bh = off_b * nheads + off_h  # the sequence's own index: dropout's stream follows it
    q_start, seqlen_q = seq_bounds(CuSeqlensQ, off_b, shape.max_seqlen_q, IS_VARLEN)
    k_start, seqlen_k = seq_bounds(CuSeqlensK, off_b, shape.max_seqlen_k, IS_VARLEN)
    return start_m, off_bh, off_b, off_h, off_h // shape.group_size, q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def head_constants(Alibi, stride_alibi_b, off_b, off_h, Seed, ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """(ALiBi slope * log2(e) of this batch entry and head, the dropout seed); 0 when off."""
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(Alibi + off_b * stride_alibi_b + off_h) * LOG2E
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    return slope2, seed


@triton.jit
def sink_join(m_i, l_i, sink2):
    """A row's online softmax after its sink joins the denominator: (m, l, alpha) with m = max(m_i, sink2),
    l = l_i * alpha + exp2(sink2 - m) and alpha = exp2(m_i - m) the factor of the accumulator (sink2: the sink's
    logit in base 2). The sink has no value row. A row that saw no key (m_i -inf, l_i 0, accumulator 0) gets
    m = sink2, l = 1, alpha = 0: output 0 and logsumexp the sink's logit; l >= 1 always."""
    m = tl.maximum(m_i, sink2)
    alpha = tl.math.exp2(m_i - m)
    return m, l_i * alpha + tl.math.exp2(sink2 - m), alpha
