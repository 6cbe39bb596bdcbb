"""The persistent warp-specialized Gluon forward, attn_fwd_persist_kernel (the plan's fwd_hopper_persist: headdim 64,
128 and 192/128): the same partitions and numerics as attn_fwd_ws_kernel (kernels/fwd_hopper_ws.py), with CONSUMERS
(2 or 3) consumer warpgroups, and a grid of min(#SMs, #tiles) CTAs (a tile: batch entry, head, CONSUMERS * BLOCK_M
query rows), each looping over tiles pid, pid + G, pid + 2G, ... (G CTAs), so a tile's prologue and epilogue overlap
its neighbours' work. SNAKE (meant for causal) reverses every other round, so a CTA that got a round's heaviest tile
gets the next round's lightest. Tile order (kernels/fwd_hopper_schedule.py's PersistSchedule): non-causal one head's
query blocks together (K/V reuse in L2), causal heaviest first over all heads, the causal tiles aligned to the last
query row (the parts a length leaves over lie before row 0, in the lightest tile). The ring holds units: a tile of n
key blocks (n = the largest block count of its parts) is units 0 .. n, unit j holding K_j (j < n) and V_{j-1}
(j > 0) -- what one inner step reads (QK_j^T, then P_{j-1} V_{j-1}) -- in the K and V buffers of one stage, behind
one ready barrier (expect-tx of both blocks) and one empty barrier (one arrival per consumer, after the step's
wgmmas), so a consumer waits once and releases once per key block (each Gluon arrive comes after a warpgroup
bar.sync; measured: 3 bar.syncs per step -> 2; 1-6% faster from 1k keys, the short causal tiles with a third stage).
The ring runs on across tiles: ring unit g uses stage g % STAGES, phase (g // STAGES) & 1, and the producer and
every consumer advance g by n + 1 per tile. Every consumer waits for and releases every ring unit of the tile, the
units its part does not use (causal: the lighter parts; an empty part, past seqlen_q or, causal, before row 0: all)
right after its epilogue (_skip_units). attn_fwd_ws_kernel's scheme, the partner arriving twice on them, is wrong
here: the consumer that skipped them would go on to its next tile and wait on ring units more than STAGES ahead of
the fill, where a parity wait passes two phases early.
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
Every partition takes the kernel's FwdArgs, PersistBuffers and FwdConfig (and a consumer its id).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .fwd_hopper_schedule import _tile_blocks, persist_schedule
from .fwd_hopper_tile import (
    _CONSUMER0,
    _CONSUMER1,
    _CONSUMER2,
    _CONSUMER3_REGS,
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
from .pipeline import (
    Ring,
    aggregate,
    alloc_parts,
    load_parts,
    part_descs,
    parts_nbytes,
    ring_phase,
    by_field,
    thread_barrier,
)


@aggregate
class PersistBuffers:
    """attn_fwd_persist_kernel's shared memory and barriers: QBUF * CONSUMERS Q buffers (head-dim part pairs:
    kernels/pipeline.py's alloc_parts), each with a q_ready and a q_empty barrier, the K/V ring of units (one
    stage of the K and V buffers behind one ready and one empty barrier), and FP8's O buffers (one per consumer;
    V's buffers, unused, for a 16-bit kernel)."""

    q_smem: gl.tuple
    k_smem: gl.tuple
    v_smem: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    ring: Ring
    o_smem: gl.shared_memory_descriptor

    __init__ = by_field  # every field by keyword


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

    bufs: PersistBuffers
    g: gl.tensor
    prev_qi: gl.tensor
    has_prev: gl.tensor
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, bufs, g, prev_qi, has_prev, cfg):
        self.bufs = bufs
        self.g = g
        self.prev_qi = prev_qi
        self.has_prev = has_prev
        self.cfg = cfg

    @gluon.jit
    def k_wait(self, j):
        u = self.g + j
        self.bufs.ring.wait_ready(u)
        return self.cfg.k_view(self.bufs.k_smem, self.bufs.ring.slot(u))

    @gluon.jit
    def v_wait(self, j, AFTER_K: gl.constexpr):
        u = self.g + j
        if not AFTER_K:  # the last unit: V_{n-1} alone (its K block, if any, is a partner's)
            self.bufs.ring.wait_ready(u)
        return self.cfg.v_view(self.bufs.v_smem, self.bufs.ring.slot(u))

    @gluon.jit
    def first_issued(self):
        # QBUF 2: waiting for the previous tile's O store costs nothing while S_0 runs
        if self.cfg.QBUF == 2:
            _q_release(self.bufs.q_empty, self.prev_qi, self.has_prev)

    @gluon.jit
    def k_done(self, j, ALONE: gl.constexpr):
        if ALONE:  # unit g: K_0 alone
            self.bufs.ring.release(self.g + j)

    @gluon.jit
    def v_done(self, j):
        self.bufs.ring.release(self.g + j)


@gluon.jit
def _persist_consumer(args, bufs, cfg, ME: gl.constexpr):
    """Consumer warpgroup ME (0: the default partition, then workers 0 .. CONSUMERS - 2): part ME
    of each of this CTA's tiles. The k-th tile's Q is in buffer (k % QBUF) * CONSUMERS + ME, phase
    ring_phase(k, QBUF); the tile's K/V ring units g .. g + n_blocks, then the epilogue, whose O store
    is left in flight (QBUF 2: its buffer goes back during the next tile, or is waited for at the very end)."""
    QBUF: gl.constexpr = cfg.QBUF
    CONSUMERS: gl.constexpr = cfg.CONSUMERS
    q_empty = bufs.q_empty
    seqlen_q = args.seqlen_q
    seqlen_k = args.seqlen_k
    sched = persist_schedule(args, cfg)
    n_my = sched.my_tiles()
    qk_scale = _qk_scale(args.sm_scale)
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = sched.tile_coords(it)
        start_m = cta_m + ME * cfg.BLOCK_M
        n_blocks, mask_from = _tile_blocks(start_m, args, cfg)
        n_max = sched.max_blocks(cta_m)
        qi = _q_buffer(it, ME, QBUF, CONSUMERS)
        prev_qi = _q_buffer(it + 1, ME, QBUF, CONSUMERS)  # QBUF 2: the previous tile's buffer
        mbarrier.wait(bufs.q_ready.index(qi), ring_phase(it, QBUF))
        if n_blocks > 0:
            lse_row0 = off_b.to(gl.int64) * args.stride_lse_b + off_h.to(gl.int64) * args.stride_lse_h
            o_col = off_h * cfg.HEAD_DIM_V
            loads = _PersistLoads(bufs, g, prev_qi, it > 0, cfg)
            sink2 = _sink2(args.Sinks, off_h, cfg.SINK)
            if cfg.FP8:  # the tile's (batch, kv head) descales
                off_hk = off_h // args.group_size
                tile_scale = _qk_scale(args.fp8.score_scale(args.sm_scale, off_b, off_hk))
                v_scale = args.fp8.value_scale(off_b, off_hk)
                sm = OnlineSoftmax(tile_scale, start_m, seqlen_k, seqlen_k - seqlen_q, sink2, cfg, v_scale)
            else:
                sm = OnlineSoftmax(qk_scale, start_m, seqlen_k, seqlen_k - seqlen_q, sink2, cfg)
            q_op = cfg.q_view(bufs.q_smem, qi)
            acc, m_i, l_i = _attn_tile(q_op, loads, sm, n_blocks, mask_from)
            # O through this tile's Q buffer (FP8: the consumer's O buffer), the store not waited for here
            o_op, o_buf = cfg.out_buffer(q_op[0], bufs.q_smem[0].index(qi), bufs.o_smem, ME)
            _epilogue(acc, m_i, l_i, sm, args, lse_row0, off_b, o_col, o_op, o_buf, False)
            if QBUF == 1:
                _q_release(q_empty, qi, True)
        else:  # this part lies past seqlen_q or before row 0: nothing to compute, nothing stored
            if QBUF == 2:
                _q_release(q_empty, prev_qi, it > 0)
            else:
                mbarrier.arrive(q_empty.index(qi))
        # after the epilogue: the units past this part's last (unit n_blocks, or none when it has no block)
        _skip_units(bufs.ring, g, n_blocks + (n_blocks > 0).to(gl.int32), n_max + 1)
        g += n_max + 1
    tma.store_wait(pendings=0)


@gluon.jit
def _persist_produce(args, bufs, cfg, u, j, n_max, off_b, k_col, v_col):
    """Ring unit u, the tile's j-th (0 <= j <= n_max): K_j unless j == n_max, V_{j-1} unless j == 0.
    Wait until every consumer released the stage's previous unit (u - STAGES), then TMA both blocks
    onto the stage's one ready barrier (K, k_smem: alloc_parts' pairs)."""
    K = args.k_desc
    V = args.V
    ring = bufs.ring
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
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
    load_parts(K, off_b, j * BLOCK_N, k_col, bar, bufs.k_smem, stage, has_k, HEAD_DIM)
    cfg.v_load(V, off_b, j - 1, v_col, bar, bufs.v_smem, stage, has_v)


@gluon.jit
def _persist_producer(args, bufs, cfg):
    """One warp, per tile: ring unit 0 (K_0), Q_0 .. Q_{CONSUMERS-1} (each once its buffer is free),
    then units 1 .. n: (K_1, V_0), (K_2, V_1), ..., (V_{n-1}) (n = the longest part's block count)."""
    Q = args.q_desc
    seqlen_q = args.seqlen_q
    QBUF: gl.constexpr = cfg.QBUF
    CONSUMERS: gl.constexpr = cfg.CONSUMERS
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    sched = persist_schedule(args, cfg)
    n_my = sched.my_tiles()
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = sched.tile_coords(it)
        # >= 1: the tile's last part starts in [0, seqlen_q) (tile_coords' shift leaves it there)
        n_max = sched.max_blocks(cta_m)
        q_col = off_h * HEAD_DIM
        k_col = (off_h // args.group_size) * HEAD_DIM
        v_col = (off_h // args.group_size) * cfg.HEAD_DIM_V
        # K_0 first: its stage held a block of an earlier tile, so this wait never needs this tile's
        # Q (no deadlock), and with QBUF 1 only the Q load's latency is exposed per tile
        _persist_produce(args, bufs, cfg, g, 0, n_max, off_b, k_col, v_col)
        for t in gl.static_range(CONSUMERS):
            qi = _q_buffer(it, t, QBUF, CONSUMERS)
            mbarrier.wait(bufs.q_empty.index(qi), ring_phase(it, QBUF) ^ 1)
            bar = bufs.q_ready.index(qi)
            row = cta_m + t * cfg.BLOCK_M
            valid = (row >= 0) & (row < seqlen_q)
            mbarrier.expect(bar, parts_nbytes(Q, HEAD_DIM), pred=valid)
            load_parts(Q, off_b, row, q_col, bar, bufs.q_smem, qi, valid, HEAD_DIM)
            # an empty part: its consumer only waits and hands back
            mbarrier.arrive(bar, pred=(row < 0) | (row >= seqlen_q))
        for j in range(1, n_max + 1):
            _persist_produce(args, bufs, cfg, g + j, j, n_max, off_b, k_col, v_col)
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
    QBUF: gl.constexpr,
    SNAKE: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """Grid: min(#SMs, cdiv(seqlen_q, CONSUMERS * BLOCK_M) * batch * nheads) CTAs; launched with
    num_warps=4 (the default partition; the compiler adds the workers' warps). CONSUMERS 2 or 3
    consumer warpgroups (_CONSUMER_REGS registers each for 2, _CONSUMER3_REGS for 3), one producer warp. QLo,
    KLo: descriptors of q's and k's second head-dim part (FwdConfig), None for a power of two. (The integer
    arguments stay apart, not tuples: do_not_specialize does not reach a tuple's elements.) FP8 (e4m3 Q, K, V;
    FwdConfig): V is a descriptor of V^T (batch, kv heads * HEAD_DIM_V, keys), Out bf16; the descales and their
    strides (Fp8Scales, a variant per stride of 1) None for 16-bit inputs."""
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
        CONSUMERS=CONSUMERS,
        QBUF=QBUF,
        SNAKE=SNAKE,
    )
    NQ: gl.constexpr = QBUF * CONSUMERS
    q_desc, k_desc = part_descs(Q, QLo, HEAD_DIM), part_descs(K, KLo, HEAD_DIM)
    q_smem = alloc_parts(q_desc, NQ, BLOCK_M, HEAD_DIM)
    k_smem = alloc_parts(k_desc, STAGES, BLOCK_N, HEAD_DIM)
    v_smem, o_smem = alloc_v_and_o(V, Out, cfg, STAGES)
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
    bufs = PersistBuffers(
        q_smem=q_smem,
        k_smem=k_smem,
        v_smem=v_smem,
        q_ready=q_ready,
        q_empty=q_empty,
        ring=Ring(ready, empty, STAGES),
        o_smem=o_smem,
    )
    # (a list per count: a Gluon kernel cannot build one from CONSUMERS, nor hold a function in a tuple)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_persist_consumer, (args, bufs, cfg, _CONSUMER0)),
                (_persist_consumer, (args, bufs, cfg, _CONSUMER1)),
                (_persist_producer, (args, bufs, cfg)),
            ],
            [CONSUMER_WARPS, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )
    else:
        gl.static_assert(CONSUMERS == 3, "the persistent forward has 2 or 3 consumer warpgroups")
        gl.warp_specialize(
            [
                (_persist_consumer, (args, bufs, cfg, _CONSUMER0)),
                (_persist_consumer, (args, bufs, cfg, _CONSUMER1)),
                (_persist_consumer, (args, bufs, cfg, _CONSUMER2)),
                (_persist_producer, (args, bufs, cfg)),
            ],
            [CONSUMER_WARPS, CONSUMER_WARPS, 1],
            [_CONSUMER3_REGS, _CONSUMER3_REGS, _PRODUCER_REGS],
        )
