"""What every partition of the Gluon backward (kernels/bwd_hopper.py) takes: the kernel's runtime arguments (BwdArgs),
its shared memory and rings (BwdBuffers) and its constexprs with the MMA partition's layouts (BwdConfig), and the
program's work, computed alike in each partition (_ws_program, _ws_advance)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from .pipeline import Ring, Scalar, aggregate, head_dim_parts, by_field, unwrap

MMA_WARPS = gl.constexpr(8)  # the MMA partition (the default one: the launch's num_warps), two warpgroups


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """wgmma accumulator layout for a [rows, cols] tile: warps stacked along the rows (16 each) as far as they go,
    the remaining warpgroups splitting the columns. (Called from a warp_specialize partition, its arguments arrive
    as constexpr wrappers: unwrapped first.)"""
    rows, cols, num_warps = unwrap(rows), unwrap(cols), unwrap(num_warps)
    wm = min(num_warps, rows // 16)
    wn = num_warps // wm
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, cols // wn, 16])


@aggregate
class BwdConfig:
    """The kernel's constexprs, passed to every partition, and the MMA partition's tile shape and layouts (8 warps,
    two warpgroups; _mma_layout): S / dP [BLOCK_M, BLOCK_N],
    dK [BLOCK_N, HEAD_DIM], dV [BLOCK_N, HEAD_DIM_V], dQ_i's DQ_SPLIT column parts [BLOCK_M, DQ_W0] and
    [BLOCK_M, DQ_W1] accumulators; the NVMMA shared layouts of a Q / dO tile, a K / V block and a staged fp32 dQ
    part. q's and k's head dim that is not a power of two is two column parts (kernels/pipeline.py's
    head_dim_parts: HEAD_DIM_HI + HEAD_DIM_LO, HEAD_DIM_LO 0 otherwise), each a buffer of Q and K, an S wgmma, a dK
    accumulator and a part of dQ_i (DQ_SPLIT 2: DQ_W0 = HEAD_DIM_HI, DQ_W1 = HEAD_DIM_LO; else both
    HEAD_DIM // DQ_SPLIT). The first part's layouts keep the names of the one-part build (kv_layout: dK's, and dV's
    when the head dims are equal). GQA: more than one query head per kv head (the flat loop over the group's heads,
    _ws_mma)."""

    CAUSAL: gl.constexpr
    GQA: gl.constexpr
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
    def __init__(self, dtype, CAUSAL, GQA, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps):
        dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps = map(
            unwrap, (dtype, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, DQ_SPLIT, num_warps)
        )
        hi, lo = head_dim_parts(HEAD_DIM)
        assert lo == 0 or DQ_SPLIT == 2, "a head dim in two parts computes dQ_i in those parts (DQ_SPLIT 2)"
        w0, w1 = (hi, lo) if lo else (HEAD_DIM // DQ_SPLIT, HEAD_DIM // DQ_SPLIT)
        self.CAUSAL = gl.constexpr(unwrap(CAUSAL))
        self.GQA = gl.constexpr(unwrap(GQA))
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
class BwdArgs:
    """The backward kernel's runtime arguments, passed to every partition: the descriptors (Q's, K's, dK's and the dQ
    accumulator's as head-dim part pairs, kernels/pipeline.py's part_descs), lse and delta (one set of strides:
    stride_lb, stride_lh), the softmax scale and the sizes."""

    q_desc: gl.tuple
    k_desc: gl.tuple
    V: tma.tensor_descriptor
    DO: tma.tensor_descriptor
    dk_desc: gl.tuple
    DV: tma.tensor_descriptor
    dq_desc: gl.tuple
    Lse: gl.tensor
    Delta: gl.tensor
    sm_scale: Scalar
    seqlen_q: Scalar
    seqlen_k: Scalar
    nheads: Scalar
    nheads_k: Scalar
    stride_lb: Scalar
    stride_lh: Scalar

    __init__ = by_field  # every field by keyword


@aggregate
class BwdBuffers:
    """The kernel's shared memory and barriers, passed to every partition: K, V (one block each) and their barrier
    kv_bar, the Q ring and the dO ring (SPLIT_RING: a ring of its own, DO_STAGES deep, released after dV; else Q's
    stages, with do_ready its own ready barriers and q_empty their release), P and dS, and the dQ staging ring
    (ready: dq_full, empty: dq_empty)."""

    k_smem: gl.tuple  # head-dim parts (kernels/pipeline.py's alloc_parts)
    v_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    q_smem: gl.tuple  # head-dim parts
    do_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    q_ring: Ring
    do_ring: Ring
    dq_ring: Ring
    SPLIT_RING: gl.constexpr

    __init__ = by_field  # every field by keyword


@gluon.jit
def _ws_program(args, cfg):
    """The program's work, computed alike in every partition: (off_b, off_hk, h0, start_n, i_first, i_full, i_end,
    total). The grid is (G, key blocks, batch * nheads_k / G): program (x, n, z) takes key block n of head (batch
    entry, kv head) z * G + x. CUDA starts the programs x fastest, then n, then z (observed, not a documented
    guarantee), so the heads go in groups of G, one group after the other, and within a group key block 0 of every
    head first, then key block 1, ...: under a causal mask key block 0 sees the most query blocks, so each group
    runs heaviest first (the longest-first rule, which keeps the last wave short), while the programs running at
    once read the Q and dO of G heads only (launch_gluon.bwd_grid sizes G for L2 and CUDA's grid limits). G = 1 is
    the head-major order (one head's key blocks after the other's). The ids come from special registers, which the
    compiler reads again rather than keep in registers through the loop (an order computed with divisions spilled,
    compiled for sm_90). Query heads h0 .. h0 + group - 1 share the kv head. Query blocks [i_first, i_end) of each
    of the group's heads see key block start_n; those before i_full cross the causal diagonal (key j visible to
    query i iff j <= i + seqlen_k - seqlen_q); total = group * (i_end - i_first) flat positions, head-major."""
    seqlen_q = args.seqlen_q
    seqlen_k = args.seqlen_k
    nheads_k = args.nheads_k
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    pid_n = gl.program_id(1)
    pid_bh = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
    off_b = pid_bh // nheads_k
    off_hk = pid_bh % nheads_k
    group = args.nheads // nheads_k
    h0 = off_hk * group
    start_n = pid_n * BLOCK_N
    n_m = gl.cdiv(seqlen_q, BLOCK_M)
    diag = seqlen_k - seqlen_q
    i_first = 0
    i_full = 0
    if cfg.CAUSAL:
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
