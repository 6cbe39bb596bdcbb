"""Constants and small helpers shared by the attention kernels (Triton only, no torch)."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in base 2 so exp2 can be used
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts a base-2 logsumexp back to natural log


@triton.jit
def make_desc_or_ptr(base, seqlen, stride_s, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """A (seqlen, HEAD_DIM) matrix of one (batch, head): a TMA descriptor, or the base pointer itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        return base


@triton.jit
def load_rows(src, start, seqlen, stride_s, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of a (seqlen, HEAD_DIM) matrix; zeros past either edge."""
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
def store_rows(dst, x, start, seqlen, stride_s, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a [BLOCK_ROWS, BLOCK_D] tile at rows [start, ...) of a (seqlen, HEAD_DIM) matrix, clipped."""
    if USE_TMA:
        dst.store([start, 0], x)
    else:
        rows = start + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = dst + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
        tl.store(ptrs, x, mask=(rows[:, None] < seqlen) & (cols[None, :] < HEAD_DIM))


@triton.jit
def load_vec(ptr, start, seqlen, BLOCK: tl.constexpr, other):
    """Elements [start, start + BLOCK) of a per-row fp32 vector, `other` past its end."""
    offs = start + tl.arange(0, BLOCK)
    return tl.load(ptr + offs, mask=offs < seqlen, other=other)


@triton.jit
def causal_mask(offs_m, offs_n, diag_offset, seqlen_k):
    """[BLOCK_M, BLOCK_N] True where query offs_m may see key offs_n (bottom-right causal, in range)."""
    return (offs_n[None, :] <= offs_m[:, None] + diag_offset) & (offs_n[None, :] < seqlen_k)


@triton.jit
def key_block_range(start_m, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """For query rows [start_m, start_m + BLOCK_M): (n_full, n_end).

    Key blocks starting in [0, n_full) are visible to every row of the block and need no mask;
    blocks in [n_full, n_end) cross the causal diagonal or the end of the keys and are masked;
    blocks from n_end on are skipped. Causal alignment is bottom-right: row i sees keys
    j <= i + seqlen_k - seqlen_q.
    """
    n_end = seqlen_k
    n_full = seqlen_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        n_end = tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + diag, 0))
        n_full = tl.minimum(n_full, tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N)
        n_full = tl.minimum(n_full, n_end)
    return n_full, n_end


@triton.jit
def query_block_range(start_n, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """For key rows [start_n, start_n + BLOCK_N): (m_start, m_full).

    Query blocks in [m_start, m_full) see part of the key block (masked); blocks in
    [m_full, seqlen_q) see all of it; blocks before m_start see none of it and are skipped.
    """
    m_start = 0
    m_full = 0
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        m_start = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        m_full = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        m_full = tl.minimum(m_full, seqlen_q)
        m_start = tl.minimum(m_start, m_full)
    return m_start, m_full
