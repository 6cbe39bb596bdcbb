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
The plan (ops/planning/) takes this kernel for deterministic=False only (flash_attn's default). The softmax
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
staging ring (dq_full as its ready, dq_empty)). Every partition takes the kernel's runtime arguments as one BwdArgs,
its buffers and rings as one BwdBuffers and its constexprs and the MMA partition's layouts as one BwdConfig
(kernels/bwd_hopper_config.py); the MMA partition (kernels/bwd_hopper_mma.py: _ws_mma, its step _ws_step) takes the
score arithmetic's inputs as one BwdScores.
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

The split-ring variant (SPLIT_RING, DQ_SPLIT: the headdim-256 row of ops/planning/): dO has
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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .bwd_hopper_config import MMA_WARPS, BwdArgs, BwdBuffers, BwdConfig, _ws_advance, _ws_program
from .bwd_hopper_mma import _ws_mma
from .pipeline import Ring, alloc_parts, head_dim_parts, load_parts, part_descs, parts_nbytes, reinterpret, tma_load


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of the shared-memory tile `src` into tensor_desc at coord (cp.reduce.async.bulk.tensor
    .add): asynchronous, tracked like a TMA store (tma.store_wait). Gluon 3.6 exposes the builder call only."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# the integer arguments are not specialised (== 1, % 16): one compilation per configuration whatever the shapes
_INT_ARGS = ["seqlen_q", "seqlen_k", "seqlen_q_pad", "nheads", "nheads_k", "stride_lb", "stride_lh"]


WORKER_NREG = gl.constexpr(24)  # the two 1-warp workers' registers (setmaxnreg)


@gluon.jit
def _ws_producer(args, bufs, cfg):
    """1 warp: K and V once, then Q and dO of every flat position into the ring(s), each with its own ready
    barrier. SPLIT_RING: dO has a ring of its own (DO_STAGES deep, released by do_empty), else it shares Q's
    stage and its release (q_empty). Q, K and their buffers: head-dim part pairs (kernels/pipeline.py)."""
    Q = args.q_desc
    K = args.k_desc
    V = args.V
    DO = args.DO
    kv_bar = bufs.kv_bar
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    HEAD_DIM_V: gl.constexpr = cfg.HEAD_DIM_V
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(args, cfg)
    q_ring = bufs.q_ring
    do_ring = bufs.do_ring
    col_k = off_hk * HEAD_DIM
    mbarrier.expect(kv_bar, parts_nbytes(K, HEAD_DIM) + V.block_type.nbytes)
    load_parts(K, off_b, start_n, col_k, kv_bar, bufs.k_smem, 0, True, HEAD_DIM)
    col_v = col_k
    if HEAD_DIM_V != HEAD_DIM:
        col_v = off_hk * HEAD_DIM_V
    tma_load(V, [off_b, start_n, col_v], kv_bar, bufs.v_smem.index(0))
    i = i_first
    hq = h0
    for t in range(total):
        q_ring.wait_empty(t)
        mbarrier.expect(q_ring.ready_bar(t), parts_nbytes(Q, HEAD_DIM))
        load_parts(
            Q, off_b, i * BLOCK_M, hq * HEAD_DIM, q_ring.ready_bar(t), bufs.q_smem, q_ring.slot(t), True, HEAD_DIM
        )
        if bufs.SPLIT_RING:
            do_ring.wait_empty(t)
        mbarrier.expect(do_ring.ready_bar(t), DO.block_type.nbytes)
        tma_load(DO, [off_b, i * BLOCK_M, hq * HEAD_DIM_V], do_ring.ready_bar(t), bufs.do_smem.index(do_ring.slot(t)))
        i, hq = _ws_advance(i, hq, i_first, i_end)


@gluon.jit
def _ws_dq_writer(args, bufs, cfg):
    """1 warp: TMA reduce-add of each staged dQ_i into the fp32 accumulator (batch, seqlen_q_pad, nheads, HEAD_DIM)
    at (off_b, i * BLOCK_M, hq * HEAD_DIM); the buffer goes back once the reduce has read it. DQ_SPLIT 2: dQ_i comes
    as two column parts, staged one after the other (tile u = 2 t + half): halves, or a head dim's two parts
    (DQ: the accumulator's descriptor pair, each with its part's box; the second part staged in the first part of
    the staging tile)."""
    DQ = args.dq_desc
    dq_smem = bufs.dq_smem
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    DQ_SPLIT: gl.constexpr = cfg.DQ_SPLIT
    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(args, cfg)
    dq_ring = bufs.dq_ring
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
    part's width. (The integer arguments stay apart, not tuples: do_not_specialize does not reach a tuple's
    elements.)
    """
    gl.static_assert(gl.num_warps() == MMA_WARPS, "the default partition is the MMA partition")
    dtype: gl.constexpr = V.dtype
    cfg = BwdConfig(
        dtype=dtype,
        CAUSAL=CAUSAL,
        GQA=GQA,
        HEAD_DIM=HEAD_DIM,
        HEAD_DIM_V=HEAD_DIM_V,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DQ_SPLIT=DQ_SPLIT,
        num_warps=MMA_WARPS,
    )
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

    args = BwdArgs(
        q_desc=q_desc,
        k_desc=k_desc,
        V=V,
        DO=DO,
        dk_desc=dk_desc,
        DV=DV,
        dq_desc=dq_desc,
        Lse=Lse,
        Delta=Delta,
        sm_scale=sm_scale,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_k=nheads_k,
        stride_lb=stride_lb,
        stride_lh=stride_lh,
    )
    q_ring = Ring(q_ready, q_empty, STAGES)
    if SPLIT_RING:
        do_ring = Ring(do_ready, do_empty, DO_STAGES)
    else:
        do_ring = Ring(do_ready, q_empty, STAGES)
    bufs = BwdBuffers(
        k_smem=k_smem,
        v_smem=v_smem,
        kv_bar=kv_bar,
        q_smem=q_smem,
        do_smem=do_smem,
        p_smem=p_smem,
        ds_smem=ds_smem,
        dq_smem=dq_smem,
        q_ring=q_ring,
        do_ring=do_ring,
        dq_ring=Ring(dq_full, dq_empty, DQ_STAGES),
        SPLIT_RING=SPLIT_RING,
    )
    gl.warp_specialize(
        [(_ws_mma, (args, bufs, cfg)), (_ws_producer, (args, bufs, cfg)), (_ws_dq_writer, (args, bufs, cfg))],
        [1, 1],
        [WORKER_NREG, WORKER_NREG],
    )
