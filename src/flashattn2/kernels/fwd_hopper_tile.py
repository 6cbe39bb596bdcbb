"""The consumer side shared by the Gluon forward kernels (kernels/fwd_hopper_ws.py, kernels/fwd_hopper_persist.py):
the configuration every partition takes (FwdConfig: the constexprs and a consumer warpgroup's layouts; FwdArgs: the
kernel's runtime arguments), the score arithmetic (OnlineSoftmax), the consumer pipeline (_attn_tile, its step
_attn_step) and the epilogue. The two kernels differ only in how a consumer waits for and releases its key and value
blocks (their `loads`: _WsLoads, _PersistLoads)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .constexprs import FP8_KEY_DIMS, FP8_KEY_GROUP, FP8_KEY_ORDER
from .pipeline import Scalar, aggregate, head_dim_parts, reinterpret, scalars, by_field, tma_load, tma_store, unwrap

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)

# the partitions of both kernels: consumer ids as constexpr globals (a literal in a tuple is not one), the
# consumers' warps and registers (setmaxnreg)
_CONSUMER0 = gl.constexpr(0)
_CONSUMER1 = gl.constexpr(1)
_CONSUMER2 = gl.constexpr(2)
CONSUMER_WARPS = gl.constexpr(4)  # a consumer is one warpgroup (the default partition: the launch's num_warps)
_CONSUMER_REGS = gl.constexpr(240)
# the persistent kernel with three consumer warpgroups: 3 * 128 * 160 + 24 * 128 <= 64K registers
_CONSUMER3_REGS = gl.constexpr(160)
_PRODUCER_REGS = gl.constexpr(24)
# FP8's key order (constexprs.FP8_KEY_ORDER) on P viewed [BLOCK_M, key groups, *FP8_KEY_DIMS] (_key_view): the
# permute takes literal dims, so a change of the order must change it too
_KEY_ORDER_IS_THIS = gl.constexpr(tuple(FP8_KEY_ORDER) == (0, 2, 1, 3))


@gluon.constexpr_function
def _key_view(block_m, block_n):
    """P's shape [BLOCK_M, BLOCK_N] seen as [BLOCK_M, key groups, *FP8_KEY_DIMS] (FwdConfig.p_operand)."""
    return [unwrap(block_m), unwrap(block_n) // FP8_KEY_GROUP, *FP8_KEY_DIMS]


@gluon.constexpr_function
def _acc_layout(cols, num_warps, k=16):
    """wgmma accumulator layout of a [rows, cols] tile whose warps each own 16 rows (S: cols =
    BLOCK_N, O: cols = HEAD_DIM); k: the instruction's depth (16 for 16-bit operands, 32 for 8-bit)."""
    cols, num_warps = unwrap(cols), unwrap(num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, k])


@gluon.jit
def _e4m3x4(x):
    """fp32 -> e4m3 (round to nearest even, saturating: as .to(float8e4nv)), four consecutive elements of a thread
    into one register by two cvt.e4m3x2 (Triton's own cast packs them one byte at a time)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r",
        [x],
        dtype=gl.float8e4nv,
        is_pure=True,
        pack=4,
    )


@aggregate
class FwdConfig:
    """A forward kernel's constexprs, passed to every partition, and a consumer warpgroup's tile shape and layouts
    (the one layout preamble): S = Q K^T [BLOCK_M, BLOCK_N] and O [BLOCK_M, HEAD_DIM_V] wgmma accumulators, each
    warp 16 rows; P as the register A operand of PV; the row vectors of S and O; the NVMMA shared layouts of a Q
    tile, a K block and a V block viewed 2-D. HEAD_DIM is q's and k's head dim, HEAD_DIM_V v's and O's. A head dim
    that is not a power of two (DeepSeek-V3's 192: Gluon's tiles are powers of two) is two column parts,
    HEAD_DIM_HI (the largest power of two below it) and HEAD_DIM_LO (the rest, a power of two), each a tile and a
    TMA load of its own, S their two chained wgmmas; HEAD_DIM_LO is 0 otherwise. O leaves through the Q tile's
    buffer (the first part's): HEAD_DIM_V is HEAD_DIM_HI.

    FP8 (e4m3 q, k, v: FA3's forward): both products take e4m3 operands (wgmma k = 32), P is rounded to e4m3 in
    registers (its rows' running max makes it <= 1), V arrives transposed (a V^T block [HEAD_DIM_V, BLOCK_N], keys
    contiguous: wgmma's e4m3 operands are K-major) and O, bf16, leaves through a buffer of its own (o_tile): an e4m3
    Q tile holds half of it."""

    CAUSAL: gl.constexpr
    SINK: gl.constexpr  # a learnable sink logit per head (OnlineSoftmax.sink2)
    HEAD_DIM: gl.constexpr
    HEAD_DIM_HI: gl.constexpr
    HEAD_DIM_LO: gl.constexpr
    HEAD_DIM_V: gl.constexpr
    BLOCK_M: gl.constexpr  # a consumer's query rows
    BLOCK_N: gl.constexpr
    CONSUMERS: gl.constexpr  # consumer warpgroups, one BLOCK_M-row part of a tile each
    CTA_M: gl.constexpr  # a tile's query rows: CONSUMERS * BLOCK_M
    QBUF: gl.constexpr  # Q buffers per consumer (the persistent kernel; the warp-specialized one has 1)
    SNAKE: gl.constexpr  # the persistent kernel's odd rounds of tiles reversed (PersistSchedule)
    FP8: gl.constexpr  # e4m3 operands (the class docstring)
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
    o_tile: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, dtype, CAUSAL, SINK, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CONSUMERS, QBUF, SNAKE):
        dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CONSUMERS = map(
            unwrap, (dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CONSUMERS)
        )
        self.CAUSAL = gl.constexpr(unwrap(CAUSAL))
        self.SINK = gl.constexpr(unwrap(SINK))
        hi, lo = head_dim_parts(HEAD_DIM)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.HEAD_DIM_HI = gl.constexpr(hi)
        self.HEAD_DIM_LO = gl.constexpr(lo)
        self.HEAD_DIM_V = gl.constexpr(HEAD_DIM_V)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CONSUMERS = gl.constexpr(CONSUMERS)
        self.CTA_M = gl.constexpr(CONSUMERS * BLOCK_M)
        self.QBUF = gl.constexpr(unwrap(QBUF))
        self.SNAKE = gl.constexpr(unwrap(SNAKE))
        fp8 = dtype == gl.float8e4nv
        self.FP8 = gl.constexpr(fp8)
        k = 32 if fp8 else 16
        s_layout = _acc_layout(BLOCK_N, CONSUMER_WARPS, k)
        o_layout = _acc_layout(HEAD_DIM_V, CONSUMER_WARPS, k)
        self.s_layout = gl.constexpr(s_layout)
        self.o_layout = gl.constexpr(o_layout)
        # P as the A operand from registers: 32 bits of consecutive k per register
        self.p_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if fp8 else 2))
        self.row_s = gl.constexpr(gl.SliceLayout(1, s_layout))
        self.row_o = gl.constexpr(gl.SliceLayout(1, o_layout))
        self.q_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_M, hi], dtype))
        self.k_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, hi], dtype))
        lo = max(lo, 16)  # (no second part: unused)
        self.q_lo_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_M, lo], dtype))
        self.k_lo_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_N, lo], dtype))
        v_block = [HEAD_DIM_V, BLOCK_N] if fp8 else [BLOCK_N, HEAD_DIM_V]
        self.v_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for(v_block, dtype))
        self.o_tile = gl.constexpr(gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM_V], gl.bfloat16))

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
        """Stage `stage` of a V ring ([STAGES, 1, BLOCK_N, HEAD_DIM_V]; FP8: V^T, [STAGES, 1, HEAD_DIM_V, BLOCK_N])
        as the 2-D [BLOCK_N, HEAD_DIM_V] wgmma operand."""
        if self.FP8:
            vt = reinterpret(smem.index(stage), smem.dtype, [self.HEAD_DIM_V, self.BLOCK_N], self.v_tile)
            view = vt.permute((1, 0))
        else:
            view = reinterpret(smem.index(stage), smem.dtype, [self.BLOCK_N, self.HEAD_DIM_V], self.v_tile)
        return view

    @gluon.jit
    def p_operand(self, p, dtype: gl.constexpr):
        """P (fp32, S's accumulator layout) as the next PV's register A operand, in the dots' type (dtype: Q's). FP8:
        still fp32 (issue_pv converts it, where the packed registers go straight into the wgmma: converted here, the
        loop would carry single bytes and repack them), its key columns in constexprs.FP8_KEY_ORDER, in which a
        thread's accumulator registers are the A operand's (no shuffle between threads); V^T's copy holds its keys
        in the same order (ops.launch.launch_gluon.fp8_vt), so P V is unchanged -- FA3's trick."""
        if self.FP8:  # (constexprs.FP8_KEY_ORDER: the order and why)
            gl.static_assert(_KEY_ORDER_IS_THIS, "p_operand's permute spells constexprs.FP8_KEY_ORDER out")
            p = p.reshape(_key_view(self.BLOCK_M, self.BLOCK_N))
            p = p.permute((0, 1, 2, 4, 3, 5)).reshape([self.BLOCK_M, self.BLOCK_N])
            op = gl.convert_layout(p, self.p_layout)
        else:
            op = gl.convert_layout(p.to(dtype), self.p_layout)
        return op

    @gluon.jit
    def issue_pv(self, p_op, v_op, acc):
        """O += P V as an asynchronous wgmma (p_op: p_operand's): the token to wait for. FP8: P rounded to e4m3 here,
        four keys to a register (_e4m3x4)."""
        if self.FP8:
            p_op = _e4m3x4(p_op)
        return warpgroup_mma(p_op, v_op, acc, is_async=True)

    @gluon.jit
    def v_load(self, V, off_b, blk, v_col, bar, smem, buf, pred):
        """TMA of value block blk (the head's columns from v_col) into buffer buf of a V ring, onto bar: rows
        blk * BLOCK_N .. of V, or (FP8) of the head's V^T rows v_col .., its columns blk * BLOCK_N .."""
        if self.FP8:
            tma_load(V, [off_b, v_col, blk * self.BLOCK_N], bar, smem.index(buf), pred=pred)
        else:
            tma_load(V, [off_b, blk * self.BLOCK_N, v_col], bar, smem.index(buf), pred=pred)

    @gluon.jit
    def out_buffer(self, q_op, q_buf, o_smem, idx):
        """Where a consumer's O leaves (the 2-D view _epilogue writes, the 3-D buffer its TMA store reads): the Q
        tile's buffer (q_op, q_buf), or FP8's bf16 O buffer idx of o_smem ([n, 1, BLOCK_M, HEAD_DIM_V])."""
        if self.FP8:
            buf = o_smem.index(idx)
            view = reinterpret(buf, buf.dtype, [self.BLOCK_M, self.HEAD_DIM_V], self.o_tile)
        else:
            view, buf = q_op, q_buf
        return view, buf


@gluon.jit
def alloc_v_and_o(V, Out, cfg, STAGES: gl.constexpr):
    """A forward kernel's V ring ([STAGES, 1, BLOCK_N, HEAD_DIM_V]; FP8: V^T's, [STAGES, 1, HEAD_DIM_V, BLOCK_N]) and
    FP8's bf16 O buffers, one per consumer (a 16-bit kernel's O leaves through Q's buffer: the V ring stands in)."""
    if cfg.FP8:
        v_smem = gl.allocate_shared_memory(V.dtype, [STAGES, 1, cfg.HEAD_DIM_V, cfg.BLOCK_N], V.layout)
        o_smem = gl.allocate_shared_memory(Out.dtype, [cfg.CONSUMERS, 1, cfg.BLOCK_M, cfg.HEAD_DIM_V], Out.layout)
    else:
        v_smem = gl.allocate_shared_memory(V.dtype, [STAGES, 1, cfg.BLOCK_N, cfg.HEAD_DIM_V], V.layout)
        o_smem = v_smem
    return v_smem, o_smem


@aggregate
class Fp8Scales:
    """An FP8 call's descales (FA3's: float32 per (batch, kv head), each pointer None for 1, as are all of them for a
    16-bit call) and their (batch, kv head) strides: q's and k's join the score scale, v's the output."""

    q: gl.tensor | gl.constexpr
    k: gl.tensor | gl.constexpr
    v: gl.tensor | gl.constexpr
    q_b: Scalar
    q_h: Scalar
    k_b: Scalar
    k_h: Scalar
    v_b: Scalar
    v_h: Scalar

    @gluon.constexpr_function
    def __init__(self, q, k, v, strides):
        self.q, self.k, self.v = (gl.constexpr(None) if unwrap(x) is None else x for x in (q, k, v))
        if strides is None or isinstance(strides, gl.constexpr) and unwrap(strides) is None:  # (unwrap: no tuple)
            strides = (0,) * 6
        self.q_b, self.q_h, self.k_b, self.k_h, self.v_b, self.v_h = scalars(strides)

    @gluon.jit
    def score_scale(self, sm_scale, off_b, off_hk):
        """sm_scale times q's and k's descales of (off_b, off_hk)."""
        if self.q is not None:
            sm_scale = sm_scale * gl.load(self.q + off_b * self.q_b + off_hk * self.q_h)
        if self.k is not None:
            sm_scale = sm_scale * gl.load(self.k + off_b * self.k_b + off_hk * self.k_h)
        return sm_scale

    @gluon.jit
    def value_scale(self, off_b, off_hk):
        """v's descale of (off_b, off_hk) (1.0 without one)."""
        if self.v is not None:
            scale = gl.load(self.v + off_b * self.v_b + off_hk * self.v_h)
        else:
            scale = gl.constexpr(1.0)
        return scale


@aggregate
class FwdArgs:
    """A forward kernel's runtime arguments, passed to every partition: the descriptors (q's and k's as head-dim part
    pairs, kernels/pipeline.py's part_descs), lse and the sink logits, lse's batch and head strides, the sizes and
    the softmax scale."""

    q_desc: gl.tuple
    k_desc: gl.tuple
    V: tma.tensor_descriptor
    Out: tma.tensor_descriptor
    Lse: gl.tensor
    Sinks: gl.tensor
    stride_lse_b: Scalar
    stride_lse_h: Scalar
    batch: Scalar
    nheads: Scalar
    seqlen_q: Scalar
    seqlen_k: Scalar
    group_size: Scalar  # query heads per kv head
    sm_scale: Scalar
    fp8: Fp8Scales

    __init__ = by_field  # every field by keyword


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
    sink2: Scalar  # cfg.SINK: the head's learnable sink logit in base 2 (in every row's denominator, no value row)
    v_scale: Scalar  # cfg.FP8: v's descale, joined to O's factor in finish (1.0: none)
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, qk_scale, start_m, seqlen_k, diag, sink2, cfg, v_scale=1.0):
        self.qk_scale = qk_scale
        self.v_scale = gl.constexpr(v_scale) if isinstance(v_scale, (int, float)) else v_scale
        self.start_m = gl.constexpr(start_m) if isinstance(start_m, int) else start_m
        self.seqlen_k = gl.constexpr(seqlen_k) if isinstance(seqlen_k, int) else seqlen_k
        self.diag = gl.constexpr(diag) if isinstance(diag, int) else diag
        self.sink2 = gl.constexpr(sink2) if isinstance(sink2, (int, float)) else sink2
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
        kernels/common.py's sink_join. FP8: the factor carries v's descale too."""
        if self.cfg.SINK:
            m = gl.maximum(m_i, self.sink2)
            alpha = gl.exp2(m_i - m)
            l_all = l_i * alpha + gl.exp2(self.sink2 - m)
            if self.cfg.FP8:
                alpha = alpha * self.v_scale
            return (m + gl.log2(l_all)) * LN2, alpha / l_all
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * LN2)
        if self.cfg.FP8:
            factor = self.v_scale / l_safe
        else:
            factor = 1.0 / l_safe
        return lse, factor


@gluon.jit
def _epilogue(acc, m_i, l_i, sm, args, lse_row0, off_b, o_col, q_op, q_buf, WAIT: gl.constexpr):
    """The logsumexp and O = acc / l (OnlineSoftmax.finish), through the Q tile's (first part's) buffer, q_op its
    2-D view (every wgmma that read Q has been waited for; FP8: the consumer's own O buffer, FwdConfig.out_buffer,
    once its previous store has read it), and a TMA store that clips rows past seqlen_q, waited for if WAIT (the
    persistent kernel hands the buffer back later)."""
    cfg = sm.cfg
    gl.static_assert(
        cfg.FP8 or cfg.HEAD_DIM_V == cfg.HEAD_DIM_HI, "O leaves through Q's buffer: v's head dim q's first part's"
    )
    lse, scale = sm.finish(m_i, l_i)
    offs_m = sm.start_m + gl.arange(0, cfg.BLOCK_M, layout=cfg.row_s)
    gl.store(args.Lse + lse_row0 + offs_m, lse, mask=offs_m < args.seqlen_q)
    o = acc * gl.convert_layout(scale, cfg.row_o)[:, None]
    if cfg.FP8:
        tma.store_wait(pendings=0)
    q_op.store(o.to(q_op.dtype))
    fence_async_shared()
    tma_store(args.Out, [off_b, sm.start_m, o_col], q_buf)
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
    acc_tok = sm.cfg.issue_pv(p_op, v_op, acc)  # acc is in the scale of m_{j-1}
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_j done; PV_{j-1} may still run
    loads.k_done(j, False)
    p, alpha, m_i, l_i = sm.step(s, m_i, l_i, j * sm.cfg.BLOCK_N, MASKED)
    p_next = sm.cfg.p_operand(p, q_op[0].dtype)
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
    p_op = cfg.p_operand(p, q_op[0].dtype)

    for j in range(1, gl.maximum(mask_from, 1)):
        acc, p_op, m_i, l_i = _attn_step(acc, p_op, m_i, l_i, q_op, s_zero, loads, sm, j, False)
    for j in range(gl.maximum(mask_from, 1), n_blocks):
        acc, p_op, m_i, l_i = _attn_step(acc, p_op, m_i, l_i, q_op, s_zero, loads, sm, j, True)

    # the last block's PV
    v_op = loads.v_wait(n_blocks, False)
    acc_tok = cfg.issue_pv(p_op, v_op, acc)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    loads.v_done(n_blocks)
    return acc, m_i, l_i
