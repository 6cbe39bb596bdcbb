"""FlashAttention-2 forward for Hopper (sm_90a), written in Gluon (Triton's lower-level dialect).

Same arithmetic as kernels/fwd.py (online softmax in base 2, an unscaled fp32 accumulator divided
by the row sum once at the end, logsumexp stored), but scheduled by hand, which plain Triton 3.6
does not do: Triton waits for each wgmma right after issuing it, so the tensor cores idle while a
warpgroup computes its softmax. Here the QK^T of key block j and the PV of block j-1 are issued
together as asynchronous wgmmas; the softmax of block j runs while PV(j-1) is still on the tensor
cores (FlashAttention-3's intra-warpgroup pipelining). K and V arrive by TMA into STAGES-deep
shared-memory rings, one mbarrier per stage; a stage is refilled as soon as the wgmma that read it
has been waited for.

Two kernels: attn_fwd_ws_kernel, warp-specialized: a producer warp loads, two consumer warpgroups
compute one query block each (FlashAttention-3's arrangement); attn_fwd_persist_kernel (last), the
warp-specialized kernel made persistent. The plan takes the persistent kernel at headdim 64 and 128
and the warp-specialized one at headdim 256. Both run one consumer pipeline (_attn_tile: block 0's
QK^T, the steps _attn_step, the last PV) with one layout preamble (FwdConfig) and one softmax
(OnlineSoftmax: every per-score option goes there); they differ only in how a consumer waits for and
releases its key and value blocks (_WsLoads, _PersistLoads: the same four methods). The ring
bookkeeping (stage i % STAGES, phase (i // STAGES) & 1) is kernels/pipeline.py's Ring.

attn_fwd_persist_kernel: the same partitions and numerics as attn_fwd_ws_kernel, with
CONSUMERS (2 or 3) consumer warpgroups, and a grid of min(#SMs, #tiles) CTAs (a tile: batch entry,
head, CONSUMERS * BLOCK_M query rows), each
looping over tiles pid, pid + G, pid + 2G, ... (G CTAs), so a tile's prologue and epilogue overlap
its neighbours' work. SNAKE (meant for causal) reverses every other round, so a CTA that got a
round's heaviest tile gets the next round's lightest. Tile order: non-causal one head's query
blocks together (K/V reuse in L2), causal heaviest first over all heads, the causal tiles aligned
to the last query row (the parts a length leaves over lie before row 0, in the lightest tile). The ring holds units: a
tile of n key blocks (n = the largest block count of its parts) is units 0 .. n, unit j holding
K_j (j < n) and V_{j-1} (j > 0) -- what one inner step reads (QK_j^T, then P_{j-1} V_{j-1}) -- in
the K and V buffers of one stage, behind one ready barrier (expect-tx of both blocks) and one empty
barrier (one arrival per consumer, after the step's wgmmas), so a consumer waits once and releases
once per key block (each Gluon arrive comes after a warpgroup bar.sync; measured: 3 bar.syncs per
step -> 2; 1-6% faster from 1k keys, the short causal tiles with a third stage). The ring runs on
across tiles: ring unit g uses stage g % STAGES, phase (g // STAGES) & 1, and the producer and
every consumer advance g by n + 1 per tile. Every consumer waits for and releases every ring unit
of the tile, the units its part does not use (causal: the lighter parts; an empty part, past seqlen_q
or, causal, before row 0: all)
right after its epilogue (_skip_units). attn_fwd_ws_kernel's scheme, the partner arriving twice on
them, is wrong here: the consumer that skipped them would go on to its next tile and wait on ring
units more than STAGES ahead of the fill, where a parity wait passes two phases early.
(tools/fwd_ring_model.py models this protocol under random interleavings; tests/test_protocol_model.py
runs it.) Q has QBUF buffers per consumer (buffer (k % QBUF) * CONSUMERS + consumer for a CTA's
k-th tile), each with a q_ready (expect-tx, or a plain arrive for an empty part) and a q_empty barrier;
a tile's O leaves through its Q buffer by TMA store, and the buffer goes back once the store has
read it. QBUF 2: the store is not waited for at the tile's end; the buffer goes back after the next
tile's first QK^T is issued (the producer has loaded that tile's Q into the other buffer meanwhile),
so the store and the next Q load are off the critical path. QBUF 1: back right after the store; the
producer issues a tile's K_0 before it waits for the Q buffer (K_0's stage held an earlier tile's
block: no deadlock), so only the Q load's latency is exposed. Shared memory (2-byte types): Q
QBUF * CONSUMERS * BLOCK_M * D * 2 bytes, each ring STAGES * BLOCK_N * D * 2: d64 (3 consumers,
M 64, N 128, S 3, QBUF 2) 48 + 96 = 144 KB; d128 (2 consumers, M 64, N 128, S 2, QBUF 2) 64 + 128 =
192 KB of the 227 KB. Three consumers get 160 registers each (two: 240).
(Headdim 256 would fit only with QBUF 1, 192 KB; it measured 0.87-1.02x the warp-specialized
kernel and has no table entry.)

Dense inputs only: descriptors built on the host over (batch, seqlen, heads * headdim) with a
[1, rows, headdim] box, so TMA zero-fills rows past a sequence's end and clips the output's.
Head dims: q/k and v equal (64, 128, 256), or DeepSeek-V3's 192/128. Gluon's tiles are powers of two, so q's
and k's 192 columns are two parts (128 + 64: kernels/pipeline.py's head_dim_parts), each a buffer, a descriptor
(Q and QLo, K and KLo) and a TMA load of its own, and S = Q K^T two chained wgmmas; V, O and the PV product are
v's 128 columns, and O leaves through Q's first part's buffer. (At 192/128, d128's tile with one Q buffer per
consumer fits: Q 48 KB + K 96 + V 64 = 208 KB.)
No softcap, ALiBi, window or dropout (the plan, ops/planning.py, sends those to kernels/fwd.py). Causal is
bottom-right aligned (row i sees keys j <= i + seqlen_k - seqlen_q); a query block that sees no key
gets output 0 and logsumexp +inf, as in kernels/fwd.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .pipeline import (
    Ring,
    Scalar,
    aggregate,
    alloc_parts,
    head_dim_parts,
    load_parts,
    part_descs,
    parts_nbytes,
    reinterpret,
    ring_phase,
    thread_barrier,
    tma_load,
    tma_store,
    unwrap,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _acc_layout(cols, num_warps):
    """wgmma accumulator layout of a [rows, cols] tile whose warps each own 16 rows (S: cols =
    BLOCK_N, O: cols = HEAD_DIM)."""
    cols, num_warps = unwrap(cols), unwrap(num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@aggregate
class FwdConfig:
    """A consumer warpgroup's tile shape and layouts (the one layout preamble): S = Q K^T [BLOCK_M, BLOCK_N] and
    O [BLOCK_M, HEAD_DIM_V] wgmma accumulators, each warp 16 rows; P as the register A operand of PV; the row
    vectors of S and O; the NVMMA shared layouts of a Q tile, a K block and a V block viewed 2-D. HEAD_DIM is q's
    and k's head dim, HEAD_DIM_V v's and O's. A head dim that is not a power of two (DeepSeek-V3's 192: Gluon's
    tiles are powers of two) is two column parts, HEAD_DIM_HI (the largest power of two below it) and
    HEAD_DIM_LO (the rest, a power of two), each a tile and a TMA load of its own, S their two chained wgmmas;
    HEAD_DIM_LO is 0 otherwise. O leaves through the Q tile's buffer (the first part's): HEAD_DIM_V is
    HEAD_DIM_HI."""

    CAUSAL: gl.constexpr
    HEAD_DIM: gl.constexpr
    HEAD_DIM_HI: gl.constexpr
    HEAD_DIM_LO: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    s_layout: gl.constexpr
    o_layout: gl.constexpr
    p_layout: gl.constexpr
    row_s: gl.constexpr
    row_o: gl.constexpr
    q_tile: gl.constexpr
    k_tile: gl.constexpr
    q_lo_tile: gl.constexpr
    k_lo_tile: gl.constexpr
    v_tile: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, dtype, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, num_warps):
        dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, num_warps = map(
            unwrap, (dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, num_warps)
        )
        self.CAUSAL = gl.constexpr(unwrap(CAUSAL))
        hi, lo = head_dim_parts(HEAD_DIM)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.HEAD_DIM_HI = gl.constexpr(hi)
        self.HEAD_DIM_LO = gl.constexpr(lo)
        self.HEAD_DIM_V = gl.constexpr(HEAD_DIM_V)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        s_layout = _acc_layout(BLOCK_N, num_warps)
        o_layout = _acc_layout(HEAD_DIM_V, num_warps)
        self.s_layout = gl.constexpr(s_layout)
        self.o_layout = gl.constexpr(o_layout)
        self.p_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        self.row_s = gl.constexpr(gl.SliceLayout(1, s_layout))
        self.row_o = gl.constexpr(gl.SliceLayout(1, o_layout))
        self.q_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_M, hi], dtype))
        self.k_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, hi], dtype))
        lo = max(lo, 16)  # (no second part: unused)
        self.q_lo_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_M, lo], dtype))
        self.k_lo_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, lo], dtype))
        self.v_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM_V], dtype))

    @gluon.jit
    def q_view(self, smem, buf):
        """Buffer `buf` of Q ([.., 1, BLOCK_M, HEAD_DIM_HI], and the second part's [.., 1, BLOCK_M, HEAD_DIM_LO])
        as 2-D wgmma operands: (first part, second part; the first again without one)."""
        hi = reinterpret(smem[0].index(buf), smem[0].dtype, [self.BLOCK_M, self.HEAD_DIM_HI], self.q_tile)
        lo = hi
        if self.HEAD_DIM_LO > 0:
            lo = reinterpret(smem[1].index(buf), smem[1].dtype, [self.BLOCK_M, self.HEAD_DIM_LO], self.q_lo_tile)
        return hi, lo

    @gluon.jit
    def k_view(self, smem, stage):
        """Stage `stage` of a K ring (its parts as q_view's) as 2-D wgmma operands."""
        hi = reinterpret(smem[0].index(stage), smem[0].dtype, [self.BLOCK_N, self.HEAD_DIM_HI], self.k_tile)
        lo = hi
        if self.HEAD_DIM_LO > 0:
            lo = reinterpret(smem[1].index(stage), smem[1].dtype, [self.BLOCK_N, self.HEAD_DIM_LO], self.k_lo_tile)
        return hi, lo

    @gluon.jit
    def issue_qk(self, q, k, s_zero):
        """S = Q K^T as asynchronous wgmmas (one per head-dim part, chained): the token to wait for."""
        s_tok = warpgroup_mma(q[0], k[0].permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if self.HEAD_DIM_LO > 0:
            s_tok = warpgroup_mma(q[1], k[1].permute((1, 0)), s_tok, is_async=True)
        return s_tok

    @gluon.jit
    def v_view(self, smem, stage):
        """Stage `stage` of a V ring ([STAGES, 1, BLOCK_N, HEAD_DIM_V]) as a 2-D wgmma operand."""
        return reinterpret(smem.index(stage), smem.dtype, [self.BLOCK_N, self.HEAD_DIM_V], self.v_tile)


@gluon.jit
def _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key blocks of the query tile starting at row start_m: (n_blocks, mask_from); blocks
    [0, n_blocks), those from mask_from on cross the causal diagonal or the keys' end. A tile that
    sees no key (causal, seqlen_q > seqlen_k) still gets one block, all masked; a tile past
    seqlen_q (the second tile of the warp-specialized kernel's last program) or before row 0 (the
    persistent kernel's first causal tile, _tile_coords) gets none."""
    diag = seqlen_k - seqlen_q
    n_end = seqlen_k
    mask_from = seqlen_k // BLOCK_N
    if CAUSAL:
        n_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag), 1)
        mask_from = gl.minimum(mask_from, gl.maximum(start_m + diag + 1, 0) // BLOCK_N)
    n_blocks = (n_end + BLOCK_N - 1) // BLOCK_N
    if (start_m >= seqlen_q) | (start_m < 0):
        n_blocks = 0
    return n_blocks, mask_from


@gluon.jit
def _sink2(Sinks, off_h, SINK: gl.constexpr):
    """The head's learnable sink logit in base 2 (OnlineSoftmax.sink2), or 0 without one."""
    if SINK:
        return gl.load(Sinks + off_h) * LOG2E
    else:
        return 0.0


@gluon.jit
def _qk_scale(sm_scale):
    """The scores' scale in base 2, at least 1e-30: softmax_scale 0 (allowed, >= 0 is checked) would
    make a masked score's -inf * 0 a NaN in the softmax's folded FMA; at 1e-30 every exp2 still rounds
    to 1 in fp32 and the logsumexp moves by under 1e-24, i.e. softmax_scale 0's results."""
    return gl.maximum(sm_scale * LOG2E, 1e-30)


@aggregate
class OnlineSoftmax:
    """The score arithmetic of one consumer's query tile (rows start_m ..): the online-softmax step on each block of
    raw scores, and the logsumexp at the end. A per-score option (a score modification, an extra logit in the
    denominator such as an attention sink) is a field here and a line in step / finish; the pipeline does not
    change."""

    qk_scale: gl.tensor  # > 0: _qk_scale
    start_m: Scalar
    seqlen_k: Scalar
    diag: Scalar  # seqlen_k - seqlen_q: row i sees keys j <= i + diag (causal, bottom-right aligned)
    sink2: Scalar  # SINK: the head's learnable sink logit in base 2 (in every row's denominator, no value row)
    SINK: gl.constexpr
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, qk_scale, start_m, seqlen_k, diag, sink2, SINK, cfg):
        self.qk_scale = qk_scale
        self.start_m = gl.constexpr(start_m) if isinstance(start_m, int) else start_m
        self.seqlen_k = gl.constexpr(seqlen_k) if isinstance(seqlen_k, int) else seqlen_k
        self.diag = gl.constexpr(diag) if isinstance(diag, int) else diag
        self.sink2 = gl.constexpr(sink2) if isinstance(sink2, (int, float)) else sink2
        self.SINK = gl.constexpr(unwrap(SINK))
        self.cfg = cfg

    @gluon.jit
    def step(self, s, m_i, l_i, start_n, masked):
        """One online-softmax step on the raw scores s of the key block at start_n: (p, alpha, m, l). In both
        paths the scale is folded into one FMA and the max taken before scaling. `masked` (constexpr, or a runtime
        flag for block 0): the block crosses the causal diagonal or the end of the keys; its invisible scores
        become -inf (one compare of the column against a per-row limit and one select per score) and a row that
        has seen no key yet keeps m = -inf, shifted by 0 so that exp2 gives 0, not NaN."""
        qk_scale = self.qk_scale
        s_layout: gl.constexpr = self.cfg.s_layout
        if masked:
            cols = gl.arange(0, self.cfg.BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if self.cfg.CAUSAL:  # the last visible column of each row, relative to the block
                rows = self.start_m + gl.arange(0, self.cfg.BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                last = gl.minimum(rows + self.diag, self.seqlen_k - 1) - start_n
                visible = cols[None, :] <= last[:, None]
            else:
                visible = cols[None, :] < self.seqlen_k - start_n
            s = gl.where(visible, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # -inf * qk_scale = -inf: qk_scale > 0
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_shift[:, None])
            alpha = gl.exp2(m_i - m_shift)
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def finish(self, m_i, l_i):
        """The logsumexp (natural log) and the factor of O's accumulator: (lse, 1 / l). A row that saw no key:
        logsumexp +inf and factor 1, so O = 0 (flash-attn 2's convention). SINK: the sink joins the denominator
        here, once (m = max(m_i, sink2), l = l_i * alpha + exp2(sink2 - m), factor alpha / l with
        alpha = exp2(m_i - m)); a row that saw no key then has O = 0 and logsumexp the sink's logit, as
        kernels/common.py's sink_join."""
        if self.SINK:
            m = gl.maximum(m_i, self.sink2)
            alpha = gl.exp2(m_i - m)
            l_all = l_i * alpha + gl.exp2(self.sink2 - m)
            return (m + gl.log2(l_all)) * LN2, alpha / l_all
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
        return lse, 1.0 / l_safe


@gluon.jit
def _epilogue(acc, m_i, l_i, sm, Out, Lse, lse_row0, off_b, o_col, seqlen_q, q_op, q_buf, WAIT: gl.constexpr):
    """The logsumexp and O = acc / l (OnlineSoftmax.finish), through the Q tile's (first part's) buffer, q_op its
    2-D view (every wgmma that read Q has been waited for), and a TMA store that clips rows past seqlen_q, waited
    for if WAIT (the persistent kernel hands the buffer back later)."""
    cfg = sm.cfg
    gl.static_assert(cfg.HEAD_DIM_V == cfg.HEAD_DIM_HI, "O leaves through Q's buffer: v's head dim q's first part's")
    lse, scale = sm.finish(m_i, l_i)
    offs_m = sm.start_m + gl.arange(0, cfg.BLOCK_M, layout=cfg.row_s)
    gl.store(Lse + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
    o = acc * gl.convert_layout(scale, cfg.row_o)[:, None]
    q_op.store(o.to(q_op.dtype))
    fence_async_shared()
    tma_store(Out, [off_b, sm.start_m, o_col], q_buf)
    if WAIT:
        tma.store_wait(pendings=0)


# ---------------------------------------------------------------------------------------------
# The consumer pipeline, shared by both kernels. A consumer warpgroup owns one BLOCK_M-row query
# tile: S_0 = Q K_0^T, waited, its softmax; then for each key block j >= 1 S_j = Q K_j^T and
# O += P_{j-1} V_{j-1} issued together as async wgmmas, the softmax of S_j overlapping PV(j-1)
# (the blocks that need no mask first, then those that do: no branch in the hot loop); then the
# last PV. `loads` (_WsLoads, _PersistLoads) says where K_j and V_{j-1} are and when their buffers
# go back, with four methods, and first_issued(), a hook run once block 0's QK^T is issued:
#   k_wait(j) -> K_j's view, once it landed;   v_wait(j, AFTER_K) -> V_{j-1}'s view, once it landed;
#   k_done(j, ALONE): S_j was waited for;      v_done(j): PV_{j-1} was waited for.
# ALONE: block 0's K (no PV alongside); AFTER_K: V_{j-1} was waited for with K_j (one ring unit).
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _attn_step(acc, p_op, m_i, l_i, q_op, s_zero, loads, sm, j, MASKED: gl.constexpr):
    """Key block j >= 1: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; wait for S_j only and run its softmax while
    PV is on the tensor cores; then wait for PV and rescale O to the new row max. Returns (acc, P_j as the next
    PV's operand, m, l)."""
    s_tok = sm.cfg.issue_qk(q_op, loads.k_wait(j), s_zero)
    v_op = loads.v_wait(j, True)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)  # acc is in the scale of m_{j-1}
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_j done; PV_{j-1} may still run
    loads.k_done(j, False)
    p, alpha, m_i, l_i = sm.step(s, m_i, l_i, j * sm.cfg.BLOCK_N, MASKED)
    p_next = gl.convert_layout(p.to(q_op[0].dtype), sm.cfg.p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    loads.v_done(j)
    acc = acc * gl.convert_layout(alpha, sm.cfg.row_o)[:, None]
    return acc, p_next, m_i, l_i


@gluon.jit
def _attn_tile(q_op, loads, sm, n_blocks, mask_from):
    """One consumer warpgroup's query tile (q_op: FwdConfig.q_view's pair) against key blocks 0 .. n_blocks - 1
    (n_blocks >= 1; blocks from mask_from on masked), its Q waited for: (acc, m, l), every wgmma waited for."""
    cfg = sm.cfg
    s_zero = gl.zeros([cfg.BLOCK_M, cfg.BLOCK_N], gl.float32, cfg.s_layout)
    acc = gl.zeros([cfg.BLOCK_M, cfg.HEAD_DIM_V], gl.float32, cfg.o_layout)
    m_i = gl.full([cfg.BLOCK_M], float("-inf"), gl.float32, cfg.row_s)
    l_i = gl.zeros([cfg.BLOCK_M], gl.float32, cfg.row_s)

    # block 0: S = Q K_0^T, waited; its softmax
    s_tok = cfg.issue_qk(q_op, loads.k_wait(0), s_zero)
    loads.first_issued()
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    loads.k_done(0, True)
    p, alpha, m_i, l_i = sm.step(s, m_i, l_i, 0, mask_from == 0)
    p_op = gl.convert_layout(p.to(q_op[0].dtype), cfg.p_layout)

    for j in range(1, gl.maximum(mask_from, 1)):
        acc, p_op, m_i, l_i = _attn_step(acc, p_op, m_i, l_i, q_op, s_zero, loads, sm, j, False)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        acc, p_op, m_i, l_i = _attn_step(acc, p_op, m_i, l_i, q_op, s_zero, loads, sm, j, True)

    # the last block's PV
    v_op = loads.v_wait(n_blocks, False)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    loads.v_done(n_blocks)
    return acc, m_i, l_i


# ---------------------------------------------------------------------------------------------
# The warp-specialized forward (FlashAttention-3's producer/consumer split). One program covers
# 2 * BLOCK_M query rows with three partitions:
#   * two consumer warpgroups (the default partition and worker 0), each owning one BLOCK_M-row
#     query tile and running the consumer pipeline (_attn_tile);
#   * one producer warp (worker 1, few registers): TMA of both Q tiles, then K_0, K_1, V_0, K_2,
#     V_1, ... into STAGES-deep K and V rings (pipeline.Ring: a "ready" mbarrier per stage, the
#     producer's expect-tx, and an "empty" one counting one arrival per consumer, made after the
#     wgmma that read the stage was waited for; block j is ring position j).
# The tiles may need different numbers of key blocks (causal: tile 0 sees fewer keys; a tile past
# seqlen_q needs none): the consumer with more arrives twice (for itself and its partner) on the
# blocks its partner does not use, so every phase of an empty barrier gets its two arrivals.
# (A ping-pong of the consumers' GEMM issues through two "turn" mbarriers measured slower at both
# head dims and was removed.)
# Registers: the producer is given 24 per thread, each consumer 240 (setmaxnreg).
# ---------------------------------------------------------------------------------------------
NUM_CONSUMERS = gl.constexpr(2)
_CONSUMER0 = gl.constexpr(0)  # partition ids as constexpr globals (a literal in a tuple is not one)
_CONSUMER1 = gl.constexpr(1)
_CONSUMER2 = gl.constexpr(2)
_CONSUMER_REGS = gl.constexpr(240)
# the persistent kernel with three consumer warpgroups: 3 * 128 * 160 + 24 * 128 <= 64K registers
_CONSUMER3_REGS = gl.constexpr(160)
_PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _program_tile(batch, nheads, seqlen_q, CAUSAL: gl.constexpr, CTA_M: gl.constexpr):
    """The grid's order (kernels.common.query_block_program) on programs of CTA_M query rows:
    (batch entry, head, first row). Query blocks of one head together; causal heaviest first,
    those of all heads first when a head has more than 8."""
    num_m = (seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    pid_m = pid % num_m
    off_bh = pid // num_m
    if CAUSAL:
        if num_m > 8:
            pid_m = pid // (batch * nheads)
            off_bh = pid % (batch * nheads)
        pid_m = num_m - 1 - pid_m
    return off_bh // nheads, off_bh % nheads, pid_m * CTA_M


@aggregate
class _WsLoads:
    """attn_fwd_ws_kernel's consumer side of the loads: K and V in rings of their own, block j at position j; each
    release also arrives for the partner when the partner's tile has no block there (blk >= n_other)."""

    k_smem: gl.tuple  # alloc_parts' pair
    v_smem: gl.shared_memory_descriptor
    k_ring: Ring
    v_ring: Ring
    n_other: Scalar
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, k_ring, v_ring, n_other, cfg):
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.k_ring = k_ring
        self.v_ring = v_ring
        self.n_other = gl.constexpr(n_other) if isinstance(n_other, int) else n_other
        self.cfg = cfg

    @gluon.jit
    def _release(self, ring, blk):
        bar = ring.empty.index(ring.slot(blk))
        mbarrier.arrive(bar)
        mbarrier.arrive(bar, pred=blk >= self.n_other)

    @gluon.jit
    def k_wait(self, j):
        self.k_ring.wait_ready(j)
        return self.cfg.k_view(self.k_smem, self.k_ring.slot(j))

    @gluon.jit
    def v_wait(self, j, AFTER_K: gl.constexpr):
        self.v_ring.wait_ready(j - 1)
        return self.cfg.v_view(self.v_smem, self.v_ring.slot(j - 1))

    @gluon.jit
    def first_issued(self):
        pass

    @gluon.jit
    def k_done(self, j, ALONE: gl.constexpr):
        self._release(self.k_ring, j)

    @gluon.jit
    def v_done(self, j):
        self._release(self.v_ring, j - 1)


@gluon.jit
def _consumer(
    Out,
    Lse,
    Sinks,
    q_smem,
    k_smem,
    v_smem,
    q_bars,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    stride_lse_b,
    stride_lse_h,
    batch,
    nheads,
    seqlen_q,
    seqlen_k,
    sm_scale,
    ME: gl.constexpr,
    CAUSAL: gl.constexpr,
    SINK: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Consumer warpgroup ME (0: the default partition, 1: worker 0): query tile ME of the program."""
    cfg = FwdConfig(v_smem.dtype, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, gl.num_warps())  # 4 warps
    off_b, off_h, cta_m = _program_tile(batch, nheads, seqlen_q, CAUSAL, NUM_CONSUMERS * BLOCK_M)
    start_m = cta_m + ME * BLOCK_M
    n_blocks, mask_from = _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n_other, _ = _tile_blocks(cta_m + (1 - ME) * BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    lse_row0 = off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h
    if n_blocks > 0:
        o_col = off_h * HEAD_DIM_V
        sink2 = _sink2(Sinks, off_h, SINK)
        sm = OnlineSoftmax(_qk_scale(sm_scale), start_m, seqlen_k, seqlen_k - seqlen_q, sink2, SINK, cfg)
        loads = _WsLoads(k_smem, v_smem, Ring(k_ready, k_empty, STAGES), Ring(v_ready, v_empty, STAGES), n_other, cfg)
        q_op = cfg.q_view(q_smem, ME)
        mbarrier.wait(q_bars.index(ME), 0)
        acc, m_i, l_i = _attn_tile(q_op, loads, sm, n_blocks, mask_from)
        _epilogue(acc, m_i, l_i, sm, Out, Lse, lse_row0, off_b, o_col, seqlen_q, q_op[0], q_smem[0].index(ME), True)


@gluon.jit
def _produce(desc, ring, smem, blk, off_b, col, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Block blk of a ring: wait until both consumers released the stage's previous block, then TMA it (desc and
    smem: alloc_parts' pairs, HEAD_DIM the block's head dim)."""
    ring.wait_empty(blk)
    bar = ring.ready_bar(blk)
    mbarrier.expect(bar, parts_nbytes(desc, HEAD_DIM))
    load_parts(desc, off_b, blk * BLOCK_N, col, bar, smem, ring.slot(blk), True, HEAD_DIM)


@gluon.jit
def _producer(
    Q,
    K,
    V,
    q_smem,
    k_smem,
    v_smem,
    q_bars,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    batch,
    nheads,
    seqlen_q,
    seqlen_k,
    group_size,
    CAUSAL: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: both Q tiles, then K_0, K_1, V_0, K_2, V_1, ..., V_{n-1} (the consumers' order of
    use, n = the longer tile's block count)."""
    off_b, off_h, cta_m = _program_tile(batch, nheads, seqlen_q, CAUSAL, NUM_CONSUMERS * BLOCK_M)
    n0, _ = _tile_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n1, _ = _tile_blocks(cta_m + BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n_max = gl.maximum(n0, n1)
    q_col = off_h * HEAD_DIM
    k_col = (off_h // group_size) * HEAD_DIM
    v_col = (off_h // group_size) * HEAD_DIM_V
    k_ring = Ring(k_ready, k_empty, STAGES)
    v_ring = Ring(v_ready, v_empty, STAGES)
    for t in gl.static_range(NUM_CONSUMERS):
        bar = q_bars.index(t)
        valid = cta_m + t * BLOCK_M < seqlen_q
        mbarrier.expect(bar, parts_nbytes(Q, HEAD_DIM), pred=valid)
        load_parts(Q, off_b, cta_m + t * BLOCK_M, q_col, bar, q_smem, t, valid, HEAD_DIM)
    _produce(K, k_ring, k_smem, 0, off_b, k_col, BLOCK_N, HEAD_DIM)  # tile 0 is valid: n_max >= 1
    for j in range(1, n_max):
        _produce(K, k_ring, k_smem, j, off_b, k_col, BLOCK_N, HEAD_DIM)
        _produce((V, V), v_ring, (v_smem, v_smem), j - 1, off_b, v_col, BLOCK_N, HEAD_DIM_V)
    _produce((V, V), v_ring, (v_smem, v_smem), n_max - 1, off_b, v_col, BLOCK_N, HEAD_DIM_V)


@gluon.jit
def attn_fwd_ws_kernel(
    Q,
    K,
    V,
    Out,
    QLo,
    KLo,
    Lse,
    Sinks,
    stride_lse_b,
    stride_lse_h,
    batch,
    nheads,
    seqlen_q,
    seqlen_k,
    group_size,
    sm_scale,
    CAUSAL: gl.constexpr,
    SINK: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Grid: cdiv(seqlen_q, 2 * BLOCK_M) * batch * nheads programs; launched with num_warps=4 (the
    default partition; the compiler adds the workers' warps). QLo, KLo: descriptors of q's and k's second
    head-dim part (FwdConfig), None for a power of two."""
    dtype: gl.constexpr = V.dtype
    q_desc, k_desc = part_descs(Q, QLo, HEAD_DIM), part_descs(K, KLo, HEAD_DIM)
    q_smem = alloc_parts(q_desc, NUM_CONSUMERS, BLOCK_M, HEAD_DIM)
    k_smem = alloc_parts(k_desc, STAGES, BLOCK_N, HEAD_DIM)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM_V], V.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bars.index(t), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the barriers' initialisation, visible to TMA and to the partitions

    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    Out,
                    Lse,
                    Sinks,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bars,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    stride_lse_b,
                    stride_lse_h,
                    batch,
                    nheads,
                    seqlen_q,
                    seqlen_k,
                    sm_scale,
                    _CONSUMER0,
                    CAUSAL,
                    SINK,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
            (
                _consumer,
                (
                    Out,
                    Lse,
                    Sinks,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bars,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    stride_lse_b,
                    stride_lse_h,
                    batch,
                    nheads,
                    seqlen_q,
                    seqlen_k,
                    sm_scale,
                    _CONSUMER1,
                    CAUSAL,
                    SINK,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
            (
                _producer,
                (
                    q_desc,
                    k_desc,
                    V,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bars,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    batch,
                    nheads,
                    seqlen_q,
                    seqlen_k,
                    group_size,
                    CAUSAL,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                ),
            ),
        ],
        [4, 1],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------
# The persistent warp-specialized forward (see the module docstring): attn_fwd_ws_kernel's three
# partitions with CONSUMERS consumer warpgroups, but a grid of min(#SMs, #tiles) CTAs, each looping
# over tiles of CONSUMERS * BLOCK_M query rows. The K/V ring runs on across tiles on a unit counter
# g that the consumers and the producer advance alike (by n + 1 per tile, n the largest block count
# of the tile's parts: unit j holds K_j and V_{j-1}); Q has QBUF buffers per consumer, handed back
# through q_empty barriers once the O stored through them has left.
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _num_my_tiles(num_tiles, pid, nprog, SNAKE: gl.constexpr):
    """How many tiles CTA pid runs: the full rounds, plus one if its index in the last (partial)
    round exists."""
    full = num_tiles // nprog
    idx = pid
    if SNAKE:
        idx = pid + (full % 2) * (nprog - 1 - 2 * pid)
    return full + (idx < num_tiles - full * nprog).to(gl.int32)


@gluon.jit
def _tile_coords(
    it,
    pid,
    nprog,
    batch,
    nheads,
    num_m,
    seqlen_q,
    CAUSAL: gl.constexpr,
    SNAKE: gl.constexpr,
    CTA_M: gl.constexpr,
    BLOCK_M: gl.constexpr,
):
    """The it-th tile of CTA pid (tile it * nprog + pid; SNAKE: odd rounds reversed): (batch entry,
    head, first row). Non-causal: one head's tiles together (K/V reuse in L2); causal: heaviest
    first over all heads (_program_tile's order for more than 8 tiles per head), and the tiles
    aligned to the last row rather than the first (shifted up by the whole parts of the
    num_m * CTA_M - seqlen_q rows left over), so the parts left empty (before row 0) fall in the
    lightest tile, not the heaviest: at 512 rows in 192-row tiles the tiles' longest parts sum to
    15 key blocks (of 64) instead of 17."""
    idx = pid
    if SNAKE:
        idx = pid + (it % 2) * (nprog - 1 - 2 * pid)
    t = it * nprog + idx
    if CAUSAL:
        pid_m = num_m - 1 - t // (batch * nheads)
        off_bh = t % (batch * nheads)
        shift = (num_m * CTA_M - seqlen_q) // BLOCK_M * BLOCK_M
    else:
        pid_m = t % num_m
        off_bh = t // num_m
        shift = 0
    return off_bh // nheads, off_bh % nheads, pid_m * CTA_M - shift


@gluon.jit
def _tile_max_blocks(
    cta_m,
    seqlen_q,
    seqlen_k,
    CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """The largest block count of a tile's CONSUMERS parts (_tile_blocks of each): how far the ring
    moves per tile."""
    n_max, _ = _tile_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    for t in gl.static_range(1, CONSUMERS):
        n_t, _ = _tile_blocks(cta_m + t * BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        n_max = gl.maximum(n_max, n_t)
    return n_max


@gluon.jit
def _skip_units(ring, g, j0, j1):
    """Ring units g + j0 .. g + j1 - 1: the partners', not this consumer's (causal: a partner's part
    sees more keys; or this part is empty: past seqlen_q or before row 0). Wait until each is loaded, then give this
    consumer's arrival. Not a partner arriving twice instead (attn_fwd_ws_kernel's _WsLoads): this
    consumer would go on to its next tile and wait on ring units more than STAGES ahead of the fill,
    where a parity wait passes two phases early."""
    for j in range(j0, j1):
        ring.wait_ready(g + j)
        ring.release(g + j)


@gluon.jit
def _q_buffer(k, part, QBUF: gl.constexpr, CONSUMERS: gl.constexpr):
    """The Q buffer of part `part` of a CTA's k-th tile (its phase: ring_phase(k, QBUF))."""
    return (k % QBUF) * CONSUMERS + part


@gluon.jit
def _q_release(q_empty, idx, pred):
    """Hand Q buffer idx back to the producer once the TMA store of the O that went out through it
    has read it: the store was issued by one elected thread, so every thread waits for its own bulk
    groups, then a partition barrier, then thread 0 arrives."""
    tma.store_wait(pendings=0)
    thread_barrier()
    mbarrier.arrive(q_empty.index(idx), pred=pred)


@aggregate
class _PersistLoads:
    """attn_fwd_persist_kernel's consumer side of the loads for one tile: the tile's key block j and value block
    j - 1 are ring unit g + j (one stage of the K and V buffers behind one ready barrier), waited for once and
    released once per unit (one arrival per consumer, never for a partner: _skip_units). QBUF 2: the previous
    tile's Q buffer (prev_qi) goes back once this tile's first QK^T is issued."""

    k_smem: gl.tuple  # alloc_parts' pair
    v_smem: gl.shared_memory_descriptor
    ring: Ring
    g: gl.tensor
    q_empty: gl.shared_memory_descriptor
    prev_qi: gl.tensor
    has_prev: gl.tensor
    QBUF: gl.constexpr
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, ring, g, q_empty, prev_qi, has_prev, QBUF, cfg):
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.ring = ring
        self.g = g
        self.q_empty = q_empty
        self.prev_qi = prev_qi
        self.has_prev = has_prev
        self.QBUF = gl.constexpr(QBUF)
        self.cfg = cfg

    @gluon.jit
    def k_wait(self, j):
        u = self.g + j
        self.ring.wait_ready(u)
        return self.cfg.k_view(self.k_smem, self.ring.slot(u))

    @gluon.jit
    def v_wait(self, j, AFTER_K: gl.constexpr):
        u = self.g + j
        if not AFTER_K:  # the last unit: V_{n-1} alone (its K block, if any, is a partner's)
            self.ring.wait_ready(u)
        return self.cfg.v_view(self.v_smem, self.ring.slot(u))

    @gluon.jit
    def first_issued(self):
        # QBUF 2: waiting for the previous tile's O store costs nothing while S_0 runs
        if self.QBUF == 2:
            _q_release(self.q_empty, self.prev_qi, self.has_prev)

    @gluon.jit
    def k_done(self, j, ALONE: gl.constexpr):
        if ALONE:  # unit g: K_0 alone
            self.ring.release(self.g + j)

    @gluon.jit
    def v_done(self, j):
        self.ring.release(self.g + j)


@gluon.jit
def _persist_consumer(
    args,
    ME: gl.constexpr,
    CAUSAL: gl.constexpr,
    SINK: gl.constexpr,
    SNAKE: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    QBUF: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """Consumer warpgroup ME (0: the default partition, then workers 0 .. CONSUMERS - 2): part ME
    of each of this CTA's tiles. The k-th tile's Q is in buffer (k % QBUF) * CONSUMERS + ME, phase
    ring_phase(k, QBUF); the tile's K/V ring units g .. g + n_blocks, then the epilogue, whose O store
    is left in flight (QBUF 2: its buffer goes back during the next tile, or is waited for at the very end)."""
    (
        Out,
        Lse,
        Sinks,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        ready,
        empty,
        stride_lse_b,
        stride_lse_h,
        batch,
        nheads,
        seqlen_q,
        seqlen_k,
        sm_scale,
    ) = args
    cfg = FwdConfig(v_smem.dtype, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, gl.num_warps())  # 4 warps
    ring = Ring(ready, empty, STAGES)
    CTA_M: gl.constexpr = CONSUMERS * BLOCK_M
    num_m = (seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_my = _num_my_tiles(num_m * batch * nheads, pid, nprog, SNAKE)
    qk_scale = _qk_scale(sm_scale)
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = _tile_coords(
            it, pid, nprog, batch, nheads, num_m, seqlen_q, CAUSAL, SNAKE, CTA_M, BLOCK_M
        )
        start_m = cta_m + ME * BLOCK_M
        n_blocks, mask_from = _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        n_max = _tile_max_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N, CONSUMERS)
        qi = _q_buffer(it, ME, QBUF, CONSUMERS)
        prev_qi = _q_buffer(it + 1, ME, QBUF, CONSUMERS)  # QBUF 2: the previous tile's buffer
        mbarrier.wait(q_ready.index(qi), ring_phase(it, QBUF))
        if n_blocks > 0:
            lse_row0 = off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h
            o_col = off_h * HEAD_DIM_V
            loads = _PersistLoads(k_smem, v_smem, ring, g, q_empty, prev_qi, it > 0, QBUF, cfg)
            sm = OnlineSoftmax(qk_scale, start_m, seqlen_k, seqlen_k - seqlen_q, _sink2(Sinks, off_h, SINK), SINK, cfg)
            q_op = cfg.q_view(q_smem, qi)
            acc, m_i, l_i = _attn_tile(q_op, loads, sm, n_blocks, mask_from)
            # O through this tile's Q buffer, the store not waited for here
            _epilogue(
                acc, m_i, l_i, sm, Out, Lse, lse_row0, off_b, o_col, seqlen_q, q_op[0], q_smem[0].index(qi), False
            )
            if QBUF == 1:
                _q_release(q_empty, qi, True)
        else:  # this part lies past seqlen_q or before row 0: nothing to compute, nothing stored
            if QBUF == 2:
                _q_release(q_empty, prev_qi, it > 0)
            else:
                mbarrier.arrive(q_empty.index(qi))
        # after the epilogue: the units past this part's last (unit n_blocks, or none when it has no block)
        _skip_units(ring, g, n_blocks + (n_blocks > 0).to(gl.int32), n_max + 1)
        g += n_max + 1
    tma.store_wait(pendings=0)


@gluon.jit
def _persist_produce(
    K, V, ring, k_smem, v_smem, u, j, n_max, off_b, k_col, v_col, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr
):
    """Ring unit u, the tile's j-th (0 <= j <= n_max): K_j unless j == n_max, V_{j-1} unless j == 0.
    Wait until every consumer released the stage's previous unit (u - STAGES), then TMA both blocks
    onto the stage's one ready barrier (K, k_smem: alloc_parts' pairs)."""
    ring.wait_empty(u)
    stage = ring.slot(u)
    bar = ring.ready_bar(u)
    has_k = j < n_max
    has_v = j > 0
    both = (j > 0) & (j < n_max)
    one = (j == 0) | (j == n_max)  # n_max >= 1: never neither
    k_bytes: gl.constexpr = parts_nbytes(K, HEAD_DIM)
    if k_bytes == V.block_type.nbytes:
        mbarrier.expect(bar, 2 * k_bytes, pred=both)
        mbarrier.expect(bar, k_bytes, pred=one)
    else:  # a value head dim of its own
        mbarrier.expect(bar, k_bytes + V.block_type.nbytes, pred=both)
        mbarrier.expect(bar, k_bytes, pred=j == 0)
        mbarrier.expect(bar, V.block_type.nbytes, pred=j == n_max)
    load_parts(K, off_b, j * BLOCK_N, k_col, bar, k_smem, stage, has_k, HEAD_DIM)
    tma_load(V, [off_b, (j - 1) * BLOCK_N, v_col], bar, v_smem.index(stage), pred=has_v)


@gluon.jit
def _persist_producer(
    args,
    CAUSAL: gl.constexpr,
    SNAKE: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    QBUF: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """One warp, per tile: ring unit 0 (K_0), Q_0 .. Q_{CONSUMERS-1} (each once its buffer is free),
    then units 1 .. n: (K_1, V_0), (K_2, V_1), ..., (V_{n-1}) (n = the longest part's block count).
    args: the kernel's `producer` tuple (its runtime values; a tuple drops constexprs)."""
    (Q, K, V, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, batch, nheads, seqlen_q, seqlen_k, group_size) = (
        args
    )
    ring = Ring(ready, empty, STAGES)
    CTA_M: gl.constexpr = CONSUMERS * BLOCK_M
    num_m = (seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_my = _num_my_tiles(num_m * batch * nheads, pid, nprog, SNAKE)
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = _tile_coords(
            it, pid, nprog, batch, nheads, num_m, seqlen_q, CAUSAL, SNAKE, CTA_M, BLOCK_M
        )
        # >= 1: the tile's last part starts in [0, seqlen_q) (_tile_coords' shift leaves it there)
        n_max = _tile_max_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N, CONSUMERS)
        q_col = off_h * HEAD_DIM
        k_col = (off_h // group_size) * HEAD_DIM
        v_col = (off_h // group_size) * HEAD_DIM_V
        # K_0 first: its stage held a block of an earlier tile, so this wait never needs this tile's
        # Q (no deadlock), and with QBUF 1 only the Q load's latency is exposed per tile
        _persist_produce(K, V, ring, k_smem, v_smem, g, 0, n_max, off_b, k_col, v_col, BLOCK_N, HEAD_DIM)
        for t in gl.static_range(CONSUMERS):
            qi = _q_buffer(it, t, QBUF, CONSUMERS)
            mbarrier.wait(q_empty.index(qi), ring_phase(it, QBUF) ^ 1)
            bar = q_ready.index(qi)
            row = cta_m + t * BLOCK_M
            valid = (row >= 0) & (row < seqlen_q)
            mbarrier.expect(bar, parts_nbytes(Q, HEAD_DIM), pred=valid)
            load_parts(Q, off_b, row, q_col, bar, q_smem, qi, valid, HEAD_DIM)
            # an empty part: its consumer only waits and hands back
            mbarrier.arrive(bar, pred=(row < 0) | (row >= seqlen_q))
        for j in range(1, n_max + 1):
            _persist_produce(K, V, ring, k_smem, v_smem, g + j, j, n_max, off_b, k_col, v_col, BLOCK_N, HEAD_DIM)
        g += n_max + 1


# do_not_specialize: one compiled variant per configuration whatever the shapes
@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "batch", "nheads", "seqlen_q", "seqlen_k", "group_size"])
def attn_fwd_persist_kernel(
    Q,
    K,
    V,
    Out,
    QLo,
    KLo,
    Lse,
    Sinks,
    stride_lse_b,
    stride_lse_h,
    batch,
    nheads,
    seqlen_q,
    seqlen_k,
    group_size,
    sm_scale,
    CAUSAL: gl.constexpr,
    SINK: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    QBUF: gl.constexpr,
    SNAKE: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """Grid: min(#SMs, cdiv(seqlen_q, CONSUMERS * BLOCK_M) * batch * nheads) CTAs; launched with
    num_warps=4 (the default partition; the compiler adds the workers' warps). CONSUMERS 2 or 3
    consumer warpgroups (_CONSUMER_REGS registers each for 2, _CONSUMER3_REGS for 3), one producer warp. QLo,
    KLo: descriptors of q's and k's second head-dim part (FwdConfig), None for a power of two."""
    dtype: gl.constexpr = V.dtype
    NQ: gl.constexpr = QBUF * CONSUMERS
    q_desc, k_desc = part_descs(Q, QLo, HEAD_DIM), part_descs(K, KLo, HEAD_DIM)
    q_smem = alloc_parts(q_desc, NQ, BLOCK_M, HEAD_DIM)
    k_smem = alloc_parts(k_desc, STAGES, BLOCK_N, HEAD_DIM)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM_V], V.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
    # one ready and one empty barrier per ring stage, for the stage's K and V buffers together
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NQ):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    fence_async_shared()  # the barriers' initialisation, visible to TMA and to the partitions

    # the partitions' runtime arguments, one tuple each (a tuple drops constexprs, which go apart)
    consumer = (
        Out,
        Lse,
        Sinks,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        ready,
        empty,
        stride_lse_b,
        stride_lse_h,
        batch,
        nheads,
        seqlen_q,
        seqlen_k,
        sm_scale,
    )
    producer = (
        q_desc,
        k_desc,
        V,
        q_smem,
        k_smem,
        v_smem,
        q_ready,
        q_empty,
        ready,
        empty,
        batch,
        nheads,
        seqlen_q,
        seqlen_k,
        group_size,
    )
    # (a list per count: a Gluon kernel cannot build one from CONSUMERS, nor hold a function in a tuple)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (
                    _persist_consumer,
                    (
                        consumer,
                        _CONSUMER0,
                        CAUSAL,
                        SINK,
                        SNAKE,
                        HEAD_DIM,
                        HEAD_DIM_V,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        QBUF,
                        CONSUMERS,
                    ),
                ),
                (
                    _persist_consumer,
                    (
                        consumer,
                        _CONSUMER1,
                        CAUSAL,
                        SINK,
                        SNAKE,
                        HEAD_DIM,
                        HEAD_DIM_V,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        QBUF,
                        CONSUMERS,
                    ),
                ),
                (
                    _persist_producer,
                    (producer, CAUSAL, SNAKE, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, QBUF, CONSUMERS),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )
    else:
        gl.static_assert(CONSUMERS == 3, "the persistent forward has 2 or 3 consumer warpgroups")
        gl.warp_specialize(
            [
                (
                    _persist_consumer,
                    (
                        consumer,
                        _CONSUMER0,
                        CAUSAL,
                        SINK,
                        SNAKE,
                        HEAD_DIM,
                        HEAD_DIM_V,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        QBUF,
                        CONSUMERS,
                    ),
                ),
                (
                    _persist_consumer,
                    (
                        consumer,
                        _CONSUMER1,
                        CAUSAL,
                        SINK,
                        SNAKE,
                        HEAD_DIM,
                        HEAD_DIM_V,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        QBUF,
                        CONSUMERS,
                    ),
                ),
                (
                    _persist_consumer,
                    (
                        consumer,
                        _CONSUMER2,
                        CAUSAL,
                        SINK,
                        SNAKE,
                        HEAD_DIM,
                        HEAD_DIM_V,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        QBUF,
                        CONSUMERS,
                    ),
                ),
                (
                    _persist_producer,
                    (producer, CAUSAL, SNAKE, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, QBUF, CONSUMERS),
                ),
            ],
            [4, 4, 1],
            [_CONSUMER3_REGS, _CONSUMER3_REGS, _PRODUCER_REGS],
        )
