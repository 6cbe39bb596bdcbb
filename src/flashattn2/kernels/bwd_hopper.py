"""FlashAttention-2 backward for Hopper (sm_90a), written in Gluon: 5 matmuls per block pair.

One program = one key block (BLOCK_N rows) of one (batch, kv head); it loops over the query heads
of its group and, for each, over the query blocks (BLOCK_M rows) that see the key block
(FlashAttention-3's headdim-128 arrangement: S and dP not transposed, P and dS through shared
memory):
    S    = Q K^T          [BLOCK_M, BLOCK_N]   A = Q (smem),  B = K^T (permuted smem view)
    dP   = dO V^T         [BLOCK_M, BLOCK_N]   A = dO (smem), B = V^T (permuted smem view)
    P    = exp2(S * scale * log2e - lse * log2e);  dS = P * (dP * scale - delta * scale)
    dV  += P^T dO         [BLOCK_N, D]         A = P^T (permuted view of P in smem), B = dO
    dQ_i = dS K           [BLOCK_M, D]         A = dS (smem), B = K (smem)
    dK  += dS^T Q         [BLOCK_N, D]         A = dS^T (permuted view of dS in smem), B = Q
dQ_i is added into an fp32 accumulator (batch, seqlen_q_pad, nheads, headdim) that the host zeroes
and casts into dq afterwards: by TMA bulk reduce-add (DQ_MODE 0; Gluon 3.6 has the builder call,
wrapped below as `tma_reduce_add`) or by atomics (1: from the wgmma layout, 2: 4 floats per
thread). The adds arrive in any order: ops.attention takes this kernel for deterministic=False
only (flash_attn's default). The softmax scale is folded into dS, so dK and dQ need no scaling.

Schedule of one query block (async wgmmas complete in issue order):
    issue S, issue dP; wait S -> P (causal mask on crossing blocks) -> smem while dP runs;
    issue dV; wait dP -> dS -> smem while dV runs; issue dQ_i, issue dK;
    wait dV, dQ_i -> dQ_i added while dK runs; wait dK -> refill this Q/dO ring stage (TMA).
Q and dO come by TMA through STAGES-deep rings (one mbarrier per stage for both); K and V once,
their buffers take dK and dV at the end (TMA stores).
Tails: Q, dO, K, V rows past a sequence's end are zero-filled by TMA; the host pads lse (+inf) and
delta (0) up to seqlen_q_pad = cdiv(seqlen_q, BLOCK_M) * BLOCK_M, so padded query rows get
P = dS = 0 with no mask in the loop (masks there cost spills at headdim 128/256); keys past
seqlen_k add nothing to dQ (K = 0 there, dP = 0) and their dK/dV rows are clipped by the stores.
GQA / MQA: one flat loop over (query head, query block) whose ring runs on across heads; dK/dV
accumulate over the group in registers. Causal is bottom-right aligned.
OPAQUE_KV: K and V are indexed through a zero LLVM cannot fold; otherwise it hoists the ~24 loop-
invariant wgmma descriptors of K and V out of the loop and headdim 128 spills ~240 bytes.
"""
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

LOG2E = gl.constexpr(1.4426950408889634)
DQ_MODES = {"tma": 0, "atomic": 1, "atomic4": 2}


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of the shared-memory tile `src` into tensor_desc at coord (cp.reduce.async.bulk.tensor
    .add): asynchronous, tracked like a TMA store (tma.store_wait). Gluon 3.6 exposes the builder call only."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _qdo_load(t, stage, i, hq, total, off_b, i_end, n_iter, Q, DO, qdo_bars, q_smem, do_smem, BLOCK_M: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr):
    """Loads Q and dO of position t into ring stage `stage` (= t % STAGES). Without GQA: query
    block i of head hq, if i < i_end.
    GQA: t is a flat position over (head, query block), head-major, loaded if t < total; (i, hq) is the position
    t - STAGES plus STAGES blocks, not yet wrapped: wrapping past i_end moves on to the next head's first block (at
    most STAGES wraps, as n_iter >= 1 whenever t < total; no division)."""
    if GQA:
        for _ in gl.static_range(STAGES):
            wrap = i >= i_end
            i = gl.where(wrap, i - n_iter, i)
            hq = gl.where(wrap, hq + 1, hq)
        pred = t < total
    else:
        pred = i < i_end
    # (one expect for both copies: the CTA barrier membar puts before the first copy, for the stage's readers, then
    # also separates the expect from the next waits, which membar would otherwise fence with one more barrier)
    mbarrier.expect(qdo_bars.index(stage), 2 * Q.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(Q, [off_b, i * BLOCK_M, hq * HEAD_DIM], qdo_bars.index(stage),
                                    q_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(DO, [off_b, i * BLOCK_M, hq * HEAD_DIM], qdo_bars.index(stage),
                                    do_smem.index(stage), pred=pred)


@gluon.jit
def _bwd_step(it, i, hq, i_end, n_iter, total, dk, dv, k_smem, v_smem, q_smem, do_smem, qdo_bars, p_smem, ds_smem,
              dq_smem, Q, DO, DQ, Lse, Delta, off_lse, off_b, nheads, start_n, diag,
              qk_scale, sm_scale, masked, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr, OPAQUE_KV: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              GQA: gl.constexpr, s_layout: gl.constexpr, dq_layout: gl.constexpr, q_tile: gl.constexpr,
              kv_tile: gl.constexpr, dq_tile: gl.constexpr):
    """Flat position it (ring slot it % STAGES) = query block i of query head hq against this program's key block;
    returns (dk, dv)."""
    dtype: gl.constexpr = k_smem.dtype
    stage = it % STAGES
    phase = (it // STAGES) & 1
    start_m = i * BLOCK_M
    col = hq * HEAD_DIM

    # lse (natural log) and delta of the BLOCK_M query rows (2 rows per thread); in flight during the waits. Rows past
    # seqlen_q (the zero-filled tail of the last block): no mask, the host pads lse with +inf and delta with 0 up to
    # a multiple of BLOCK_M -> P = 0 -> dS = 0, no contribution anywhere (masks here cost spills at headdim 128/256)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_l)
    lse2 = gl.load(Lse + off_lse + offs_m) * LOG2E
    delta_s = gl.load(Delta + off_lse + offs_m) * sm_scale

    # K and V viewed through an index the compiler cannot fold (0, from inline asm on the loop counter): otherwise
    # LLVM hoists the ~24 loop-invariant 64-bit wgmma smem descriptors of K and V out of the loop into registers,
    # which spills at headdim 128
    if OPAQUE_KV:
        z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [it], dtype=gl.int32, is_pure=True, pack=1)
    else:
        z = 0
    k_op = k_smem.index(z)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    v_op = v_smem.index(z)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)

    # S = Q K^T and dP = dO V^T, both issued before any wait (each warpgroup: all BLOCK_M rows, its share of keys)
    mbarrier.wait(qdo_bars.index(stage), phase)  # Q and dO of this stage (one barrier for both: fewer CTA barriers)
    q_op = q_smem.index(stage)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q_tile)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    do_op = do_smem.index(stage)._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q_tile)
    dp_tok = warpgroup_mma(do_op, v_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)

    # S ready (dP may still run): P -> smem, then dV += P^T dO issued (A = P^T, a permuted view: MN-major A).
    # Keys past seqlen_k (zero-filled K / V rows of the last key block) are not masked: S = 0 there, dP = 0 and
    # K = 0, so they add nothing to dQ_i = dS K, and their own dK / dV rows are clipped by the stores -- as long as
    # P stays finite: exp(0 - lse) overflows for a row with lse < -88 and inf * 0 would put NaN into dQ. Hence the
    # exponent is capped at 0 (P <= 1, which the visible keys satisfy up to rounding) instead of a mask, which
    # costs spills at headdim 128 (a runtime branch in the non-causal loop: 56 bytes).
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    p = gl.exp2(gl.minimum(s * qk_scale - lse2[:, None], 0.0))
    if CAUSAL:
        if masked:  # crossing the causal diagonal: key j visible to query i iff j <= i + diag
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(offs_n[None, :] <= offs_m[:, None] + diag, p, 0.0)
    p_smem.store(p.to(dtype))
    fence_async_shared()  # generic-proxy stores -> wgmma (async proxy) reads; the CTA barrier comes from membar
    if DQ_MODE == 0:
        # the previous iteration's dQ reduce has read the staging tile (waited by the issuing thread); membar puts a
        # CTA barrier right after this wait, which also serves P -> dV (hence after the fence: one barrier, not two)
        tma.store_wait(pendings=0)
    dv_tok = warpgroup_mma(p_smem.permute((1, 0)), do_op, dv, is_async=True)

    # dP ready (dV may still run): dS = P * (dP - delta), scaled by sm_scale -> smem
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))
    ds = p * (dp * sm_scale - delta_s[:, None])
    ds_smem.store(ds.to(dtype))
    fence_async_shared()
    # dQ_i = dS K (A = dS, B = K: MN-major B) first, so that it completes before dK += dS^T Q
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    dq_tok = warpgroup_mma(ds_smem, k_op, dq_zero, use_acc=False, is_async=True)
    dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), q_op, dk, is_async=True)

    # dV and dQ_i ready (dK may still run): dQ_i into the fp32 global accumulator, whose rows the host pads up to a
    # multiple of BLOCK_M (rows past seqlen_q get dS = 0, i.e. zeros: no mask)
    dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dq_tok))
    if DQ_MODE == 0:
        dq_2d = dq_smem._reinterpret(gl.float32, [BLOCK_M, HEAD_DIM], dq_tile)
        dq_2d.store(dq)
        fence_async_shared()
        tma_reduce_add(DQ, [off_b, start_m, col], dq_smem)
    else:
        if DQ_MODE == 2:
            NW: gl.constexpr = gl.num_warps()
            add_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // HEAD_DIM, HEAD_DIM // 4], [NW, 1], [1, 0])
            dq = gl.convert_layout(dq, add_layout)
        else:
            add_layout: gl.constexpr = dq_layout
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, add_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, add_layout))
        # DQ: fp32 (batch, seqlen_q_pad, nheads, HEAD_DIM) contiguous, already offset to this (batch, query head)
        ptrs = DQ + start_m.to(gl.int64) * (nheads * HEAD_DIM) + (rows * (nheads * HEAD_DIM))[:, None] + cols[None, :]
        gl.atomic_add(ptrs, dq, sem="relaxed")

    # dK ready: every wgmma reading this Q/dO stage is done; refill it with flat position it + STAGES (the next
    # query head's blocks once this head's are exhausted)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, ))
    _qdo_load(it + STAGES, stage, i + STAGES, hq, total, off_b, i_end, n_iter, Q, DO, qdo_bars, q_smem, do_smem,
              BLOCK_M, HEAD_DIM, STAGES, GQA)
    return dk, dv


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """wgmma accumulator layout for a [rows, cols] tile: warps stacked along the rows (16 each) as far as they go,
    the remaining warpgroups splitting the columns."""
    wm = min(num_warps, rows // 16)
    wn = num_warps // wm
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, cols // wn, 16])


# the integer arguments are not specialised (== 1, % 16): one compilation per configuration whatever the shapes
_INT_ARGS = ["seqlen_q", "seqlen_k", "seqlen_q_pad", "nheads", "nheads_k", "stride_lb", "stride_lh"]


@gluon.jit(do_not_specialize=_INT_ARGS)
def attn_bwd_hopper_kernel(Q, K, V, DO, DK, DV, DQ, Lse, Delta, sm_scale, seqlen_q, seqlen_k, seqlen_q_pad, nheads,
                           nheads_k, stride_lb, stride_lh, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                           OPAQUE_KV: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype
    # wgmma accumulators. S / dP [BLOCK_M, BLOCK_N]: with BLOCK_M = 64 and 8 warps, warps_per_cta = [4, 2]: each
    # warpgroup holds all query rows and half of the keys. dK / dV [BLOCK_N, D]: warps stacked along the keys
    # ([8, 1] for BLOCK_N = 128: each warpgroup owns the same half of the keys as in S). dQ_i [BLOCK_M, D]: [4, 2],
    # the warpgroups split headdim.
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    kv_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    dq_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_DIM, num_warps)
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    p_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    dq_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)

    pid_n = gl.program_id(0)  # causal: key block 0 sees the most query blocks, and goes first
    pid_bh = gl.program_id(1)  # (batch, kv head)
    off_b = pid_bh // nheads_k
    off_hk = pid_bh % nheads_k
    group = nheads // nheads_k  # GQA / MQA: query heads h0 .. h0 + group - 1 share this kv head
    h0 = off_hk * group
    col_k = off_hk * HEAD_DIM
    start_n = pid_n * BLOCK_N
    qk_scale = sm_scale * LOG2E

    # query blocks [i_first, i_end) of every query head of the group: those before i_full cross the diagonal
    # (masked), the rest see the whole key block. The last query block may be partial (rows past seqlen_q: TMA
    # zero-fill, lse = +inf); the last key block too (rows past seqlen_k: zero-fill, clipped stores).
    n_m = gl.cdiv(seqlen_q, BLOCK_M)
    diag = seqlen_k - seqlen_q
    i_first = 0
    i_full = 0
    if CAUSAL:
        x = gl.maximum(start_n - diag, 0)  # first query row that sees key start_n
        i_first = gl.minimum(x // BLOCK_M, n_m)
        i_full = gl.maximum(gl.minimum((gl.maximum(start_n + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M, n_m),
                            i_first)
    i_end = n_m
    n_iter = i_end - i_first
    total = group * n_iter  # flat positions (head, query block), head-major: the Q / dO ring runs across heads

    # shared memory: K, V (later dK, dV), Q / dO rings, P and dS, the fp32 dQ staging tile (TMA mode), barriers
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], K.layout)  # [1, ...]: see OPAQUE_KV
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], V.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, HEAD_DIM], Q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, HEAD_DIM], DO.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_tile)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_tile)
    if DQ_MODE == 0:
        dq_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, HEAD_DIM], DQ.layout)
    else:
        dq_smem = ds_smem  # unused
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(qdo_bars.index(s), count=1)
    fence_async_shared()

    # prologue: K and V (one barrier), the first STAGES flat positions of Q and dO
    mbarrier.expect(kv_bar, 2 * K.block_type.nbytes)
    tma.async_copy_global_to_shared(K, [off_b, start_n, col_k], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(V, [off_b, start_n, col_k], kv_bar, v_smem.index(0))
    for s in gl.static_range(STAGES):
        _qdo_load(s, s, i_first + s, h0, total, off_b, i_end, n_iter, Q, DO, qdo_bars, q_smem, do_smem, BLOCK_M,
                  HEAD_DIM, STAGES, GQA)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)

    # the group's query heads, each: one loop over the query blocks; causal: those before i_full cross the diagonal
    # and are masked (a runtime flag: two specialised loops, masked then unmasked, double the code and spill at
    # headdim 128). dK / dV accumulate over the whole group in registers (deterministic).
    # lse, delta: (batch, nheads, seqlen_q_pad) fp32 with the same strides, seqlen stride 1: one offset for both
    off_lse = off_b.to(gl.int64) * stride_lb + h0.to(gl.int64) * stride_lh
    if DQ_MODE == 0:
        dq_h = DQ  # the descriptor; coordinates (off_b, start_m, hq * HEAD_DIM)
    else:  # a pointer to row 0 of (off_b, h0) in the fp32 accumulator (batch, seqlen_q_pad, nheads, HEAD_DIM)
        dq_h = DQ + (off_b.to(gl.int64) * seqlen_q_pad * nheads + h0) * HEAD_DIM
    if GQA:
        # flat loop over (query head, query block), head-major: the ring's stage / phase run on across heads, and the
        # refills prefetch the next head's first blocks (a nested loop over heads costs registers: spills at d128)
        i = i_first
        hq = h0
        for it in range(0, total):
            dk, dv = _bwd_step(it, i, hq, i_end, n_iter, total, dk, dv, k_smem, v_smem, q_smem, do_smem, qdo_bars,
                               p_smem, ds_smem, dq_smem, Q, DO, dq_h, Lse, Delta, off_lse, off_b, nheads, start_n,
                               diag, qk_scale, sm_scale, i < i_full, CAUSAL, DQ_MODE, OPAQUE_KV, HEAD_DIM, BLOCK_M,
                               BLOCK_N, STAGES, GQA, s_layout, dq_layout, q_tile, kv_tile, dq_tile)
            i += 1
            wrap = i == i_end
            i = gl.where(wrap, i_first, i)
            hq = gl.where(wrap, hq + 1, hq)
            off_lse = gl.where(wrap, off_lse + stride_lh, off_lse)
            if DQ_MODE != 0:
                dq_h = gl.where(wrap, dq_h + HEAD_DIM, dq_h)
    else:
        for i in range(i_first, i_end):
            dk, dv = _bwd_step(i - i_first, i, h0, i_end, n_iter, total, dk, dv, k_smem, v_smem, q_smem, do_smem,
                               qdo_bars, p_smem, ds_smem, dq_smem, Q, DO, dq_h, Lse, Delta, off_lse, off_b, nheads,
                               start_n, diag, qk_scale, sm_scale, i < i_full, CAUSAL, DQ_MODE, OPAQUE_KV, HEAD_DIM,
                               BLOCK_M, BLOCK_N, STAGES, GQA, s_layout, dq_layout, q_tile, kv_tile, dq_tile)

    mbarrier.invalidate(kv_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(qdo_bars.index(s))

    # epilogue: dK (already scaled through dS) and dV via the K / V buffers (every wgmma reading them is done);
    # rows past seqlen_k are clipped by the TMA stores
    k_op = k_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    v_op = v_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    k_op.store(dk.to(dtype))
    v_op.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(DK, [off_b, start_n, col_k], k_smem.index(0))
    tma.async_copy_shared_to_global(DV, [off_b, start_n, col_k], v_smem.index(0))
    tma.store_wait(pendings=0)  # also drains the last dQ reduce
