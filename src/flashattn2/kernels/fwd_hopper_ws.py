"""The warp-specialized Gluon forward, attn_fwd_ws_kernel (FlashAttention-3's producer/consumer split; the plan's
fwd_hopper_ws, headdim 256). One program covers 2 * BLOCK_M query rows with three partitions:
  * two consumer warpgroups (the default partition and worker 0), each owning one BLOCK_M-row
    query tile and running the consumer pipeline (kernels/fwd_hopper_tile.py's _attn_tile);
  * one producer warp (worker 1, few registers): TMA of both Q tiles, then K_0, K_1, V_0, K_2,
    V_1, ... into STAGES-deep K and V rings (pipeline.Ring: a "ready" mbarrier per stage, the
    producer's expect-tx, and an "empty" one counting one arrival per consumer, made after the
    wgmma that read the stage was waited for; block j is ring position j).
The tiles may need different numbers of key blocks (causal: tile 0 sees fewer keys; a tile past
seqlen_q needs none): the consumer with more arrives twice (for itself and its partner) on the
blocks its partner does not use, so every phase of an empty barrier gets its two arrivals.
(A ping-pong of the consumers' GEMM issues through two "turn" mbarriers measured slower at both
head dims and was removed.)
Registers: the producer is given 24 per thread, each consumer 240 (setmaxnreg).
Every partition takes the kernel's FwdArgs, WsBuffers and FwdConfig (and a consumer its id).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .fwd_hopper_schedule import _program_tile, _tile_blocks
from .fwd_hopper_tile import (
    _CONSUMER0,
    _CONSUMER1,
    _CONSUMER_REGS,
    _PRODUCER_REGS,
    CONSUMER_WARPS,
    FwdArgs,
    FwdConfig,
    Fp8Scales,
    OnlineSoftmax,
    _attn_tile,
    _epilogue,
    _qk_scale,
    alloc_v_and_o,
    _sink2,
)
from .pipeline import Ring, Scalar, aggregate, alloc_parts, load_parts, part_descs, parts_nbytes, by_field

NUM_CONSUMERS = gl.constexpr(2)


@aggregate
class WsBuffers:
    """attn_fwd_ws_kernel's shared memory and barriers: the two consumers' Q tiles (head-dim part pairs:
    kernels/pipeline.py's alloc_parts) with one barrier each, the K and V rings, and FP8's O buffers (one per
    consumer; V's ring, unused, for a 16-bit kernel)."""

    q_smem: gl.tuple
    k_smem: gl.tuple
    v_smem: gl.shared_memory_descriptor
    q_bars: gl.shared_memory_descriptor
    k_ring: Ring
    v_ring: Ring
    o_smem: gl.shared_memory_descriptor

    __init__ = by_field  # every field by keyword


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
    def __init__(self, bufs, n_other, cfg):
        self.k_smem = bufs.k_smem
        self.v_smem = bufs.v_smem
        self.k_ring = bufs.k_ring
        self.v_ring = bufs.v_ring
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
def _consumer(args, bufs, cfg, ME: gl.constexpr):
    """Consumer warpgroup ME (0: the default partition, 1: worker 0): query tile ME of the program."""
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    seqlen_q = args.seqlen_q
    seqlen_k = args.seqlen_k
    off_b, off_h, cta_m = _program_tile(args, cfg)
    start_m = cta_m + ME * BLOCK_M
    n_blocks, mask_from = _tile_blocks(start_m, args, cfg)
    n_other, _ = _tile_blocks(cta_m + (1 - ME) * BLOCK_M, args, cfg)
    lse_row0 = off_b.to(gl.int64) * args.stride_lse_b + off_h.to(gl.int64) * args.stride_lse_h
    if n_blocks > 0:
        o_col = off_h * cfg.HEAD_DIM_V
        sink2 = _sink2(args.Sinks, off_h, cfg.SINK)
        if cfg.FP8:
            off_hk = off_h // args.group_size
            qk_scale = _qk_scale(args.fp8.score_scale(args.sm_scale, off_b, off_hk))
            v_scale = args.fp8.value_scale(off_b, off_hk)
            sm = OnlineSoftmax(qk_scale, start_m, seqlen_k, seqlen_k - seqlen_q, sink2, cfg, v_scale)
        else:
            sm = OnlineSoftmax(_qk_scale(args.sm_scale), start_m, seqlen_k, seqlen_k - seqlen_q, sink2, cfg)
        loads = _WsLoads(bufs, n_other, cfg)
        q_op = cfg.q_view(bufs.q_smem, ME)
        mbarrier.wait(bufs.q_bars.index(ME), 0)
        acc, m_i, l_i = _attn_tile(q_op, loads, sm, n_blocks, mask_from)
        o_op, o_buf = cfg.out_buffer(q_op[0], bufs.q_smem[0].index(ME), bufs.o_smem, ME)
        _epilogue(acc, m_i, l_i, sm, args, lse_row0, off_b, o_col, o_op, o_buf, True)


@gluon.jit
def _produce(desc, ring, smem, blk, off_b, col, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Block blk of a ring: wait until both consumers released the stage's previous block, then TMA it (desc and
    smem: alloc_parts' pairs, HEAD_DIM the block's head dim)."""
    ring.wait_empty(blk)
    bar = ring.ready_bar(blk)
    mbarrier.expect(bar, parts_nbytes(desc, HEAD_DIM))
    load_parts(desc, off_b, blk * BLOCK_N, col, bar, smem, ring.slot(blk), True, HEAD_DIM)


@gluon.jit
def _produce_v(V, ring, smem, blk, off_b, v_col, cfg):
    """Value block blk into the V ring (FwdConfig.v_load: V's rows, or FP8's V^T columns), as _produce."""
    ring.wait_empty(blk)
    bar = ring.ready_bar(blk)
    mbarrier.expect(bar, V.block_type.nbytes)
    cfg.v_load(V, off_b, blk, v_col, bar, smem, ring.slot(blk), True)


@gluon.jit
def _producer(args, bufs, cfg):
    """One warp: both Q tiles, then K_0, K_1, V_0, K_2, V_1, ..., V_{n-1} (the consumers' order of
    use, n = the longer tile's block count)."""
    Q = args.q_desc
    K = args.k_desc
    V = args.V
    q_smem = bufs.q_smem
    k_smem = bufs.k_smem
    v_smem = bufs.v_smem
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    HEAD_DIM_V: gl.constexpr = cfg.HEAD_DIM_V
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    off_b, off_h, cta_m = _program_tile(args, cfg)
    n0, _ = _tile_blocks(cta_m, args, cfg)
    n1, _ = _tile_blocks(cta_m + BLOCK_M, args, cfg)
    n_max = gl.maximum(n0, n1)
    q_col = off_h * HEAD_DIM
    k_col = (off_h // args.group_size) * HEAD_DIM
    v_col = (off_h // args.group_size) * HEAD_DIM_V
    k_ring = bufs.k_ring
    v_ring = bufs.v_ring
    for t in gl.static_range(NUM_CONSUMERS):
        bar = bufs.q_bars.index(t)
        valid = cta_m + t * BLOCK_M < args.seqlen_q
        mbarrier.expect(bar, parts_nbytes(Q, HEAD_DIM), pred=valid)
        load_parts(Q, off_b, cta_m + t * BLOCK_M, q_col, bar, q_smem, t, valid, HEAD_DIM)
    _produce(K, k_ring, k_smem, 0, off_b, k_col, BLOCK_N, HEAD_DIM)  # tile 0 is valid: n_max >= 1
    for j in range(1, n_max):
        _produce(K, k_ring, k_smem, j, off_b, k_col, BLOCK_N, HEAD_DIM)
        _produce_v(V, v_ring, v_smem, j - 1, off_b, v_col, cfg)
    _produce_v(V, v_ring, v_smem, n_max - 1, off_b, v_col, cfg)


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
    QDescale,
    KDescale,
    VDescale,
    descale_strides,
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
    head-dim part (FwdConfig), None for a power of two. FP8 (e4m3 Q, K, V; FwdConfig): V is a descriptor of V^T
    (batch, kv heads * HEAD_DIM_V, keys), Out bf16; the descales and their strides (Fp8Scales) None for 16-bit
    inputs."""
    gl.static_assert(gl.num_warps() == CONSUMER_WARPS, "the default partition is a consumer warpgroup")
    dtype: gl.constexpr = V.dtype
    cfg = FwdConfig(
        dtype=dtype,
        CAUSAL=CAUSAL,
        SINK=SINK,
        HEAD_DIM=HEAD_DIM,
        HEAD_DIM_V=HEAD_DIM_V,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        CONSUMERS=NUM_CONSUMERS,
        QBUF=1,
        SNAKE=False,
    )
    q_desc, k_desc = part_descs(Q, QLo, HEAD_DIM), part_descs(K, KLo, HEAD_DIM)
    q_smem = alloc_parts(q_desc, NUM_CONSUMERS, BLOCK_M, HEAD_DIM)
    k_smem = alloc_parts(k_desc, STAGES, BLOCK_N, HEAD_DIM)
    v_smem, o_smem = alloc_v_and_o(V, Out, cfg, STAGES)
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

    args = FwdArgs(
        q_desc=q_desc,
        k_desc=k_desc,
        V=V,
        Out=Out,
        Lse=Lse,
        Sinks=Sinks,
        stride_lse_b=stride_lse_b,
        stride_lse_h=stride_lse_h,
        batch=batch,
        nheads=nheads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        group_size=group_size,
        sm_scale=sm_scale,
        fp8=Fp8Scales(q=QDescale, k=KDescale, v=VDescale, strides=descale_strides),
    )
    k_ring, v_ring = Ring(k_ready, k_empty, STAGES), Ring(v_ready, v_empty, STAGES)
    bufs = WsBuffers(
        q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, q_bars=q_bars, k_ring=k_ring, v_ring=v_ring, o_smem=o_smem
    )
    gl.warp_specialize(
        [
            (_consumer, (args, bufs, cfg, _CONSUMER0)),
            (_consumer, (args, bufs, cfg, _CONSUMER1)),
            (_producer, (args, bufs, cfg)),
        ],
        [CONSUMER_WARPS, 1],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )
