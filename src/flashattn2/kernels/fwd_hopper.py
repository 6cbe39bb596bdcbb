"""FlashAttention-2 forward for Hopper (sm_90a), written in Gluon (Triton's lower-level dialect).

Same arithmetic as kernels/fwd.py (online softmax in base 2, an unscaled fp32 accumulator divided
by the row sum once at the end, logsumexp stored), but scheduled by hand, which plain Triton 3.6
does not do: Triton waits for each wgmma right after issuing it, so the tensor cores idle while a
warpgroup computes its softmax. Here the QK^T of key block j and the PV of block j-1 are issued
together as asynchronous wgmmas; the softmax of block j runs while PV(j-1) is still on the tensor
cores (FlashAttention-3's intra-warpgroup pipelining). K and V arrive by TMA into STAGES-deep
shared-memory rings, one mbarrier per stage; a stage is refilled as soon as the wgmma that read it
has been waited for.

Three kernels: attn_fwd_hopper_kernel, one program = one query block run by its warps (one or two
warpgroups); attn_fwd_ws_kernel (below), warp-specialized: a producer warp loads, two consumer
warpgroups compute one query block each (FlashAttention-3's arrangement); attn_fwd_persist_kernel
(last), the warp-specialized kernel made persistent. ops.attention takes the persistent kernel at
headdim 64 and 128 (config.gluon_persist) and the warp-specialized one at headdim 256
(config.gluon_ws); the others where overrides ask for them.

attn_fwd_persist_kernel: the same partitions and numerics as attn_fwd_ws_kernel (no ping-pong), with
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
No softcap, ALiBi, window or dropout (ops.attention sends those to kernels/fwd.py). Causal is
bottom-right aligned (row i sees keys j <= i + seqlen_k - seqlen_q); a query block that sees no key
gets output 0 and logsumexp +inf, as in kernels/fwd.py.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def _acc_layout(cols, num_warps):
    """wgmma accumulator layout of a [rows, cols] tile whose warps each own 16 rows (S: cols =
    BLOCK_N, O: cols = HEAD_DIM). (Called from a warp_specialize partition, its arguments arrive as
    constexpr wrappers: unwrapped first.)"""
    cols, num_warps = (getattr(x, "value", x) for x in (cols, num_warps))
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _load(desc, off_b, row, col, bars, bufs, stage, pred):
    """TMA of rows [row, row + BLOCK) of batch entry off_b, columns [col, col + HEAD_DIM), into ring
    stage `stage`; its mbarrier expects the tile's bytes."""
    bar = bars.index(stage)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [off_b, row, col], bar, bufs.index(stage), pred=pred)


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
def _epilogue(acc, m_i, l_i, Out, Lse, lse_row0, off_b, q_col, start_m, seqlen_q, q_op, q_buf,
              BLOCK_M: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr, WAIT: gl.constexpr):
    """The logsumexp (natural log) and O = acc / l, through the Q tile's buffer (every wgmma that
    read Q has been waited for) and a TMA store that clips rows past seqlen_q, waited for if WAIT
    (the persistent kernel hands the buffer back later). A row that sees no key: output 0 and
    logsumexp +inf (flash-attn 2's convention)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(Lse + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
    o = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
    q_op.store(o.to(q_op.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(Out, [off_b, start_m, q_col], q_buf)
    if WAIT:
        tma.store_wait(pendings=0)


@gluon.jit
def _qk_scale(sm_scale):
    """The scores' scale in base 2, at least 1e-30: softmax_scale 0 (allowed, >= 0 is checked) would
    make a masked score's -inf * 0 a NaN in _softmax's folded FMA; at 1e-30 every exp2 still rounds
    to 1 in fp32 and the logsumexp moves by under 1e-24, i.e. softmax_scale 0's results."""
    return gl.maximum(sm_scale * LOG2E, 1e-30)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, start_m, start_n, seqlen_k, diag, masked, CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One online-softmax step on raw scores s: (p, alpha, m, l); qk_scale > 0 (_qk_scale). In
    both paths the scale is folded into one FMA and the max taken before scaling. `masked`
    (constexpr, or a runtime flag for block 0): the block crosses the causal diagonal or the end of
    the keys; its invisible scores become -inf (one compare of the column against a per-row limit
    and one select per score) and a row that has seen no key yet keeps m = -inf, shifted by 0 so
    that exp2 gives 0, not NaN."""
    if masked:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:  # the last visible column of each row, relative to the block
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            last = gl.minimum(rows + diag, seqlen_k - 1) - start_n
            visible = cols[None, :] <= last[:, None]
        else:
            visible = cols[None, :] < seqlen_k - start_n
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
def _step(acc, p_op, m_i, l_i, q_op, K, V, k_smem, v_smem, k_bars, v_bars, s_zero, j, n_blocks, off_b, kv_col,
          qk_scale, start_m, seqlen_k, diag, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
          p_layout: gl.constexpr, row_o: gl.constexpr, kv_tile: gl.constexpr):
    """Key block j >= 1: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; wait for S_j only and run its
    softmax while PV is on the tensor cores; then wait for PV, refill the two freed ring stages and
    rescale O to the new row max. Returns (acc, P_j as the next PV's operand, m, l)."""
    dtype: gl.constexpr = q_op.dtype
    ks = j % STAGES
    mbarrier.wait(k_bars.index(ks), (j // STAGES) & 1)
    k_op = k_smem.index(ks)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    vs = (j - 1) % STAGES
    mbarrier.wait(v_bars.index(vs), ((j - 1) // STAGES) & 1)
    v_op = v_smem.index(vs)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)  # acc is in the scale of m_{j-1}
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # S_j done; PV_{j-1} may still run
    _load(K, off_b, (j + STAGES) * BLOCK_N, kv_col, k_bars, k_smem, ks, j + STAGES < n_blocks)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, seqlen_k, diag, MASKED, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_next = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    _load(V, off_b, (j - 1 + STAGES) * BLOCK_N, kv_col, v_bars, v_smem, vs, j - 1 + STAGES < n_blocks)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return acc, p_next, m_i, l_i


@gluon.jit
def attn_fwd_hopper_kernel(Q, K, V, Out, Lse, stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k,
                           group_size, sm_scale,
                           CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = Q.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # wgmma accumulators: S = Q K^T [BLOCK_M, BLOCK_N] and O [BLOCK_M, HEAD_DIM]; each warp owns 16 rows
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    off_b, off_h, start_m = _program_tile(batch, nheads, seqlen_q, CAUSAL, BLOCK_M)
    q_col = off_h * HEAD_DIM
    kv_col = (off_h // group_size) * HEAD_DIM
    qk_scale = _qk_scale(sm_scale)
    diag = seqlen_k - seqlen_q
    n_blocks, mask_from = _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)

    # shared memory: the Q tile (reused for O), K and V rings, one mbarrier per buffer
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, HEAD_DIM], Q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], K.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], V.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation, visible to TMA

    mbarrier.expect(q_bar, Q.block_type.nbytes)
    tma.async_copy_global_to_shared(Q, [off_b, start_m, q_col], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load(K, off_b, i * BLOCK_N, kv_col, k_bars, k_smem, i, i < n_blocks)
        _load(V, off_b, i * BLOCK_N, kv_col, v_bars, v_smem, i, i < n_blocks)
    q_op = q_smem._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q_tile)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

    # block 0: S = Q K_0^T, waited; its softmax
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    k_op = k_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    _load(K, off_b, STAGES * BLOCK_N, kv_col, k_bars, k_smem, 0, STAGES < n_blocks)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, 0, seqlen_k, diag, mask_from == 0, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    # block j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together; the softmax of S_j overlaps
    # PV; the blocks that need no mask first, then those that do (no branch in the hot loop)
    for j in range(1, gl.maximum(mask_from, 1)):
        acc, p_op, m_i, l_i = _step(acc, p_op, m_i, l_i, q_op, K, V, k_smem, v_smem, k_bars, v_bars, s_zero, j,
                                    n_blocks, off_b, kv_col, qk_scale, start_m, seqlen_k, diag, False, CAUSAL,
                                    HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, s_layout, p_layout, row_o, kv_tile)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        acc, p_op, m_i, l_i = _step(acc, p_op, m_i, l_i, q_op, K, V, k_smem, v_smem, k_bars, v_bars, s_zero, j,
                                    n_blocks, off_b, kv_col, qk_scale, start_m, seqlen_k, diag, True, CAUSAL,
                                    HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, s_layout, p_layout, row_o, kv_tile)

    # the last block's PV
    vs = (n_blocks - 1) % STAGES
    mbarrier.wait(v_bars.index(vs), ((n_blocks - 1) // STAGES) & 1)
    v_op = v_smem.index(vs)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    lse_row0 = off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h
    _epilogue(acc, m_i, l_i, Out, Lse, lse_row0, off_b, q_col, start_m, seqlen_q, q_op, q_smem, BLOCK_M, row_s,
              row_o, True)


# ---------------------------------------------------------------------------------------------
# The warp-specialized forward (FlashAttention-3's producer/consumer split). One program covers
# 2 * BLOCK_M query rows with three partitions:
#   * two consumer warpgroups (the default partition and worker 0), each owning one BLOCK_M-row
#     query tile and running the loop above (QK^T of block j and PV of block j-1 as async wgmmas,
#     the softmax of j overlapping PV(j-1)), with the same unmasked-then-masked split;
#   * one producer warp (worker 1, few registers): TMA of both Q tiles, then K_0, K_1, V_0, K_2,
#     V_1, ... into STAGES-deep K and V rings. Each stage has a "ready" mbarrier (the producer's
#     expect-tx) and an "empty" one counting one arrival per consumer, made after the wgmma that
#     read the stage was waited for; block j uses stage j % STAGES, phase j // STAGES.
# The tiles may need different numbers of key blocks (causal: tile 0 sees fewer keys; a tile past
# seqlen_q needs none): the consumer with more arrives twice (for itself and its partner) on the
# blocks its partner does not use, so every phase of an empty barrier gets its two arrivals.
# PINGPONG: the consumers' GEMM issues alternate through two "turn" mbarriers (Gluon 3.6 has no
# named barriers): consumer 0 issues its slot i (slot 0 = QK_0, slot j = QK_j + PV_{j-1}, slot n =
# PV_{n-1}) after consumer 1 issued slot i-1, consumer 1 its slot i after consumer 0 issued slot i,
# while the partner still has that slot (unequal slot counts stop the alternation, never hang).
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
def _release(empty_bars, stage, blk, n_other):
    """This consumer is done with ring stage `stage` (key block blk); it also arrives for its
    partner when the partner does not use block blk (blk >= n_other)."""
    bar = empty_bars.index(stage)
    mbarrier.arrive(bar)
    mbarrier.arrive(bar, pred=blk >= n_other)


@gluon.jit
def _pp_wait(turn_bars, slot, slots_other, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: before GEMM slot `slot`, wait until the partner issued its slot slot-1
    (consumer 0) or slot (consumer 1), if it has that slot; partner slot k completes phase k of
    turn_bars[ME]."""
    if PINGPONG:
        need = slot - 1 + ME
        mbarrier.wait(turn_bars.index(ME), need & 1, pred=(need >= 0) & (need < slots_other))


@gluon.jit
def _pp_arrive(turn_bars, slot, slots_other, ME: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: slot `slot` issued; signal the partner if it will wait for it."""
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - ME), pred=slot + ME < slots_other)


@gluon.jit
def _ws_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn_bars, s_zero, j,
             n_other, slots_other, qk_scale, start_m, seqlen_k, diag, ME: gl.constexpr, PINGPONG: gl.constexpr,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
             row_o: gl.constexpr, kv_tile: gl.constexpr):
    """_step with ready/empty rings (the producer refills): key block j >= 1, GEMM slot j."""
    dtype: gl.constexpr = q_op.dtype
    ks = j % STAGES
    mbarrier.wait(k_ready.index(ks), (j // STAGES) & 1)
    k_op = k_smem.index(ks)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    _pp_wait(turn_bars, j, slots_other, ME, PINGPONG)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    vs = (j - 1) % STAGES
    mbarrier.wait(v_ready.index(vs), ((j - 1) // STAGES) & 1)
    v_op = v_smem.index(vs)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)  # acc is in the scale of m_{j-1}
    _pp_arrive(turn_bars, j, slots_other, ME, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # S_j done; PV_{j-1} may still run
    _release(k_empty, ks, j, n_other)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, seqlen_k, diag, MASKED, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_next = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    _release(v_empty, vs, j - 1, n_other)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return acc, p_next, m_i, l_i


@gluon.jit
def _consume(Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars, lse_row0,
             off_b, q_col, start_m, n_blocks, mask_from, n_other, slots_other, qk_scale, seqlen_q, seqlen_k,
             ME: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup's query tile (n_blocks >= 1)."""
    dtype: gl.constexpr = q_smem.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()  # the partition's: 4
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    diag = seqlen_k - seqlen_q

    q_buf = q_smem.index(ME)
    q_op = q_buf._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q_tile)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

    # slot 0: S = Q K_0^T, waited; its softmax
    mbarrier.wait(q_bars.index(ME), 0)
    mbarrier.wait(k_ready.index(0), 0)
    k_op = k_smem.index(0)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    _pp_wait(turn_bars, 0, slots_other, ME, PINGPONG)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pp_arrive(turn_bars, 0, slots_other, ME, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    _release(k_empty, 0, 0, n_other)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, 0, seqlen_k, diag, mask_from == 0, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, gl.maximum(mask_from, 1)):
        acc, p_op, m_i, l_i = _ws_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, k_ready, v_ready, k_empty,
                                       v_empty, turn_bars, s_zero, j, n_other, slots_other, qk_scale, start_m,
                                       seqlen_k, diag, ME, PINGPONG, False, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N,
                                       STAGES, s_layout, p_layout, row_o, kv_tile)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        acc, p_op, m_i, l_i = _ws_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, k_ready, v_ready, k_empty,
                                       v_empty, turn_bars, s_zero, j, n_other, slots_other, qk_scale, start_m,
                                       seqlen_k, diag, ME, PINGPONG, True, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N,
                                       STAGES, s_layout, p_layout, row_o, kv_tile)

    # slot n_blocks: the last block's PV
    vs = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(vs), ((n_blocks - 1) // STAGES) & 1)
    v_op = v_smem.index(vs)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    _pp_wait(turn_bars, n_blocks, slots_other, ME, PINGPONG)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)
    _pp_arrive(turn_bars, n_blocks, slots_other, ME, PINGPONG)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    _release(v_empty, vs, n_blocks - 1, n_other)
    _epilogue(acc, m_i, l_i, Out, Lse, lse_row0, off_b, q_col, start_m, seqlen_q, q_op, q_buf, BLOCK_M, row_s,
              row_o, True)


@gluon.jit
def _consumer(Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
              stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k, sm_scale,
              ME: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ME (0: the default partition, 1: worker 0): query tile ME of the program."""
    off_b, off_h, cta_m = _program_tile(batch, nheads, seqlen_q, CAUSAL, NUM_CONSUMERS * BLOCK_M)
    start_m = cta_m + ME * BLOCK_M
    n_blocks, mask_from = _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n_other, _ = _tile_blocks(cta_m + (1 - ME) * BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    slots_other = gl.where(n_other > 0, n_other + 1, 0)
    lse_row0 = off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h
    if n_blocks > 0:
        _consume(Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars, lse_row0,
                 off_b, off_h * HEAD_DIM, start_m, n_blocks, mask_from, n_other, slots_other, _qk_scale(sm_scale),
                 seqlen_q, seqlen_k, ME, PINGPONG, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)


@gluon.jit
def _produce(desc, ready, empty, smem, blk, off_b, kv_col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Block blk of a ring: wait until both consumers released the stage's previous block (block
    blk - STAGES, phase blk // STAGES - 1 of the empty barrier; a fresh barrier passes a wait on
    parity 1), then TMA it."""
    stage = blk % STAGES
    mbarrier.wait(empty.index(stage), ((blk // STAGES) & 1) ^ 1)
    bar = ready.index(stage)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [off_b, blk * BLOCK_N, kv_col], bar, smem.index(stage))


@gluon.jit
def _producer(Q, K, V, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, batch, nheads, seqlen_q,
              seqlen_k, group_size, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: both Q tiles, then K_0, K_1, V_0, K_2, V_1, ..., V_{n-1} (the consumers' order of
    use, n = the longer tile's block count)."""
    off_b, off_h, cta_m = _program_tile(batch, nheads, seqlen_q, CAUSAL, NUM_CONSUMERS * BLOCK_M)
    n0, _ = _tile_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n1, _ = _tile_blocks(cta_m + BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    n_max = gl.maximum(n0, n1)
    q_col = off_h * HEAD_DIM
    kv_col = (off_h // group_size) * HEAD_DIM
    for t in gl.static_range(NUM_CONSUMERS):
        bar = q_bars.index(t)
        valid = cta_m + t * BLOCK_M < seqlen_q
        mbarrier.expect(bar, Q.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(Q, [off_b, cta_m + t * BLOCK_M, q_col], bar, q_smem.index(t), pred=valid)
    _produce(K, k_ready, k_empty, k_smem, 0, off_b, kv_col, BLOCK_N, STAGES)  # tile 0 is valid: n_max >= 1
    for j in range(1, n_max):
        _produce(K, k_ready, k_empty, k_smem, j, off_b, kv_col, BLOCK_N, STAGES)
        _produce(V, v_ready, v_empty, v_smem, j - 1, off_b, kv_col, BLOCK_N, STAGES)
    _produce(V, v_ready, v_empty, v_smem, n_max - 1, off_b, kv_col, BLOCK_N, STAGES)


@gluon.jit
def attn_fwd_ws_kernel(Q, K, V, Out, Lse, stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k, group_size,
                       sm_scale, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Grid: cdiv(seqlen_q, 2 * BLOCK_M) * batch * nheads programs; launched with num_warps=4 (the
    default partition; the compiler adds the workers' warps)."""
    dtype: gl.constexpr = Q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, BLOCK_M, HEAD_DIM], Q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], K.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], V.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bars.index(t), count=1)
        mbarrier.init(turn_bars.index(t), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the barriers' initialisation, visible to TMA and to the partitions

    gl.warp_specialize([
        (_consumer, (Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                     stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k, sm_scale,
                     _CONSUMER0, PINGPONG, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
        (_consumer, (Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn_bars,
                     stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k, sm_scale,
                     _CONSUMER1, PINGPONG, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
        (_producer, (Q, K, V, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, batch, nheads,
                     seqlen_q, seqlen_k, group_size, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


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
def _tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, CAUSAL: gl.constexpr, SNAKE: gl.constexpr,
                 CTA_M: gl.constexpr, BLOCK_M: gl.constexpr):
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
def _tile_max_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CONSUMERS: gl.constexpr):
    """The largest block count of a tile's CONSUMERS parts (_tile_blocks of each): how far the ring
    moves per tile."""
    n_max, _ = _tile_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    for t in gl.static_range(1, CONSUMERS):
        n_t, _ = _tile_blocks(cta_m + t * BLOCK_M, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        n_max = gl.maximum(n_max, n_t)
    return n_max


@gluon.jit
def _unit_wait(ready, u, STAGES: gl.constexpr):
    """Wait until ring unit u (its K block and/or V block) has landed in stage u % STAGES."""
    mbarrier.wait(ready.index(u % STAGES), (u // STAGES) & 1)


@gluon.jit
def _persist_release(empty, u, STAGES: gl.constexpr):
    """Done reading ring unit u (both its blocks): one arrival (after this warpgroup's wgmma wait);
    the stage's empty barrier completes its phase when every consumer arrived -- never for a
    partner (_skip_units)."""
    mbarrier.arrive(empty.index(u % STAGES))


@gluon.jit
def _skip_units(ready, empty, g, j0, j1, STAGES: gl.constexpr):
    """Ring units g + j0 .. g + j1 - 1: the partners', not this consumer's (causal: a partner's part
    sees more keys; or this part is empty: past seqlen_q or before row 0). Wait until each is loaded, then give this
    consumer's arrival. Not a partner arriving twice instead (attn_fwd_ws_kernel's _release): this
    consumer would go on to its next tile and wait on ring units more than STAGES ahead of the fill,
    where a parity wait passes two phases early."""
    for j in range(j0, j1):
        _unit_wait(ready, g + j, STAGES)
        _persist_release(empty, g + j, STAGES)


@gluon.jit
def _q_release(q_empty, idx, pred):
    """Hand Q buffer idx back to the producer once the TMA store of the O that went out through it
    has read it: the store was issued by one elected thread, so every thread waits for its own bulk
    groups, then a partition barrier, then thread 0 arrives."""
    tma.store_wait(pendings=0)
    gl.thread_barrier()
    mbarrier.arrive(q_empty.index(idx), pred=pred)


@gluon.jit
def _persist_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, ready, empty, s_zero, g, j, qk_scale, start_m,
                  seqlen_k, diag, MASKED: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                  p_layout: gl.constexpr, row_o: gl.constexpr, kv_tile: gl.constexpr):
    """_ws_step (without ping-pong) on the running ring: the tile's key block j >= 1 and value block
    j - 1 are ring unit g + j, waited for once and released once, after both wgmmas."""
    dtype: gl.constexpr = q_op.dtype
    u = g + j
    st = u % STAGES
    _unit_wait(ready, u, STAGES)
    k_op = k_smem.index(st)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    v_op = v_smem.index(st)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)  # acc is in the scale of m_{j-1}
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # S_j done; PV_{j-1} may still run
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, seqlen_k, diag, MASKED, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_next = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    _persist_release(empty, u, STAGES)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return acc, p_next, m_i, l_i


@gluon.jit
def _consume_tile(Out, Lse, q_smem, k_smem, v_smem, q_empty, ready, empty, lse_row0, off_b, q_col, start_m,
                  n_blocks, mask_from, g, qi, prev_qi, has_prev, qk_scale, seqlen_q, seqlen_k, CAUSAL: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  QBUF: gl.constexpr):
    """One consumer warpgroup's query tile (n_blocks >= 1, its Q in buffer qi already waited for):
    ring units g .. g + n_blocks, then the epilogue, whose O store is left in flight."""
    dtype: gl.constexpr = q_smem.dtype
    NUM_WARPS: gl.constexpr = gl.num_warps()  # the partition's: 4
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM, NUM_WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    diag = seqlen_k - seqlen_q

    q_buf = q_smem.index(qi)
    q_op = q_buf._reinterpret(dtype, [BLOCK_M, HEAD_DIM], q_tile)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)

    # block 0 (ring unit g, K_0 alone): S = Q K_0^T; QBUF 2: the previous tile's Q buffer goes back
    # while it runs, so waiting for that tile's O store costs nothing
    _unit_wait(ready, g, STAGES)
    k_op = k_smem.index(g % STAGES)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    s_tok = warpgroup_mma(q_op, k_op.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if QBUF == 2:
        _q_release(q_empty, prev_qi, has_prev)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    _persist_release(empty, g, STAGES)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, start_m, 0, seqlen_k, diag, mask_from == 0, CAUSAL,
                                  BLOCK_M, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, gl.maximum(mask_from, 1)):
        acc, p_op, m_i, l_i = _persist_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, ready, empty, s_zero, g, j,
                                            qk_scale, start_m, seqlen_k, diag, False, CAUSAL, HEAD_DIM, BLOCK_M,
                                            BLOCK_N, STAGES, s_layout, p_layout, row_o, kv_tile)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        acc, p_op, m_i, l_i = _persist_step(acc, p_op, m_i, l_i, q_op, k_smem, v_smem, ready, empty, s_zero, g, j,
                                            qk_scale, start_m, seqlen_k, diag, True, CAUSAL, HEAD_DIM, BLOCK_M,
                                            BLOCK_N, STAGES, s_layout, p_layout, row_o, kv_tile)

    # the last block's PV: ring unit g + n_blocks (its K block, if any, is a partner's)
    u = g + n_blocks
    _unit_wait(ready, u, STAGES)
    v_op = v_smem.index(u % STAGES)._reinterpret(dtype, [BLOCK_N, HEAD_DIM], kv_tile)
    acc_tok = warpgroup_mma(p_op, v_op, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
    _persist_release(empty, u, STAGES)

    # O through this tile's Q buffer, the store not waited for here
    _epilogue(acc, m_i, l_i, Out, Lse, lse_row0, off_b, q_col, start_m, seqlen_q, q_op, q_buf, BLOCK_M, row_s,
              row_o, False)
    if QBUF == 1:
        _q_release(q_empty, qi, True)
    # QBUF 2: not waited for here; released during the next tile (or waited for at the very end)


@gluon.jit
def _persist_consumer(args, ME: gl.constexpr, CAUSAL: gl.constexpr, SNAKE: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr,
                      CONSUMERS: gl.constexpr):
    """Consumer warpgroup ME (0: the default partition, then workers 0 .. CONSUMERS - 2): part ME
    of each of this CTA's tiles. The k-th tile's Q is in buffer (k % QBUF) * CONSUMERS + ME, phase
    (k // QBUF) & 1."""
    (Out, Lse, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, stride_lse_b, stride_lse_h, batch, nheads,
     seqlen_q, seqlen_k, sm_scale) = args
    CTA_M: gl.constexpr = CONSUMERS * BLOCK_M
    num_m = (seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_my = _num_my_tiles(num_m * batch * nheads, pid, nprog, SNAKE)
    qk_scale = _qk_scale(sm_scale)
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = _tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, CAUSAL, SNAKE,
                                           CTA_M, BLOCK_M)
        start_m = cta_m + ME * BLOCK_M
        n_blocks, mask_from = _tile_blocks(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        n_max = _tile_max_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N, CONSUMERS)
        qi = (it % QBUF) * CONSUMERS + ME
        prev_qi = ((it + 1) % QBUF) * CONSUMERS + ME  # QBUF 2: the previous tile's buffer
        mbarrier.wait(q_ready.index(qi), (it // QBUF) & 1)
        if n_blocks > 0:
            lse_row0 = off_b.to(gl.int64) * stride_lse_b + off_h.to(gl.int64) * stride_lse_h
            _consume_tile(Out, Lse, q_smem, k_smem, v_smem, q_empty, ready, empty, lse_row0, off_b,
                          off_h * HEAD_DIM, start_m, n_blocks, mask_from, g, qi, prev_qi, it > 0, qk_scale,
                          seqlen_q, seqlen_k, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF)
        else:  # this part lies past seqlen_q or before row 0: nothing to compute, nothing stored
            if QBUF == 2:
                _q_release(q_empty, prev_qi, it > 0)
            else:
                mbarrier.arrive(q_empty.index(qi))
        # after the epilogue: the units past this part's last (unit n_blocks, or none when it has no block)
        _skip_units(ready, empty, g, n_blocks + (n_blocks > 0).to(gl.int32), n_max + 1, STAGES)
        g += n_max + 1
    tma.store_wait(pendings=0)


@gluon.jit
def _persist_produce(K, V, ready, empty, k_smem, v_smem, u, j, n_max, off_b, kv_col, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
    """Ring unit u, the tile's j-th (0 <= j <= n_max): K_j unless j == n_max, V_{j-1} unless j == 0.
    Wait until every consumer released the stage's previous unit (u - STAGES; a fresh barrier passes
    a wait on parity 1), then TMA both blocks onto the stage's one ready barrier."""
    stage = u % STAGES
    mbarrier.wait(empty.index(stage), ((u // STAGES) & 1) ^ 1)
    bar = ready.index(stage)
    has_k = j < n_max
    has_v = j > 0
    one = (j == 0) | (j == n_max)  # n_max >= 1: never neither
    mbarrier.expect(bar, 2 * K.block_type.nbytes, pred=(j > 0) & (j < n_max))
    mbarrier.expect(bar, K.block_type.nbytes, pred=one)
    tma.async_copy_global_to_shared(K, [off_b, j * BLOCK_N, kv_col], bar, k_smem.index(stage), pred=has_k)
    tma.async_copy_global_to_shared(V, [off_b, (j - 1) * BLOCK_N, kv_col], bar, v_smem.index(stage), pred=has_v)


@gluon.jit
def _persist_producer(args, CAUSAL: gl.constexpr, SNAKE: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QBUF: gl.constexpr,
                      CONSUMERS: gl.constexpr):
    """One warp, per tile: ring unit 0 (K_0), Q_0 .. Q_{CONSUMERS-1} (each once its buffer is free),
    then units 1 .. n: (K_1, V_0), (K_2, V_1), ..., (V_{n-1}) (n = the longest part's block count).
    args: the kernel's `producer` tuple (its runtime values; a tuple drops constexprs)."""
    (Q, K, V, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, batch, nheads, seqlen_q, seqlen_k,
     group_size) = args
    CTA_M: gl.constexpr = CONSUMERS * BLOCK_M
    num_m = (seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_my = _num_my_tiles(num_m * batch * nheads, pid, nprog, SNAKE)
    g = 0
    for it in range(n_my):
        off_b, off_h, cta_m = _tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, CAUSAL, SNAKE,
                                           CTA_M, BLOCK_M)
        # >= 1: the tile's last part starts in [0, seqlen_q) (_tile_coords' shift leaves it there)
        n_max = _tile_max_blocks(cta_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N, CONSUMERS)
        q_col = off_h * HEAD_DIM
        kv_col = (off_h // group_size) * HEAD_DIM
        # K_0 first: its stage held a block of an earlier tile, so this wait never needs this tile's
        # Q (no deadlock), and with QBUF 1 only the Q load's latency is exposed per tile
        _persist_produce(K, V, ready, empty, k_smem, v_smem, g, 0, n_max, off_b, kv_col, BLOCK_N, STAGES)
        for t in gl.static_range(CONSUMERS):
            qi = (it % QBUF) * CONSUMERS + t
            mbarrier.wait(q_empty.index(qi), ((it // QBUF) & 1) ^ 1)
            bar = q_ready.index(qi)
            row = cta_m + t * BLOCK_M
            valid = (row >= 0) & (row < seqlen_q)
            mbarrier.expect(bar, Q.block_type.nbytes, pred=valid)
            tma.async_copy_global_to_shared(Q, [off_b, row, q_col], bar, q_smem.index(qi), pred=valid)
            # an empty part: its consumer only waits and hands back
            mbarrier.arrive(bar, pred=(row < 0) | (row >= seqlen_q))
        for j in range(1, n_max + 1):
            _persist_produce(K, V, ready, empty, k_smem, v_smem, g + j, j, n_max, off_b, kv_col, BLOCK_N, STAGES)
        g += n_max + 1


# do_not_specialize: one compiled variant per configuration whatever the shapes
@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "batch", "nheads", "seqlen_q", "seqlen_k", "group_size"])
def attn_fwd_persist_kernel(Q, K, V, Out, Lse, stride_lse_b, stride_lse_h, batch, nheads, seqlen_q, seqlen_k,
                            group_size, sm_scale, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            QBUF: gl.constexpr, SNAKE: gl.constexpr, CONSUMERS: gl.constexpr):
    """Grid: min(#SMs, cdiv(seqlen_q, CONSUMERS * BLOCK_M) * batch * nheads) CTAs; launched with
    num_warps=4 (the default partition; the compiler adds the workers' warps). CONSUMERS 2 or 3
    consumer warpgroups (_CONSUMER_REGS registers each for 2, _CONSUMER3_REGS for 3), one producer warp."""
    dtype: gl.constexpr = Q.dtype
    NQ: gl.constexpr = QBUF * CONSUMERS
    q_smem = gl.allocate_shared_memory(dtype, [NQ, 1, BLOCK_M, HEAD_DIM], Q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], K.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], V.layout)
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
    consumer = (Out, Lse, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, stride_lse_b, stride_lse_h, batch,
                nheads, seqlen_q, seqlen_k, sm_scale)
    producer = (Q, K, V, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, batch, nheads, seqlen_q, seqlen_k,
                group_size)
    # (a list per count: a Gluon kernel cannot build one from CONSUMERS, nor hold a function in a tuple)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_persist_consumer, (consumer, _CONSUMER0, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF,
                                 CONSUMERS)),
            (_persist_consumer, (consumer, _CONSUMER1, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF,
                                 CONSUMERS)),
            (_persist_producer, (producer, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF, CONSUMERS)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])
    else:
        gl.static_assert(CONSUMERS == 3, "the persistent forward has 2 or 3 consumer warpgroups")
        gl.warp_specialize([
            (_persist_consumer, (consumer, _CONSUMER0, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF,
                                 CONSUMERS)),
            (_persist_consumer, (consumer, _CONSUMER1, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF,
                                 CONSUMERS)),
            (_persist_consumer, (consumer, _CONSUMER2, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF,
                                 CONSUMERS)),
            (_persist_producer, (producer, CAUSAL, SNAKE, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, QBUF, CONSUMERS)),
        ], [4, 4, 1], [_CONSUMER3_REGS, _CONSUMER3_REGS, _PRODUCER_REGS])
