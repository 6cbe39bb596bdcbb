"""The Gluon backward's MMA partition (kernels/bwd_hopper.py's default partition, two warpgroups): the loop over flat
positions (_ws_mma), one position's five matmuls and score arithmetic (_ws_step, its inputs BwdScores), dQ_i's
staging for the writer (_stage_dq), and the dK / dV epilogue."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .bwd_hopper_config import _ws_program
from .pipeline import Scalar, aggregate, reinterpret, tma_store

LOG2E = gl.constexpr(1.4426950408889634)


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
def _ws_mma(args, bufs, cfg):
    """The default partition (8 warps: two MMA warpgroups): the loop over flat positions and the epilogue. Layouts
    (BwdConfig): S / dP [BLOCK_M, BLOCK_N] with BLOCK_M = 64: warps_per_cta [4, 2], each warpgroup all query rows
    and half of the keys; dK / dV [BLOCK_N, D]: warps stacked along the keys (each warpgroup the same half of the
    keys as in S); dQ_i [BLOCK_M, D // DQ_SPLIT]: [4, 2], the warpgroups split its columns. dK's descriptors, K's
    and Q's buffers: head-dim part pairs (kernels/pipeline.py)."""
    k_smem = bufs.k_smem
    v_smem = bufs.v_smem
    dtype: gl.constexpr = v_smem.dtype
    HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
    HEAD_DIM_V: gl.constexpr = cfg.HEAD_DIM_V
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    DQ_SPLIT: gl.constexpr = cfg.DQ_SPLIT
    sm_scale = args.sm_scale
    stride_lh = args.stride_lh

    off_b, off_hk, h0, start_n, i_first, i_full, i_end, total = _ws_program(args, cfg)
    col_k = off_hk * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    diag = args.seqlen_k - args.seqlen_q
    off_lse = off_b.to(gl.int64) * args.stride_lb + h0.to(gl.int64) * stride_lh
    sc = BwdScores(args.Lse, args.Delta, qk_scale, sm_scale, diag, start_n)

    HI: gl.constexpr = cfg.HEAD_DIM_HI
    LO: gl.constexpr = cfg.HEAD_DIM_LO
    if LO > 0:  # dK in two parts (_ws_step)
        dk = (gl.zeros([BLOCK_N, HI], gl.float32, cfg.kv_layout), gl.zeros([BLOCK_N, LO], gl.float32, cfg.k_lo_layout))
    else:
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, cfg.kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM_V], gl.float32, cfg.v_layout)
    dq_prev = gl.zeros([BLOCK_M, cfg.DQ_W1], gl.float32, cfg.dq1_layout)  # (DQ_SPLIT 2: see _ws_step)
    mbarrier.wait(bufs.kv_bar, 0)
    # lse, delta: (batch, nheads, seqlen_q_pad) fp32 with the same strides, seqlen stride 1: one offset for both.
    # GQA / MQA: one flat loop over (query head, query block), head-major: the ring's stage / phase run on across
    # heads (a nested loop over heads costs registers); dK / dV accumulate over the whole group (deterministic)
    if cfg.GQA:
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
    tma_store(args.dk_desc[0], [off_b, start_n, col_k], k_smem[0].index(0))
    if LO > 0:
        tma_store(args.dk_desc[1], [off_b, start_n, col_k + HI], k_smem[1].index(0))
    col_v = col_k
    if HEAD_DIM_V != HEAD_DIM:
        col_v = off_hk * HEAD_DIM_V
    tma_store(args.DV, [off_b, start_n, col_v], v_smem.index(0))
    tma.store_wait(pendings=0)
