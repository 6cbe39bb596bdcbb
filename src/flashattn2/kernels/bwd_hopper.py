"""FlashAttention-2 backward for Hopper (sm_90a), written in Gluon: 5 matmuls per block pair,
warp-specialized (FlashAttention-3's arrangement).

One program = one key block (BLOCK_N rows) of one (batch, kv head); it loops over the query heads
of its group and, for each, over the query blocks (BLOCK_M rows) that see the key block (S and dP
not transposed, P and dS through shared memory):
    S    = Q K^T          [BLOCK_M, BLOCK_N]   A = Q (smem),  B = K^T (permuted smem view)
    dP   = dO V^T         [BLOCK_M, BLOCK_N]   A = dO (smem), B = V^T (permuted smem view)
    P    = exp2(S * scale * log2e - lse * log2e);  dS = P * (dP * scale - delta * scale)
    dV  += P^T dO         [BLOCK_N, D]         A = P^T (permuted view of P in smem), B = dO
    dQ_i = dS K           [BLOCK_M, D]         A = dS (smem), B = K (smem)
    dK  += dS^T Q         [BLOCK_N, D]         A = dS^T (permuted view of dS in smem), B = Q
dQ_i is added by TMA bulk reduce-add (Gluon 3.6 has the builder call only, wrapped below as
`tma_reduce_add`) into an fp32 accumulator (batch, seqlen_q_pad, nheads, headdim), which the delta
preprocess zeroes and the host casts into dq afterwards. The adds arrive in any order:
The plan (ops/planning.py) takes this kernel for deterministic=False only (flash_attn's default). The softmax
scale is folded into dS, so dK and dQ need no scaling.

The program is split with gl.warp_specialize into three partitions:
  * the default partition, 8 warps (two MMA warpgroups, setmaxnreg 240), the matmuls. With
    BLOCK_M = 64 (headdim 128, 256) S / dP are split along the keys (each warpgroup: all query
    rows, half of the keys) and dQ_i along headdim; with BLOCK_M = 128 (headdim 64) the
    warpgroups split S, dP and dQ_i along the query rows (_mma_layout); dK / dV are split along the
    keys. Each warpgroup needs the other's half of P and dS, so that hand-off is a partition-wide
    barrier (`bar.sync 0, 256` inside a partition: the 256 MMA threads only). Per flat position:
    wait Q, issue S; wait dO, issue dP; wait S -> P (causal mask on crossing blocks) -> smem while
    dP runs; issue dV; wait dP -> dS -> smem while dV runs; issue dQ_i, issue dK; wait dV, dQ_i ->
    dQ_i into a staging tile the writer has finished reading, hand it over (dq_full) while dK
    runs; wait dK -> release the Q / dO stage (q_empty).
  * worker 0, 1 warp (24 registers): the producer. K and V once (kv_bar), then Q and dO of every
    flat position t into ring stage t % STAGES once the MMA warps released its previous use
    (q_empty, phase t // STAGES - 1; a fresh barrier passes a wait on parity 1, so the first
    STAGES positions go at once). Q and dO have a ready barrier each: S starts before dO lands.
  * worker 1, 1 warp (24 registers): the dQ writer. For each t: wait dq_full, TMA reduce-add of the
    staging tile into the accumulator, tma.store_wait(0) (the bulk group has *read* the tile),
    arrive dq_empty. The MMA warps never wait on a reduce; the writer's last wait keeps the CTA
    alive until the reads end.
Barriers count one arrival: ready barriers the producer's expect-tx; q_empty and dq_full the MMA
partition's mbarrier.arrive, which a multi-warp partition lowers to `bar.sync 0, 256` + one
thread's arrive (one arrival stands for all 256 threads' wgmma waits and smem stores before it);
dq_empty the writer's. Every partition walks the same flat positions (_ws_program, _ws_advance):
position t uses Q / dO stage t % STAGES with phase (t // STAGES) & 1 and dQ tile t % DQ_STAGES (kernels/pipeline.py's
Ring: the Q ring (q_ready, q_empty), the dO ring (do_ready with do_empty, or q_empty without SPLIT_RING), the dQ
staging ring (dq_full as its ready, dq_empty)). The MMA partition's step (_ws_step) takes its layouts as one
BwdConfig, its buffers and rings as one BwdBuffers and the score arithmetic's inputs as one BwdScores.
Registers: 8 + 1 + 1 warps are padded to 12 (384 threads, .maxnreg 168); setmaxnreg gives the
workers 24 and the MMA warps (65536 - 128 * 24) / 256 -> 240 (headdim 128 causal + GQA spills 40
bytes). The causal mask is a per-row limit with no branch (past the block when it does not cross
the diagonal): a runtime `if masked` spills more at 240 registers.
Shared memory (2-byte dtype): K, V + STAGES x (Q + dO) + P + dS + DQ_STAGES x the fp32 dQ tile.
Headdim 128, BLOCK_M 64, BLOCK_N 128, STAGES 2, DQ_STAGES 2: 229,740 bytes of 232,448.
Tails: Q, dO, K, V rows past a sequence's end are zero-filled by TMA; the preprocess pads lse (+inf) and
delta (0) up to seqlen_q_pad = cdiv(seqlen_q, BLOCK_M) * BLOCK_M, so padded query rows get
P = dS = 0 with no mask in the loop (masks there cost spills); keys past seqlen_k add nothing to
dQ (K = 0 there, dP = 0) and their dK/dV rows are clipped by the stores, as long as P stays finite
(the exponent is capped at 0, see _ws_step). K and V's buffers take dK and dV at the end (TMA
stores). GQA / MQA: one flat loop over (query head, query block) whose ring runs on across heads;
dK/dV accumulate over the group in registers. Causal is bottom-right aligned.

Head dims: q/k and v equal (64, 128, 256), or DeepSeek-V3's 192/128: q's and k's 192 columns are two parts (128 +
64: kernels/pipeline.py's head_dim_parts; Gluon's tiles are powers of two), each a buffer and a descriptor of Q, K,
dK and the dQ accumulator (QLo, KLo, DKLo, DQLo: the second part's); S is two chained wgmmas, dK two accumulators,
and dQ_i is computed and staged in those two parts (DQ_SPLIT 2, as at headdim 256: the second part in the first
part's staging tile). dO, V, dV and dP = dO V^T are v's 128 columns; the fp32 accumulator (q's head dim) is zeroed
by the preprocess (ACC_DIM).

The split-ring variant (SPLIT_RING, DQ_SPLIT: the headdim-256 row of ops/planning.py): dO has
a ring of its own (DO_STAGES deep, ready barriers do_ready, released by do_empty) that the MMA warps
release as soon as dV (dO's last reader) is waited, so the next dO loads while dQ_i and dK run; Q
keeps its STAGES-deep ring, released after dK. DQ_SPLIT 2 computes dQ_i as two column halves
(B = K's halves, slices of its buffer): the first issued before dK and staged while dK runs, the
second after it, each through a [BLOCK_M, HEAD_DIM / 2] staging tile (the writer's tile u = 2t +
half, at column half * HEAD_DIM / 2). At headdim 256 this frees the shared memory for a second Q
stage: K, V 32 KB each, Q 2 x 32, dO 32, P, dS 8 each, one half dQ tile 32 KB = 213,388 bytes,
where the shipped kernel's one Q/dO stage waits for each position's loads. With one staging tile a
half can be staged only once the bulk engine has read the previous one (32 KB, which took about as
long as the MMA warps' work between two stagings: in ncu, H200, 4k keys, the wait for it before the
second half was 19% of the MMA warps' samples). So the second half of position t stays in registers
and is staged by position t + 1 once its S and dP are issued (after the loop, for the last): the
wait for the writer's read of the first half moves off the end of position t (the second half's wgmma,
the loop turn and t + 1's S and dP issue run meanwhile), and the tile order the writer sees (u = 2t,
2t + 1) is unchanged. Measured 1.05-1.10x the stage-at-the-end order from 1k keys
(bench/results/ab-gluon-nvidia-h200.md); the two stagings still wait for the writer (21% of the MMA
warps' samples afterwards). ptxas injects a warpgroup.wait before the deferred stores (C7517:
registers a wgmma defined), so the stores themselves wait for S and dP; copying the half out first
(+ 0.0) avoids that wait, and measured ~1% slower.
(Compiled for sm_90: the d256 causal build spills 4 bytes, causal + GQA 20; d64 / d128 (DQ_SPLIT 1)
16 / 40 bytes in the causal + GQA builds, as the one-ring d128 one; the one-ring configurations' PTX
is unchanged by the variant's code, tools/ptx_hash.py.)
"""

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
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
    tma_load,
    tma_store,
    unwrap,
)

LOG2E = gl.constexpr(1.4426950408889634)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of the shared-memory tile `src` into tensor_desc at coord (cp.reduce.async.bulk.tensor
    .add): asynchronous, tracked like a TMA store (tma.store_wait). Gluon 3.6 exposes the builder call only."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """wgmma accumulator layout for a [rows, cols] tile: warps stacked along the rows (16 each) as far as they go,
    the remaining warpgroups splitting the columns. (Called from a warp_specialize partition, its arguments arrive
    as constexpr wrappers: unwrapped first.)"""
    rows, cols, num_warps = unwrap(rows), unwrap(cols), unwrap(num_warps)
    wm = min(num_warps, rows // 16)
    wn = num_warps // wm
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, cols // wn, 16])


# the integer arguments are not specialised (== 1, % 16): one compilation per configuration whatever the shapes
_INT_ARGS = ["seqlen_q", "seqlen_k", "seqlen_q_pad", "nheads", "nheads_k", "stride_lb", "stride_lh"]


WORKER_NREG = gl.constexpr(24)  # the two 1-warp workers' registers (setmaxnreg)


@gluon.jit
def _ws_program(
    seqlen_q, seqlen_k, nheads, nheads_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr
):
    """The program's work, computed alike in every partition: (off_b, off_hk, h0, start_n, i_first, i_full, i_end,
    total). The grid is (G, key blocks, batch * nheads_k / G): program (x, n, z) takes key block n of head (batch
    entry, kv head) z * G + x. CUDA starts the programs x fastest, then n, then z (observed, not a documented
    guarantee), so the heads go in groups of G, one group after the other, and within a group key block 0 of every
    head first, then key block 1, ...: under a causal mask key block 0 sees the most query blocks, so each group
    runs heaviest first (the longest-first rule, which keeps the last wave short), while the programs running at
    once read the Q and dO of G heads only (ops.launch_gluon.bwd_grid sizes G for L2 and CUDA's grid limits). G = 1 is
    the head-major order (one head's key blocks after the other's). The ids come from special registers, which the
    compiler reads again rather than keep in registers through the loop (an order computed with divisions spilled,
    compiled for sm_90). Query heads h0 .. h0 + group - 1 share the kv head. Query blocks [i_first, i_end) of each
    of the group's heads see key block start_n; those before i_full cross the causal diagonal (key j visible to
    query i iff j <= i + seqlen_k - seqlen_q); total = group * (i_end - i_first) flat positions, head-major."""
    pid_n = gl.program_id(1)
    pid_bh = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
    off_b = pid_bh // nheads_k
    off_hk = pid_bh % nheads_k
    group = nheads // nheads_k
    h0 = off_hk * group
    start_n = pid_n * BLOCK_N
    n_m = gl.cdiv(seqlen_q, BLOCK_M)
    diag = seqlen_k - seqlen_q
    i_first = 0
    i_full = 0
    if CAUSAL:
        x = gl.maximum(start_n - diag, 0)
        i_first = gl.minimum(x // BLOCK_M, n_m)
        i_full = gl.maximum(
            gl.minimum((gl.maximum(start_n + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M, n_m), i_first
        )
    i_end = n_m
    total = group * (i_end - i_first)
    return off_b, off_hk, h0, start_n, i_first, i_full, i_end, total


@gluon.jit
def _ws_advance(i, hq, i_first, i_end):
    """The next flat position (head-major): query block i + 1 of head hq, or block i_first of head hq + 1."""
    i += 1
    wrap = i == i_end
    return gl.where(wrap, i_first, i), gl.where(wrap, hq + 1, hq)


@aggregate
class BwdConfig:
    """The MMA partition's tile shape and layouts (8 warps, two warpgroups; _mma_layout): S / dP [BLOCK_M, BLOCK_N],
    dK [BLOCK_N, HEAD_DIM], dV [BLOCK_N, HEAD_DIM_V], dQ_i's DQ_SPLIT column parts [BLOCK_M, DQ_W0] and
    [BLOCK_M, DQ_W1] accumulators; the NVMMA shared layouts of a Q / dO tile, a K / V block and a staged fp32 dQ
    part. q's and k's head dim that is not a power of two is two column parts (kernels/pipeline.py's
    head_dim_parts: HEAD_DIM_HI + HEAD_DIM_LO, HEAD_DIM_LO 0 otherwise), each a buffer of Q and K, an S wgmma, a dK
    accumulator and a part of dQ_i (DQ_SPLIT 2: DQ_W0 = HEAD_DIM_HI, DQ_W1 = HEAD_DIM_LO; else both
    HEAD_DIM // DQ_SPLIT). The first part's layouts keep the names of the one-part build (kv_layout: dK's, and dV's
    when the head dims are equal)."""

    CAUSAL: gl.constexpr
    HEAD_DIM: gl.constexpr
    HEAD_DIM_HI: gl.constexpr
    HEAD_DIM_LO: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    DQ_SPLIT: gl.constexpr
    DQ_W0: gl.constexpr
    DQ_W1: gl.constexpr
    s_layout: gl.constexpr
    kv_layout: gl.constexpr
    k_lo_layout: gl.constexpr
    v_layout: gl.constexpr
    dq_layout: gl.constexpr
    dq1_layout: gl.constexpr
    q_tile: gl.constexpr
    q_lo_tile: gl.constexpr
    do_tile: gl.constexpr
    kv_tile: gl.constexpr
    k_lo_tile: gl.constexpr
    v_tile: gl.constexpr
    dq_tile: gl.constexpr
    dq1_tile: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, dtype, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps):
        dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps = map(
            unwrap, (dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps)
        )
        hi, lo = head_dim_parts(HEAD_DIM)
        assert lo == 0 or DQ_SPLIT == 2, "a head dim in two parts computes dQ_i in those parts (DQ_SPLIT 2)"
        w0, w1 = (hi, lo) if lo else (HEAD_DIM // DQ_SPLIT, HEAD_DIM // DQ_SPLIT)
        self.CAUSAL = gl.constexpr(unwrap(CAUSAL))
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.HEAD_DIM_HI = gl.constexpr(hi)
        self.HEAD_DIM_LO = gl.constexpr(lo)
        self.HEAD_DIM_V = gl.constexpr(HEAD_DIM_V)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.DQ_SPLIT = gl.constexpr(DQ_SPLIT)
        self.DQ_W0 = gl.constexpr(w0)
        self.DQ_W1 = gl.constexpr(w1)
        lo_ = max(lo, 16)  # (no second part: unused)
        shared = gl.NVMMASharedLayout.get_default_for
        self.s_layout = gl.constexpr(_mma_layout(BLOCK_M, BLOCK_N, num_warps))
        self.kv_layout = gl.constexpr(_mma_layout(BLOCK_N, hi, num_warps))
        self.k_lo_layout = gl.constexpr(_mma_layout(BLOCK_N, lo_, num_warps))
        self.v_layout = gl.constexpr(_mma_layout(BLOCK_N, HEAD_DIM_V, num_warps))
        self.dq_layout = gl.constexpr(_mma_layout(BLOCK_M, w0, num_warps))
        self.dq1_layout = gl.constexpr(_mma_layout(BLOCK_M, w1, num_warps))
        self.q_tile = gl.constexpr(shared([BLOCK_M, hi], dtype))
        self.q_lo_tile = gl.constexpr(shared([BLOCK_M, lo_], dtype))
        self.do_tile = gl.constexpr(shared([BLOCK_M, HEAD_DIM_V], dtype))
        self.kv_tile = gl.constexpr(shared([BLOCK_N, hi], dtype))
        self.k_lo_tile = gl.constexpr(shared([BLOCK_N, lo_], dtype))
        self.v_tile = gl.constexpr(shared([BLOCK_N, HEAD_DIM_V], dtype))
        self.dq_tile = gl.constexpr(shared([BLOCK_M, w0], gl.float32))
        self.dq1_tile = gl.constexpr(shared([BLOCK_M, w1], gl.float32))


@aggregate
class BwdBuffers:
    """The MMA partition's shared memory and rings: K, V (one block each), the Q ring and the dO ring (SPLIT_RING:
    a ring of its own, DO_STAGES deep, released after dV; else Q's stages, with do_ready its own ready barriers and
    q_empty their release), P and dS, and the dQ staging ring (ready: dq_full, empty: dq_empty)."""

    k_smem: gl.tuple  # head-dim parts (kernels/pipeline.py's alloc_parts)
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.tuple  # head-dim parts
    do_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    q_ring: Ring
    do_ring: Ring
    dq_ring: Ring
    SPLIT_RING: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, q_ring, do_ring, dq_ring, SPLIT_RING):
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_smem = q_smem
        self.do_smem = do_smem
        self.p_smem = p_smem
        self.ds_smem = ds_smem
        self.dq_smem = dq_smem
        self.q_ring = q_ring
        self.do_ring = do_ring
        self.dq_ring = dq_ring
        self.SPLIT_RING = gl.constexpr(unwrap(SPLIT_RING))


@aggregate
class BwdScores:
    """The score arithmetic's inputs of the program's key block: lse (natural log) and delta, (batch, nheads,
    seqlen_q_pad) fp32 with one offset for both; the scale (sm_scale, and qk_scale = sm_scale * log2 e); the causal
    diagonal and the key block's first column. A per-score option is a field here and a line in _ws_step."""

    Lse: gl.tensor
    Delta: gl.tensor
    qk_scale: gl.tensor
    sm_scale: gl.tensor
    diag: Scalar
    start_n: gl.tensor

    @gluon.constexpr_function
    def __init__(self, Lse, Delta, qk_scale, sm_scale, diag, start_n):
        self.Lse = Lse
        self.Delta = Delta
        self.qk_scale = qk_scale
        self.sm_scale = sm_scale
        self.diag = gl.constexpr(diag) if isinstance(diag, int) else diag
        self.start_n = start_n


@gluon.jit
def _ws_producer(
    Q,
    K,
    V,
    DO,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    kv_bar,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    CAUSAL: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT_RING: gl.constexpr,
    DO_STAGES: gl.constexpr,
):
    """1 warp: K and V once, then Q and dO of every flat position into the ring(s), each with its own ready
    barrier. SPLIT_RING: dO has a ring of its own (DO_STAGES deep, released by do_empty), else it shares Q's
    stage and its release (q_empty). Q, K and their buffers: head-dim part pairs (kernels/pipeline.py)."""
    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(
        seqlen_q, seqlen_k, nheads, nheads_k, CAUSAL, BLOCK_M, BLOCK_N
    )
    q_ring = Ring(q_ready, q_empty, STAGES)
    if SPLIT_RING:
        do_ring = Ring(do_ready, do_empty, DO_STAGES)
    else:
        do_ring = Ring(do_ready, q_empty, STAGES)
    col_k = off_hk * HEAD_DIM
    mbarrier.expect(kv_bar, parts_nbytes(K, HEAD_DIM) + V.block_type.nbytes)
    load_parts(K, off_b, start_n, col_k, kv_bar, k_smem, 0, True, HEAD_DIM)
    col_v = col_k
    if HEAD_DIM_V != HEAD_DIM:
        col_v = off_hk * HEAD_DIM_V
    tma_load(V, [off_b, start_n, col_v], kv_bar, v_smem.index(0))
    i = i_first
    hq = h0
    for t in range(total):
        q_ring.wait_empty(t)
        mbarrier.expect(q_ring.ready_bar(t), parts_nbytes(Q, HEAD_DIM))
        load_parts(Q, off_b, i * BLOCK_M, hq * HEAD_DIM, q_ring.ready_bar(t), q_smem, q_ring.slot(t), True, HEAD_DIM)
        if SPLIT_RING:
            do_ring.wait_empty(t)
        mbarrier.expect(do_ring.ready_bar(t), DO.block_type.nbytes)
        tma_load(DO, [off_b, i * BLOCK_M, hq * HEAD_DIM_V], do_ring.ready_bar(t), do_smem.index(do_ring.slot(t)))
        i, hq = _ws_advance(i, hq, i_first, i_end)


@gluon.jit
def _ws_dq_writer(
    DQ,
    dq_smem,
    dq_full,
    dq_empty,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    CAUSAL: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    DQ_STAGES: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
):
    """1 warp: TMA reduce-add of each staged dQ_i into the fp32 accumulator (batch, seqlen_q_pad, nheads, HEAD_DIM)
    at (off_b, i * BLOCK_M, hq * HEAD_DIM); the buffer goes back once the reduce has read it. DQ_SPLIT 2: dQ_i comes
    as two column parts, staged one after the other (tile u = 2 t + half): halves, or a head dim's two parts
    (DQ: the accumulator's descriptor pair, each with its part's box; the second part staged in the first part of
    the staging tile)."""
    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(
        seqlen_q, seqlen_k, nheads, nheads_k, CAUSAL, BLOCK_M, BLOCK_N
    )
    dq_ring = Ring(dq_full, dq_empty, DQ_STAGES)
    i = i_first
    hq = h0
    for t in range(total):
        for half in gl.static_range(DQ_SPLIT):
            u = t * DQ_SPLIT + half
            dq_ring.wait_ready(u)
            if head_dim_parts(HEAD_DIM)[1] > 0 and half == 1:
                LO: gl.constexpr = head_dim_parts(HEAD_DIM)[1]
                col_lo = hq * HEAD_DIM + head_dim_parts(HEAD_DIM)[0]
                lo_buf = reinterpret(dq_smem.index(dq_ring.slot(u)), gl.float32, [1, BLOCK_M, LO], DQ[1].layout)
                tma_reduce_add(DQ[1], [off_b, i * BLOCK_M, col_lo], lo_buf)
            else:
                tma_reduce_add(
                    DQ[0],
                    [off_b, i * BLOCK_M, hq * HEAD_DIM + half * (HEAD_DIM // DQ_SPLIT)],
                    dq_smem.index(dq_ring.slot(u)),
                )
            tma.store_wait(pendings=0)
            dq_ring.release(u)
        i, hq = _ws_advance(i, hq, i_first, i_end)


@gluon.jit
def _stage_dq(dq, u, PART: gl.constexpr, bufs, cfg):
    """dQ tile u (part PART of dQ_i, [BLOCK_M, DQ_W0 or DQ_W1] fp32: a whole dQ_i, or one of its parts) into
    staging buffer u % DQ_STAGES once the writer has finished reading that buffer's last tile, then to the
    writer."""
    bufs.dq_ring.wait_empty(u)
    buf = bufs.dq_smem.index(bufs.dq_ring.slot(u))
    if PART == 1 and cfg.HEAD_DIM_LO > 0:
        reinterpret(buf, gl.float32, [cfg.BLOCK_M, cfg.DQ_W1], cfg.dq1_tile).store(dq)
    else:
        reinterpret(buf, gl.float32, [cfg.BLOCK_M, cfg.DQ_W0], cfg.dq_tile).store(dq)
    fence_async_shared()  # generic stores -> the writer's TMA reduce (async proxy)
    bufs.dq_ring.arrive_ready(u)


@gluon.jit
def _ws_step(it, i, dk, dv, dq_prev, off_lse, masked, bufs, sc, cfg):
    """Flat position it (Q ring position it, dO ring position it) = query block i of the current query head
    against this program's key block (its lse / delta at off_lse; masked: the block crosses the causal diagonal);
    returns (dk, dv, dq_prev). DQ_SPLIT 2: dq_prev (in) is the previous position's second dQ half, staged here once
    this position's S and dP are issued; dq_prev (out) is this position's, kept in registers for the next position
    (or the loop's end). DQ_SPLIT 1: dq_prev is passed through untouched."""
    dtype: gl.constexpr = bufs.v_smem.dtype
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    HI: gl.constexpr = cfg.HEAD_DIM_HI
    LO: gl.constexpr = cfg.HEAD_DIM_LO
    DQ_SPLIT: gl.constexpr = cfg.DQ_SPLIT
    s_layout: gl.constexpr = cfg.s_layout
    q_ring = bufs.q_ring
    do_ring = bufs.do_ring
    stage = q_ring.slot(it)
    do_stage = do_ring.slot(it)
    start_m = i * BLOCK_M

    # lse (natural log) and delta of the BLOCK_M query rows; in flight during the waits. Rows past seqlen_q (the
    # zero-filled tail of the last block): no mask, lse is padded with +inf and delta with 0 up to a multiple of
    # BLOCK_M -> P = 0 -> dS = 0, no contribution anywhere
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_l)
    lse2 = gl.load(sc.Lse + off_lse + offs_m) * LOG2E
    delta_s = gl.load(sc.Delta + off_lse + offs_m) * sc.sm_scale
    # K and V viewed through an index the compiler cannot fold (0, from inline asm on the loop counter): otherwise
    # LLVM hoists the ~24 loop-invariant 64-bit wgmma smem descriptors of K and V out of the loop into registers,
    # which spills at headdim 128
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [it], dtype=gl.int32, is_pure=True, pack=1)
    k_op = reinterpret(bufs.k_smem[0].index(z), dtype, [BLOCK_N, HI], cfg.kv_tile)
    k_lo = k_op
    if LO > 0:
        k_lo = reinterpret(bufs.k_smem[1].index(z), dtype, [BLOCK_N, LO], cfg.k_lo_tile)
    v_op = reinterpret(bufs.v_smem.index(z), dtype, [BLOCK_N, cfg.HEAD_DIM_V], cfg.v_tile)

    # S = Q K^T as soon as Q is there (one wgmma per head-dim part, chained); dP = dO V^T once dO is
    q_ring.wait_ready(it)
    q_op = reinterpret(bufs.q_smem[0].index(stage), dtype, [BLOCK_M, HI], cfg.q_tile)
    q_lo = q_op
    if LO > 0:
        q_lo = reinterpret(bufs.q_smem[1].index(stage), dtype, [BLOCK_M, LO], cfg.q_lo_tile)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if LO > 0:
        s_tok = warpgroup_mma(q_lo, k_lo.permute((1, 0)), s_tok, is_async=True)
    do_ring.wait_ready(it)
    do_op = reinterpret(bufs.do_smem.index(do_stage), dtype, [BLOCK_M, cfg.HEAD_DIM_V], cfg.do_tile)
    dp_tok = warpgroup_mma(do_op, v_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # DQ_SPLIT 2: the previous position's second half into the staging tile once S and dP are issued (ptxas makes
    # the stores wait for them: C7517). Staged at the end of its own position, it waited there for the writer to
    # finish reading the first half (a 32 KB bulk reduce; 19% of the MMA warps' samples in ncu at headdim 256,
    # 4k keys) with the tensor cores idle
    if DQ_SPLIT == 2:
        if it > 0:
            _stage_dq(dq_prev, it * 2 - 1, 1, bufs, cfg)

    # S ready (dP may still run): P -> smem, then dV += P^T dO issued (A = P^T, a permuted view: MN-major A).
    # Keys past seqlen_k (zero-filled K / V rows of the last key block) are not masked: S = 0 there, dP = 0 and
    # K = 0, so they add nothing to dQ_i = dS K, and their own dK / dV rows are clipped by the stores -- as long as
    # P stays finite: exp(0 - lse) overflows for a row with lse < -88 and inf * 0 would put NaN into dQ. Hence the
    # exponent is capped at 0 (P <= 1, which the visible keys satisfy up to rounding) instead of a mask (spills).
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    p = gl.exp2(gl.minimum(s * sc.qk_scale - lse2[:, None], 0.0))
    if cfg.CAUSAL:  # no branch: a per-row limit, past every key of the block when it does not cross the diagonal
        lim = gl.where(masked, offs_m + sc.diag, sc.start_n + BLOCK_N)
        offs_n = sc.start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(offs_n[None, :] <= lim[:, None], p, 0.0)
    bufs.p_smem.store(p.to(dtype))
    fence_async_shared()  # generic-proxy stores -> wgmma (async proxy) reads
    dv_tok = warpgroup_mma(bufs.p_smem.permute((1, 0)), do_op, dv, is_async=True)

    # dS = P * (dP * scale - delta * scale) -> smem; dQ_i = dS K (A = dS, B = K: MN-major B) first, so that it
    # completes before dK += dS^T Q. DQ_SPLIT 2: dQ_i in two column parts (B = the halves of K, or its head-dim
    # parts), the second issued after dK, so only one part is in registers and staged at a time. Two head-dim parts:
    # dK is two accumulators (dk: their pair), one wgmma each
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
    ds = p * (dp * sc.sm_scale - delta_s[:, None])
    bufs.ds_smem.store(ds.to(dtype))
    fence_async_shared()
    HALF: gl.constexpr = HEAD_DIM // DQ_SPLIT
    dq_zero = gl.zeros([BLOCK_M, cfg.DQ_W0], gl.float32, cfg.dq_layout)
    k_dq = k_op if DQ_SPLIT == 1 or LO > 0 else k_op.slice(0, HALF, dim=1)
    dq_tok = warpgroup_mma(bufs.ds_smem, k_dq, dq_zero, use_acc=False, is_async=True)
    if LO > 0:
        dk_tok = warpgroup_mma(bufs.ds_smem.permute((1, 0)), q_op, dk[0], is_async=True)
        dk_lo_tok = warpgroup_mma(bufs.ds_smem.permute((1, 0)), q_lo, dk[1], is_async=True)
        # dV, dQ_i's first part ready (dK's two wgmmas may still run)
        dv, dq = warpgroup_mma_wait(num_outstanding=2, deps=(dv_tok, dq_tok))
    else:
        dk_tok = warpgroup_mma(bufs.ds_smem.permute((1, 0)), q_op, dk, is_async=True)
        # dV, dQ_i (its first half) ready (dK may still run)
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dq_tok))

    # dO has no reader left (SPLIT_RING: back to the producer); dQ_i into a staging buffer the writer has finished
    # reading, to the writer
    if bufs.SPLIT_RING:
        do_ring.release(it)
    _stage_dq(dq, it * DQ_SPLIT, 0, bufs, cfg)
    if DQ_SPLIT == 2:
        if LO > 0:
            dq1_zero = gl.zeros([BLOCK_M, cfg.DQ_W1], gl.float32, cfg.dq1_layout)
            dq_tok = warpgroup_mma(bufs.ds_smem, k_lo, dq1_zero, use_acc=False, is_async=True)
            # dK ready (the second part may still run): no wgmma reads this Q stage any more
            dk = warpgroup_mma_wait(num_outstanding=1, deps=(dk_tok, dk_lo_tok))
        else:
            dq_tok = warpgroup_mma(bufs.ds_smem, k_op.slice(HALF, HALF, dim=1), dq_zero, use_acc=False, is_async=True)
            # dK ready (the second half may still run): no wgmma reads this Q stage any more
            dk = warpgroup_mma_wait(num_outstanding=1, deps=(dk_tok,))
        q_ring.release(it)
        # staged by the next position (or after the loop): tile it * 2 + 1
        dq_prev = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
    else:
        # dK ready: no wgmma reads this Q (/ dO) stage any more: back to the producer
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok,))
        q_ring.release(it)
    return dk, dv, dq_prev


@gluon.jit
def _ws_mma(
    DK,
    DV,
    Lse,
    Delta,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    p_smem,
    ds_smem,
    dq_smem,
    kv_bar,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    dq_full,
    dq_empty,
    sm_scale,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    stride_lb,
    stride_lh,
    CAUSAL: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    DQ_STAGES: gl.constexpr,
    GQA: gl.constexpr,
    SPLIT_RING: gl.constexpr,
    DO_STAGES: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
):
    """The default partition (8 warps: two MMA warpgroups): the loop over flat positions and the epilogue. Layouts
    (BwdConfig): S / dP [BLOCK_M, BLOCK_N] with BLOCK_M = 64: warps_per_cta [4, 2], each warpgroup all query rows
    and half of the keys; dK / dV [BLOCK_N, D]: warps stacked along the keys (each warpgroup the same half of the
    keys as in S); dQ_i [BLOCK_M, D // DQ_SPLIT]: [4, 2], the warpgroups split its columns. DK, k_smem, q_smem:
    head-dim part pairs (kernels/pipeline.py)."""
    dtype: gl.constexpr = v_smem.dtype
    # (gl.num_warps() is not the partition's inside a partition)
    cfg = BwdConfig(dtype, CAUSAL, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, 8)
    q_ring = Ring(q_ready, q_empty, STAGES)
    if SPLIT_RING:
        do_ring = Ring(do_ready, do_empty, DO_STAGES)
    else:
        do_ring = Ring(do_ready, q_empty, STAGES)
    bufs = BwdBuffers(
        k_smem,
        v_smem,
        q_smem,
        do_smem,
        p_smem,
        ds_smem,
        dq_smem,
        q_ring,
        do_ring,
        Ring(dq_full, dq_empty, DQ_STAGES),
        SPLIT_RING,
    )

    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(
        seqlen_q, seqlen_k, nheads, nheads_k, CAUSAL, BLOCK_M, BLOCK_N
    )
    col_k = off_hk * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    diag = seqlen_k - seqlen_q
    off_lse = off_b.to(gl.int64) * stride_lb + h0.to(gl.int64) * stride_lh
    sc = BwdScores(Lse, Delta, qk_scale, sm_scale, diag, start_n)

    HI: gl.constexpr = cfg.HEAD_DIM_HI
    LO: gl.constexpr = cfg.HEAD_DIM_LO
    if LO > 0:  # dK in two parts (_ws_step)
        dk = (gl.zeros([BLOCK_N, HI], gl.float32, cfg.kv_layout), gl.zeros([BLOCK_N, LO], gl.float32, cfg.k_lo_layout))
    else:
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, cfg.kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM_V], gl.float32, cfg.v_layout)
    dq_prev = gl.zeros([BLOCK_M, cfg.DQ_W1], gl.float32, cfg.dq1_layout)  # (DQ_SPLIT 2: see _ws_step)
    mbarrier.wait(kv_bar, 0)
    # lse, delta: (batch, nheads, seqlen_q_pad) fp32 with the same strides, seqlen stride 1: one offset for both.
    # GQA / MQA: one flat loop over (query head, query block), head-major: the ring's stage / phase run on across
    # heads (a nested loop over heads costs registers); dK / dV accumulate over the whole group (deterministic)
    if GQA:
        i = i_first
        for it in range(0, total):
            dk, dv, dq_prev = _ws_step(it, i, dk, dv, dq_prev, off_lse, i < i_full, bufs, sc, cfg)
            i += 1
            wrap = i == i_end
            i = gl.where(wrap, i_first, i)
            off_lse = gl.where(wrap, off_lse + stride_lh, off_lse)
    else:
        for i in range(i_first, i_end):
            dk, dv, dq_prev = _ws_step(i - i_first, i, dk, dv, dq_prev, off_lse, i < i_full, bufs, sc, cfg)

    # DQ_SPLIT 2: the last position's second dQ half (tile 2 * total - 1)
    if DQ_SPLIT == 2:
        if total > 0:
            _stage_dq(dq_prev, total * 2 - 1, 1, bufs, cfg)

    # dK, dV through the K / V buffers (every wgmma reading them was waited), clipped TMA stores
    k_op = reinterpret(k_smem[0].index(0), dtype, [BLOCK_N, HI], cfg.kv_tile)
    v_op = reinterpret(v_smem.index(0), dtype, [BLOCK_N, HEAD_DIM_V], cfg.v_tile)
    if LO > 0:
        k_op.store(dk[0].to(dtype))
        reinterpret(k_smem[1].index(0), dtype, [BLOCK_N, LO], cfg.k_lo_tile).store(dk[1].to(dtype))
    else:
        k_op.store(dk.to(dtype))
    v_op.store(dv.to(dtype))
    fence_async_shared()
    tma_store(DK[0], [off_b, start_n, col_k], k_smem[0].index(0))
    if LO > 0:
        tma_store(DK[1], [off_b, start_n, col_k + HI], k_smem[1].index(0))
    col_v = col_k
    if HEAD_DIM_V != HEAD_DIM:
        col_v = off_hk * HEAD_DIM_V
    tma_store(DV, [off_b, start_n, col_v], v_smem.index(0))
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=_INT_ARGS)
def attn_bwd_ws_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    DQ,
    QLo,
    KLo,
    DKLo,
    DQLo,
    Lse,
    Delta,
    sm_scale,
    seqlen_q,
    seqlen_k,
    seqlen_q_pad,
    nheads,
    nheads_k,
    stride_lb,
    stride_lh,
    CAUSAL: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    DQ_STAGES: gl.constexpr,
    GQA: gl.constexpr,
    SPLIT_RING: gl.constexpr,
    DO_STAGES: gl.constexpr,
    DQ_SPLIT: gl.constexpr,
):
    """Grid (G, cdiv(seqlen_k, BLOCK_N), batch * nheads_k / G) for G heads per group (_ws_program); launched with
    num_warps=8 (the MMA partition; the compiler adds the workers' warps). Q, K, V, DO, DK, DV: 3-D descriptors over
    (batch, seqlen, heads * headdim), blocks [1, BLOCK_M or BLOCK_N, HEAD_DIM]; DQ: the fp32 accumulator's (batch,
    seqlen_q_pad, nheads * headdim), zeroed, block [1, BLOCK_M, HEAD_DIM // DQ_SPLIT]; Lse (natural log), Delta:
    (batch, nheads, seqlen_q_pad) padded with +inf / 0, strides (stride_lb, stride_lh, 1). SPLIT_RING: dO in a ring
    of its own, DO_STAGES deep, released as soon as dV is computed (Q's ring, STAGES deep, after dK); else Q and dO
    share a STAGES-deep ring. DQ_SPLIT 2: dQ_i computed and staged in two column halves through DQ_STAGES
    half-width tiles. V, DO, DV: v's head dim HEAD_DIM_V. q's and k's head dim that is not a power of two
    (DeepSeek-V3's 192) is two column parts (kernels/pipeline.py's head_dim_parts; DQ_SPLIT 2): Q, K, DK, DQ then
    have the first part's box and QLo, KLo, DKLo, DQLo the second's (None otherwise); the staging tile is the first
    part's width.
    """
    dtype: gl.constexpr = V.dtype
    p_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    q_desc, k_desc = part_descs(Q, QLo, HEAD_DIM), part_descs(K, KLo, HEAD_DIM)
    dk_desc, dq_desc = part_descs(DK, DKLo, HEAD_DIM), part_descs(DQ, DQLo, HEAD_DIM)
    k_smem = alloc_parts(k_desc, 1, BLOCK_N, HEAD_DIM)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM_V], V.layout)
    q_smem = alloc_parts(q_desc, STAGES, BLOCK_M, HEAD_DIM)
    if SPLIT_RING:
        do_smem = gl.allocate_shared_memory(dtype, [DO_STAGES, 1, BLOCK_M, HEAD_DIM_V], DO.layout)
    else:
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, HEAD_DIM_V], DO.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_tile)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_tile)
    DQ_W: gl.constexpr = head_dim_parts(HEAD_DIM)[0] if head_dim_parts(HEAD_DIM)[1] > 0 else HEAD_DIM // DQ_SPLIT
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_STAGES, 1, BLOCK_M, DQ_W], DQ.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if SPLIT_RING:
        do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    else:
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if SPLIT_RING:
        do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    else:
        do_empty = q_empty  # (not used: dO goes back with Q)
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        if not SPLIT_RING:
            mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)
    if SPLIT_RING:
        for s in gl.static_range(DO_STAGES):
            mbarrier.init(do_ready.index(s), count=1)
            mbarrier.init(do_empty.index(s), count=1)
    for s in gl.static_range(DQ_STAGES):
        mbarrier.init(dq_full.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    fence_async_shared()

    # (the argument tuples written out: a tuple bound to a variable turns its constexprs into tensors)
    gl.warp_specialize(
        [
            (
                _ws_mma,
                (
                    dk_desc,
                    DV,
                    Lse,
                    Delta,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    p_smem,
                    ds_smem,
                    dq_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    q_empty,
                    do_empty,
                    dq_full,
                    dq_empty,
                    sm_scale,
                    seqlen_q,
                    seqlen_k,
                    nheads,
                    nheads_k,
                    stride_lb,
                    stride_lh,
                    CAUSAL,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    DQ_STAGES,
                    GQA,
                    SPLIT_RING,
                    DO_STAGES,
                    DQ_SPLIT,
                ),
            ),
            (
                _ws_producer,
                (
                    q_desc,
                    k_desc,
                    V,
                    DO,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    kv_bar,
                    q_ready,
                    do_ready,
                    q_empty,
                    do_empty,
                    seqlen_q,
                    seqlen_k,
                    nheads,
                    nheads_k,
                    CAUSAL,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    BLOCK_M,
                    BLOCK_N,
                    STAGES,
                    SPLIT_RING,
                    DO_STAGES,
                ),
            ),
            (
                _ws_dq_writer,
                (
                    dq_desc,
                    dq_smem,
                    dq_full,
                    dq_empty,
                    seqlen_q,
                    seqlen_k,
                    nheads,
                    nheads_k,
                    CAUSAL,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_N,
                    DQ_STAGES,
                    DQ_SPLIT,
                ),
            ),
        ],
        [1, 1],
        [WORKER_NREG, WORKER_NREG],
    )
