"""Launchers for the dense attention kernels: pick a tile, allocate, launch, return tensors.

Inputs arrive validated (api.py / checks.py): (batch, seqlen, nheads, headdim) with the last
dimension contiguous, one dtype, one device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import _runtime, checks, config


@dataclass(frozen=True)
class ScoreMods:
    """How scores are formed and masked, resolved from flash_attn's arguments.

    causal=True sets the window's right edge to 0 (flash_attn's rule); a window that is only
    that becomes the CAUSAL path, any other finite edge the LOCAL path, where an unbounded edge
    is replaced by one that cannot bind (seqlen_q + seqlen_k).
    """
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,): the Philox seed, drawn from torch's generator

    def kernel_args(self, seqlen_q: int, seqlen_k: int, like: torch.Tensor):
        """(pointer/runtime arguments, constexpr flags) for the kernels."""
        left, right = self.window_left, 0 if self.causal else self.window_right
        causal = left < 0 and right == 0
        local = not causal and (left >= 0 or right >= 0)
        far = seqlen_q + seqlen_k
        alibi = self.alibi_slopes
        runtime = dict(
            Alibi=alibi if alibi is not None else like,
            stride_alibi_b=alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0,
            window_left=left if left >= 0 else far,
            window_right=right if right >= 0 else far,
            softcap=self.softcap if self.softcap > 0 else 1.0,
            Seed=self.seed if self.dropout_p > 0 else like,
            dropout_p=self.dropout_p,
        )
        flags = dict(CAUSAL=causal, LOCAL=local, SOFTCAP=self.softcap > 0, ALIBI=alibi is not None,
                     DROPOUT=self.dropout_p > 0)
        return runtime, flags


def _use_tma(arch: str, *tensors: torch.Tensor) -> bool:
    """TMA needs Hopper, 16-byte aligned bases and 16-byte multiples for every leading stride.
    Forcing it on (tests) lifts the Hopper condition, not the alignment one."""
    forced = config.tma_forced()
    if forced is False or (forced is None and arch != "sm90"):
        return False
    for t in tensors:
        es = t.element_size()
        lead = t.stride()[:-1]
        # gcd of the base and the leading strides in bytes: a multiple of 16 iff each one is
        if 0 in lead or math.gcd(t.data_ptr(), *[s * es for s in lead]) % 16:
            return False
    return True


def _flags(q: torch.Tensor, arch: str, *tensors: torch.Tensor) -> dict:
    upcast = arch == "interp" or q.dtype == torch.float32
    use_tma = _use_tma(arch, *tensors)
    if use_tma and arch != "interp":
        _runtime.ensure_tma_allocator()
    return dict(
        USE_TMA=use_tma,
        # the interpreter's bf16 arithmetic is wrong (TRITON-ON-CPU.md): it computes in fp32
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )


def _out_dtype(dtype: torch.dtype, arch: str) -> torch.dtype:
    # the interpreter truncates fp32 -> bf16 instead of rounding: it writes fp32 and torch casts
    return torch.float32 if arch == "interp" else dtype


@dataclass(frozen=True)
class Varlen:
    """Sequences packed along the first dimension: q (total_q, nheads, headdim) holds sequence b
    in rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32, (batch + 1,)); likewise k and v.
    known_*/order_*: what checks remembers of a cu_seqlens whose values were checked ((last
    value, longest sequence) and the sequences longest first), or None; `of` looks them up."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    known_q: tuple[int, int] | None = None
    known_k: tuple[int, int] | None = None
    order_q: torch.Tensor | None = None
    order_k: torch.Tensor | None = None

    @staticmethod
    def of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> "Varlen":
        known_q, order_q = checks.remembered(cu_seqlens_q)
        known_k, order_k = checks.remembered(cu_seqlens_k)
        return Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, known_q, known_k, order_q, order_k)


@dataclass(frozen=True)
class _Geometry:
    batch: int
    nheads: int
    nheads_k: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    varlen: Varlen | None

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None) -> "_Geometry":
        if varlen is None:
            batch, seqlen_q, nheads, head_dim = q.shape
            return _Geometry(batch, nheads, k.shape[2], head_dim, seqlen_q, k.shape[1], None)
        _, nheads, head_dim = q.shape
        return _Geometry(varlen.cu_seqlens_q.shape[0] - 1, nheads, k.shape[1], head_dim,
                         varlen.max_seqlen_q, varlen.max_seqlen_k, varlen)

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, seqlen, head) strides in elements; varlen has no batch stride."""
        s = t.stride()  # one call, not three: host time
        if self.varlen is not None:
            return 0, s[0], s[1]
        return s[0], s[1], s[2]

    def lse_shape(self, q: torch.Tensor) -> tuple[int, ...]:
        # flash_attn's layouts: (batch, nheads, seqlen_q), or (nheads, total_q) in varlen
        return (self.nheads, q.shape[0]) if self.varlen is not None else (self.batch, self.nheads, q.shape[1])

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        s = lse.stride()
        return (0, s[0]) if self.varlen is not None else (s[0], s[1])

    def cu_seqlens(self, like: torch.Tensor):
        if self.varlen is None:
            return like, like  # never read: IS_VARLEN is off
        return self.varlen.cu_seqlens_q, self.varlen.cu_seqlens_k

    def order(self, side: str, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(SeqOrder, SORTED): the sequences longest first by their "q" or "k" lengths, known once
        that cu_seqlens was checked (Varlen.order_*); the grid's slots follow that order.
        Otherwise `like` and False (never read)."""
        order = None if self.varlen is None else getattr(self.varlen, "order_" + side)
        return (like, False) if order is None else (order, True)


def _fill_tails(*slots) -> None:
    """One launch that fills, for each slot (x, cu_seqlens, value, rows_dim, known), the rows of
    x past cu_seqlens[-1] along rows_dim (x: (total, ...) with the other dimensions of a row one
    contiguous block, or lse (nheads, total) with rows_dim=1). At most three slots. A slot whose
    cu_seqlens is known (checks.remembered: known = (last value, longest)) to end at the last
    row needs nothing: no launch then."""
    slots = [slot[:4] for slot in slots if (slot[4] or (-1,))[0] != slot[0].shape[slot[3]]]
    if not slots:
        return
    args = []
    totals = []
    for x, cu_seqlens, value, rows_dim in slots:
        total = x.shape[rows_dim]
        if rows_dim == 0:
            stride_r, stride_c, ncols = x.stride(0), 1, math.prod(x.shape[1:])
        else:
            stride_r, stride_c, ncols = x.stride(1), x.stride(0), x.shape[0]
        args += [x, cu_seqlens, total, stride_r, stride_c, ncols, value]
        totals.append(total)
    if max(totals) == 0:
        return
    args += args[:7] * (3 - len(slots))  # unused slots: never read (SLOTS is a constexpr)
    block_r = 64
    _runtime.launch(_runtime.kernels().fill.fill_tail_kernel, (_cdiv(max(totals), block_r),),
        *args, slots[0][1].shape[0] - 1, SLOTS=len(slots), BLOCK_R=block_r, BLOCK_C=128,
    )


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _sources(geo: _Geometry, use_tma: bool, *pairs: tuple[torch.Tensor, int]) -> tuple[list, bool]:
    """(the kernel's tensor arguments, HOST_DESC) for (tensor, rows of its tile) pairs: with the
    TMA path on dense inputs whose head dim is a power of two and whose heads are adjacent in
    memory, descriptors (_runtime.HostDesc) over (batch, seqlen, heads * headdim) with a
    [1, rows, headdim] box (config.host_desc; _use_tma checked the 16-byte alignment TMA needs);
    otherwise the tensors (the kernels make their own descriptors)."""
    tensors = [t for t, _ in pairs]
    if not (config.host_desc() and use_tma and geo.varlen is None and geo.head_dim == _block_d(geo.head_dim)
            and all(t.stride(2) == geo.head_dim for t in tensors)):
        return tensors, False
    return [_host_desc(t, rows) for t, rows in pairs], True


def _host_desc(t: torch.Tensor, rows: int, gluon: bool = False, cols: int | None = None) -> _runtime.HostDesc:
    """A descriptor over a dense (batch, seqlen, heads, headdim) tensor whose heads are adjacent,
    seen as (batch, seqlen, heads * headdim), with a [1, rows, cols] box (cols: headdim unless
    given); gluon: carrying the shared-memory layout a Gluon kernel is compiled for."""
    b, n, h, d = t.shape
    s = t.stride()
    box = (1, rows, d if cols is None else cols)
    return _runtime.HostDesc((t, (b, n, h * d), (s[0], s[1], 1), box, gluon_layout(t.dtype, box) if gluon else None))


@functools.cache
def gluon_layout(dtype: torch.dtype, box: tuple[int, ...]):
    """The shared-memory layout (NVMMASharedLayout) of a Gluon descriptor's box: Gluon's default
    swizzle for it (tools/compile_check.py compiles the Gluon forward with the same)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), gl_dtype)


_HOPPER_FLAGS = ({"CAUSAL": False, "LOCAL": False, "SOFTCAP": False, "ALIBI": False, "DROPOUT": False},
                 {"CAUSAL": True, "LOCAL": False, "SOFTCAP": False, "ALIBI": False, "DROPOUT": False})


def _gluon_kernels(arch: str, flags: dict, geo: _Geometry, direction: str, q: torch.Tensor,
                   *tensors: torch.Tensor):
    """The Gluon kernels' module for `direction` ("fwd": kernels/fwd_hopper.py, "bwd":
    kernels/bwd_hopper.py) where what both need holds, else None: sm_90 exactly (wgmma, which
    sm_100 lacks), triton 3.6, dense fp16/bf16 inputs with head dim 64, 128 or 256, causal or not
    and no other score modification, and every tensor with its heads adjacent in memory (3-D
    descriptors over (batch, seqlen, heads * headdim)) and TMA's alignment."""
    if not (arch == "sm90" and flags in _HOPPER_FLAGS and geo.varlen is None and geo.head_dim in (64, 128, 256)
            and q.dtype in (torch.float16, torch.bfloat16) and config.wgmma(q.device)):
        return None
    hopper = _runtime.hopper_kernels()
    kernels = getattr(hopper, direction) if hopper is not None else None
    if kernels is None or not (all(t.stride(2) == geo.head_dim for t in tensors) and _use_tma(arch, *tensors)):
        return None
    return kernels


class _ForwardPlan:
    """The Gluon forward's choices for one call signature (_forward_key): kernel, tile, constexprs,
    grid size. A training or serving loop repeats a few signatures, and on the H200's host making
    these choices cost about a third of a forward's host time."""
    __slots__ = ("kernel", "rows", "lse_shape", "tiles", "persist", "ints", "kwargs")

    def __init__(self, kernel, rows, lse_shape, tiles, persist, ints, kwargs):
        self.kernel, self.rows, self.lse_shape, self.tiles = kernel, rows, lse_shape, tiles
        self.persist, self.ints, self.kwargs = persist, ints, kwargs

    def run(self, q, k, v, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out = _runtime.empty(q.shape, q.dtype, q.device)
        lse = _runtime.empty(self.lse_shape, torch.float32, q.device)
        self.launch(q, k, v, out, lse, softmax_scale)
        return out, lse

    def launch(self, q, k, v, out, lse, softmax_scale: float) -> None:
        rows_m, rows_n = self.rows
        s = lse.stride()
        grid = (min(self.tiles, _runtime.sm_count(q.device)) if self.persist else self.tiles,)
        _runtime.launch(self.kernel, grid,
            _host_desc(q, rows_m, gluon=True), _host_desc(k, rows_n, gluon=True), _host_desc(v, rows_n, gluon=True),
            _host_desc(out, rows_m, gluon=True), lse, s[0], s[1], *self.ints, softmax_scale, **self.kwargs)


_FWD_PLANS: dict = {}


def _remember(plans: dict, key, plan) -> None:
    """plans[key] = plan unless key is None; past 1024 signatures (a loop that never repeats one)
    the dict starts over."""
    if key is None:
        return
    if len(plans) >= 1024:
        plans.clear()
    plans[key] = plan


def _forward_key(q, k, v, mods: ScoreMods):
    """What the Gluon forward's choices read (_ForwardPlan), for a dense call without ALiBi or
    dropout; None otherwise (those are not remembered). The output is new and contiguous: its
    layout follows from q's shape."""
    if mods.alibi_slopes is not None or mods.dropout_p != 0:
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16, mods.causal, mods.window_left, mods.window_right,
            mods.softcap, config.state())


def _hopper_forward(q, k, v, out, lse, geo: _Geometry, arch: str, flags: dict, softmax_scale: float,
                    key=None) -> bool:
    """Run the Gluon forward (kernels/fwd_hopper.py) if it applies, and say whether it ran: what
    _gluon_kernels checks, config.gluon on, keys present. Everything else takes kernels/fwd.py. Of
    its three kernels, config.gluon_persist chooses the persistent one (headdim 64 and 128), else
    config.gluon_ws the warp-specialized one (long key sequences) or the one-warpgroup one. With a
    key (_forward_key), the choices are remembered under it (_FWD_PLANS)."""
    kernels = _gluon_kernels(arch, flags, geo, "fwd", q, k, v, out)
    if not (kernels is not None and config.gluon() and geo.max_seqlen_k > 0):
        return False
    causal = flags["CAUSAL"]
    # the persistent kernel (config.gluon_persist: a grid of one program per SM looping over tiles),
    # else the warp-specialized kernel (two consumer warpgroups of block_m rows each per program)
    # on long key sequences, the one-warpgroup kernel on short ones (config.gluon_ws)
    persist = config.gluon_persist(geo.head_dim)
    ws = not persist and config.gluon_ws(geo.head_dim, geo.max_seqlen_k)
    name = "fwd_hopper_persist" if persist else "fwd_hopper_ws" if ws else "fwd_hopper"
    cfg = config.select(name, arch, geo.head_dim, q.dtype, causal, geo.max_seqlen_k)
    extra = (config.gluon_persist_constexprs(cfg, geo.head_dim, causal) if persist
             else {"PINGPONG": config.GLUON_WS_PINGPONG[geo.head_dim]} if ws else {})
    consumers = extra["CONSUMERS"] if persist else kernels.NUM_CONSUMERS.value if ws else 1
    tiles = _cdiv(geo.max_seqlen_q, cfg.block_m * consumers) * geo.batch * geo.nheads
    kernel = (kernels.attn_fwd_persist_kernel if persist else kernels.attn_fwd_ws_kernel if ws
              else kernels.attn_fwd_hopper_kernel)
    plan = _ForwardPlan(kernel, (cfg.block_m, cfg.block_n), lse.shape, tiles, persist,
        (geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k),
        dict(CAUSAL=causal, HEAD_DIM=geo.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
             **extra,
             num_warps=4 if persist else cfg.num_warps))  # the persistent kernel's: its default partition's
    plan.launch(q, k, v, out, lse, softmax_scale)
    _remember(_FWD_PLANS, key, plan)
    return True


def _hopper_backward_kernels(q, k, v, dout, geo: _Geometry, arch: str, flags: dict):
    """The Gluon backward's module (kernels/bwd_hopper.py, warp-specialized) where it applies, else
    None: what _gluon_kernels checks (of Q, K, V and dO), the key blocks within CUDA's 65535 on the
    grid's second axis (_bwd_grid; 64 keys per block at least), and config.gluon_bwd (on unless
    turned off); the caller asks only for deterministic=False."""
    kernels = _gluon_kernels(arch, flags, geo, "bwd", q, k, v, dout)
    if kernels is not None and _cdiv(geo.max_seqlen_k, 64) <= _GRID_YZ and config.gluon_bwd():
        return kernels
    return None


def _preprocess(out, dout, lse, dlse, geo: _Geometry, delta: torch.Tensor, seqlen_pad: int | None = None,
                lse_pad: torch.Tensor | None = None, acc: torch.Tensor | None = None) -> tuple:
    """delta = rowsum(dO * O) - dlse into `delta` (lse's shape, or with seqlen_pad its rows padded).
    With seqlen_pad (the Gluon backward, dense inputs): delta (batch, nheads, seqlen_pad) gets 0 past
    seqlen_q, the fp32 dQ accumulator `acc` (batch, seqlen_pad, nheads, headdim) is zeroed, and
    `lse_pad` (delta's shape), if given, gets lse with +inf past seqlen_q -- one launch. Returns the
    launch's (grid, integer arguments, keywords): _BackwardPlan repeats it with them."""
    padded = seqlen_pad is not None
    rows = seqlen_pad if padded else geo.max_seqlen_q
    block_d = _block_d(geo.head_dim)
    pre_m = 64 if block_d <= 128 else 32
    acc_strides = acc.stride()[:3] if padded else (0, 0, 0)
    grid = (_cdiv(rows, pre_m) * geo.batch * geo.nheads,)
    ints = (*geo.strides(out), *geo.strides(dout), *geo.lse_strides(lse), *geo.lse_strides(delta), *acc_strides,
            geo.nheads, geo.max_seqlen_q, rows)
    kwargs = dict(HAS_DLSE=dlse is not None, IS_VARLEN=geo.varlen is not None, PADDED=padded,
                  COPY_LSE=lse_pad is not None, HEAD_DIM=geo.head_dim, BLOCK_M=pre_m, BLOCK_D=block_d)
    pre = (grid, ints, kwargs)
    _launch_preprocess(pre, out, dout, lse, dlse, delta, geo.cu_seqlens(lse)[0], lse_pad, acc if padded else delta)
    return pre


def _launch_preprocess(pre: tuple, out, dout, lse, dlse, delta, cu_seqlens, lse_pad, acc) -> None:
    """The delta preprocess launch with _preprocess's (grid, integer arguments, keywords); the
    tensors absent from the call (dlse, lse_pad) get delta in their places (never read)."""
    grid, ints, kwargs = pre
    _runtime.launch(_runtime.kernels().bwd.attn_bwd_preprocess_kernel, grid,
        out, dout, delta, dlse if dlse is not None else delta, cu_seqlens, lse,
        lse_pad if lse_pad is not None else delta, acc, *ints, **kwargs)


_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (the first: 2^31 - 1)


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _bwd_grid(n_n: int, n_bh: int, heads: int) -> tuple[int, int, int]:
    """The Gluon backward's grid (G, n_n, n_bh // G) for n_n key blocks and n_bh (batch, kv head) pairs: CUDA starts
    its programs x fastest (observed), so the heads go in groups of G, each group key block by key block
    (kernels/bwd_hopper.py, _ws_program). G is the largest divisor of n_bh (whole groups) not above `heads`
    (config.gluon_bwd_l2_heads; a prime n_bh below it gets 1, the head-major order), or the smallest that keeps
    n_bh // G within CUDA's 65535."""
    divisors = _divisors(n_bh)
    g = max(d for d in divisors if d <= max(heads, 1))
    if n_bh // g > _GRID_YZ:
        g = min(d for d in divisors if n_bh // d <= _GRID_YZ)
    return g, n_n, n_bh // g


class _BackwardPlan:
    """The Gluon backward's choices for one call signature (_backward_key): tile, ring constexprs,
    padded length. See _ForwardPlan."""
    __slots__ = ("kernels", "geo", "arch", "flags", "cfg", "rings", "seqlen_q_pad", "grid", "pre")

    def __init__(self, kernels, geo: _Geometry, arch: str, flags: dict, dtype: torch.dtype):
        split = config.gluon_bwd_split(geo.head_dim)
        cfg = config.select("bwd_hopper_split" if split else "bwd_hopper", arch, geo.head_dim, dtype, flags["CAUSAL"])
        self.kernels, self.geo, self.arch, self.flags, self.cfg = kernels, geo, arch, flags, cfg
        self.rings = config.gluon_bwd_rings(geo.head_dim, split, cfg.num_stages)
        self.seqlen_q_pad = _cdiv(geo.max_seqlen_q, cfg.block_m) * cfg.block_m
        # the grid, whose shape is the programs' order (_bwd_grid): at most as many heads per group as keep their Q
        # and dO (a kv head's query heads') in L2
        head_bytes = 2 * geo.max_seqlen_q * geo.head_dim * dtype.itemsize * (geo.nheads // geo.nheads_k)
        n_bh = geo.batch * geo.nheads_k
        self.grid = _bwd_grid(_cdiv(geo.max_seqlen_k, cfg.block_n), n_bh,
                              config.gluon_bwd_l2_heads(flags["CAUSAL"], n_bh, head_bytes))
        self.pre = None  # the preprocess launch's grid and integer arguments (_preprocess), at the first run

    def run(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale: float) -> None:
        geo, cfg, rings, arch = self.geo, self.cfg, self.rings, self.arch
        seqlen_q, seqlen_k, seqlen_q_pad = geo.max_seqlen_q, geo.max_seqlen_k, self.seqlen_q_pad
        delta = _runtime.empty((geo.batch, geo.nheads, seqlen_q_pad), torch.float32, q.device)
        # the kernel reads lse and delta with one set of strides (lse arrives contiguous): a tail needs a padded copy
        lse_pad = _runtime.empty(delta.shape, torch.float32, q.device) if seqlen_q_pad != seqlen_q else None
        acc = _runtime.empty((geo.batch, seqlen_q_pad, geo.nheads, geo.head_dim), torch.float32, q.device)
        if self.pre is None:  # strides and shapes all follow from the key's
            self.pre = _preprocess(out, dout, lse, dlse, geo, delta, seqlen_q_pad, lse_pad, acc)
        else:  # (dense: lse in cu_seqlens' place, never read)
            _launch_preprocess(self.pre, out, dout, lse, dlse, delta, lse, lse_pad, acc)
        lse = lse_pad if lse_pad is not None else lse
        # dK/dV by TMA store where their heads are adjacent and aligned (and their dtype is the inputs'),
        # else into buffers copied back
        gk, gv = (g if g.dtype == q.dtype and g.stride(2) == geo.head_dim and _use_tma(arch, g)
                  else _runtime.empty(g.shape, q.dtype, g.device) for g in (dk, dv))
        bm, bn = cfg.block_m, cfg.block_n
        lse_strides = delta.stride()
        _runtime.launch(self.kernels.attn_bwd_ws_kernel, self.grid,
            _host_desc(q, bm, gluon=True), _host_desc(k, bn, gluon=True), _host_desc(v, bn, gluon=True),
            _host_desc(dout, bm, gluon=True), _host_desc(gk, bn, gluon=True), _host_desc(gv, bn, gluon=True),
            _host_desc(acc, bm, gluon=True, cols=geo.head_dim // rings["DQ_SPLIT"]),
            lse, delta, softmax_scale,
            seqlen_q, seqlen_k, seqlen_q_pad, geo.nheads, geo.nheads_k, lse_strides[0], lse_strides[1],
            CAUSAL=self.flags["CAUSAL"],
            HEAD_DIM=geo.head_dim,
            BLOCK_M=bm,
            BLOCK_N=bn,
            STAGES=cfg.num_stages,
            GQA=geo.nheads != geo.nheads_k,
            **rings,
            num_warps=cfg.num_warps,
        )
        dq.copy_(acc[:, :seqlen_q] if seqlen_q_pad != seqlen_q else acc)
        for dst, src in ((dk, gk), (dv, gv)):
            if src is not dst:
                dst.copy_(src)


_BWD_PLANS: dict = {}


def _backward_key(dout, q, k, v, out, dlse, mods: ScoreMods):
    """What the Gluon backward's choices read (_BackwardPlan) for a dense call without ALiBi or
    dropout, or None. (Where dK/dV are written is decided at each call.)"""
    if mods.alibi_slopes is not None or mods.dropout_p != 0:
        return None
    return (q.shape, k.shape, v.shape, out.shape, dout.shape, q.stride(), k.stride(), v.stride(), out.stride(),
            dout.stride(), q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, q.device,
            (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | dout.data_ptr()) % 16, dlse is None,
            mods.causal, mods.window_left, mods.window_right, mods.softcap, config.state())


def _hopper_backward(kernels, dout, q, k, v, out, lse, dlse, dq, dk, dv, geo: _Geometry, arch: str, flags: dict,
                     softmax_scale: float, key=None) -> None:
    """The Gluon backward (kernels/bwd_hopper.py; _hopper_backward_kernels chose it). One
    preprocess launch writes what it reads besides the inputs (_preprocess): delta, the zeroed fp32
    dQ accumulator whose rows are padded to a multiple of BLOCK_M, and, where seqlen_q is not such
    a multiple, lse (contiguous: backward makes it so) padded the same way (+inf; delta 0: the
    padded rows contribute nothing). Then the kernel, then dQ cast from the accumulator into dq.
    With a key (_backward_key), the choices are remembered under it (_BWD_PLANS)."""
    plan = _BackwardPlan(kernels, geo, arch, flags, q.dtype)
    plan.run(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale)
    _remember(_BWD_PLANS, key, plan)


def _score_scalars(runtime: dict, softmax_scale: float) -> tuple:
    """The score arguments the forward, dK/dV and dQ kernels take in this order: window_left,
    window_right, sm_scale, softcap, dropout_p."""
    return runtime["window_left"], runtime["window_right"], softmax_scale, runtime["softcap"], runtime["dropout_p"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, mods: ScoreMods,
            varlen: Varlen | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q in q's dtype; lse fp32 (batch, nheads, seqlen_q), or (nheads, total_q) in varlen."""
    key = _forward_key(q, k, v, mods) if varlen is None and not _runtime.interpreted() else None
    if key is not None:
        plan = _FWD_PLANS.get(key)
        if plan is not None:
            return plan.run(q, k, v, softmax_scale)
    geo = _Geometry.of(q, k, varlen)
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    out = _runtime.empty(q.shape, _out_dtype(q.dtype, arch), q.device)
    lse = _runtime.empty(geo.lse_shape(q), torch.float32, q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    if geo.batch == 0 or geo.max_seqlen_q == 0:  # varlen with no query rows in any sequence
        out.zero_(), lse.fill_(float("inf"))
        return out.to(q.dtype), lse
    runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    if _hopper_forward(q, k, v, out, lse, geo, arch, flags, softmax_scale, key):
        return out, lse
    cfg = config.select("fwd", arch, geo.head_dim, q.dtype, flags["CAUSAL"])
    grid = (_cdiv(geo.max_seqlen_q, cfg.block_m) * geo.batch * geo.nheads,)
    # a query block's work grows with its sequence's keys: order the slots by cu_seqlens_k
    order, is_sorted = geo.order("k", lse)
    tma = _flags(q, arch, q, k, v, out)
    sources, host_desc = _sources(geo, tma["USE_TMA"], (q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n),
                                  (out, cfg.block_m))
    _runtime.launch(_runtime.kernels().fwd.attn_fwd_kernel, grid,
        *sources, lse, runtime["Alibi"], *geo.cu_seqlens(lse), runtime["Seed"], order,
        *geo.strides(q), *geo.strides(k), *geo.strides(v), *geo.strides(out),
        *geo.lse_strides(lse),
        runtime["stride_alibi_b"],
        geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k,
        *_score_scalars(runtime, softmax_scale),
        **flags,
        IS_VARLEN=varlen is not None,
        SORTED=is_sorted,
        **tma,
        HOST_DESC=host_desc,
        HEAD_DIM=geo.head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=_block_d(geo.head_dim),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if varlen is not None:
        cu_q, known_q = varlen.cu_seqlens_q, varlen.known_q
        _fill_tails((out, cu_q, 0.0, 0, known_q), (lse, cu_q, float("inf"), 1, known_q))
    return out.to(q.dtype), lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
             dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
             softmax_scale: float, mods: ScoreMods, varlen: Varlen | None = None,
             deterministic: bool = True) -> None:
    """Writes dq, dk, dv (any strides with a contiguous last dim; views of one packed tensor are
    fine). `dlse` is the gradient flowing into the returned logsumexp, or None. deterministic=False
    lets config.dq_atomic choose atomics for dQ (run-to-run differences in its rounding)."""
    # the kernels read lse, dlse and delta with one set of strides, lse's: all contiguous
    # (registry.bwd_impl makes lse and dlse so; direct callers may not)
    lse = lse if lse.is_contiguous() else lse.contiguous()
    dlse = dlse if dlse is None or dlse.is_contiguous() else dlse.contiguous()
    key = None
    if not deterministic and varlen is None and not _runtime.interpreted():
        key = _backward_key(dout, q, k, v, out, dlse, mods)
        plan = _BWD_PLANS.get(key)
        if plan is not None:
            plan.run(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale)
            return
    geo = _Geometry.of(q, k, varlen)
    if q.numel() == 0 or k.numel() == 0 or geo.batch == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    runtime, mod_flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    hopper = None if deterministic else _hopper_backward_kernels(q, k, v, dout, geo, arch, mod_flags)
    if hopper is not None:
        _hopper_backward(hopper, dout, q, k, v, out, lse, dlse, dq, dk, dv, geo, arch, mod_flags, softmax_scale,
                         key)
        return
    K = _runtime.kernels().bwd
    block_d = _block_d(geo.head_dim)
    cu_q, cu_k = geo.cu_seqlens(lse)
    is_varlen = varlen is not None

    # delta = rowsum(dO * O) - dlse: the lse gradient enters dS = P * (dP - delta) for free
    delta = _runtime.empty(lse.shape, torch.float32, q.device)
    _preprocess(out, dout, lse, dlse, geo, delta)

    dq_atomic = not deterministic and config.dq_atomic(arch, geo.head_dim)
    # where the kernels write: the interpreter writes fp32 and torch casts; atomic dQ adds into
    # an fp32 accumulator (zeros: rows no key block reaches). Copied into dq, dk, dv at the end.
    gq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dq_atomic else dq
    gk, gv = dk, dv
    if arch == "interp":
        gk, gv = (_runtime.empty(g.shape, torch.float32, g.device) for g in (dk, dv))
        gq = gq if dq_atomic else _runtime.empty(dq.shape, torch.float32, dq.device)
    if is_varlen:
        # rows past cu_seqlens[-1] belong to no sequence: their gradient is 0
        known_q, known_k = varlen.known_q, varlen.known_k
        _fill_tails((gq, cu_q, 0.0, 0, known_q), (gk, cu_k, 0.0, 0, known_k), (gv, cu_k, 0.0, 0, known_k))
    flags = _flags(q, arch, q, k, v, dout, gq, gk, gv)
    group = geo.nheads // geo.nheads_k
    causal = mod_flags["CAUSAL"]
    common = dict(**mod_flags, IS_VARLEN=is_varlen, **flags, HEAD_DIM=geo.head_dim, BLOCK_D=block_d)
    # longest first: a key block's work grows with its sequence's queries, a query block's with its keys
    order_q, sorted_q = geo.order("q", cu_q)
    order_k, sorted_k = geo.order("k", cu_k)

    cfg = config.select("bwd_dkdv_atomic" if dq_atomic else "bwd_dkdv", arch, geo.head_dim, q.dtype, causal)
    (sq, sk, sv, sdo, sdk, sdv), host_desc = _sources(
        geo, flags["USE_TMA"], (q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (dout, cfg.block_m),
        (gk, cfg.block_n), (gv, cfg.block_n))
    _runtime.launch(K.attn_bwd_dkdv_kernel, (_cdiv(geo.max_seqlen_k, cfg.block_n) * geo.batch * geo.nheads_k,),
        sq, sk, sv, sdo, lse, delta, sdk, sdv, gq if dq_atomic else delta, runtime["Alibi"], cu_q, cu_k,
        runtime["Seed"], order_q,
        *geo.strides(q), *geo.strides(k), *geo.strides(v), *geo.strides(dout), *geo.strides(gk),
        *geo.strides(gv), *(geo.strides(gq) if dq_atomic else (0, 0, 0)),
        *geo.lse_strides(lse),
        runtime["stride_alibi_b"],
        geo.nheads, geo.nheads_k, geo.max_seqlen_q, geo.max_seqlen_k, group,
        *_score_scalars(runtime, softmax_scale),
        **common,
        SORTED=sorted_q,
        HOST_DESC=host_desc,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DQ_ATOMIC=dq_atomic,
        DQ_BULK=dq_atomic and flags["USE_TMA"] and arch != "interp",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not dq_atomic:  # the deterministic dQ: one program per query block over its key blocks
        cfg = config.select("bwd_dq", arch, geo.head_dim, q.dtype, causal)
        (sq, sk, sv, sdo, sdq), host_desc = _sources(
            geo, flags["USE_TMA"], (q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (dout, cfg.block_m),
            (gq, cfg.block_m))
        _runtime.launch(K.attn_bwd_dq_kernel, (_cdiv(geo.max_seqlen_q, cfg.block_m) * geo.batch * geo.nheads,),
            sq, sk, sv, sdo, lse, delta, sdq, runtime["Alibi"], cu_q, cu_k, runtime["Seed"], order_k,
            *geo.strides(q), *geo.strides(k), *geo.strides(v), *geo.strides(dout), *geo.strides(gq),
            *geo.lse_strides(lse),
            runtime["stride_alibi_b"],
            geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, group,
            *_score_scalars(runtime, softmax_scale),
            **common,
            SORTED=sorted_k,
            HOST_DESC=host_desc,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        if src is not dst:
            dst.copy_(src)


def dropout_probs(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, mods: ScoreMods,
                  varlen: Varlen | None = None) -> torch.Tensor:
    """S_dmask (batch, nheads, round128(seqlen_q), round128(seqlen_k)) in q's dtype: exp(score -
    rowmax) where kept, its negative where dropped, 0 where not visible (a testing aid)."""
    geo = _Geometry.of(q, k, varlen)
    round128 = lambda n: _cdiv(n, 128) * 128
    arch = "interp" if _runtime.interpreted() else config.arch_of(q.device)
    shape = (geo.batch, geo.nheads, round128(geo.max_seqlen_q), round128(geo.max_seqlen_k))
    probs = torch.zeros(shape, dtype=_out_dtype(q.dtype, arch), device=q.device)
    if probs.numel() == 0 or geo.max_seqlen_q == 0:
        return probs.to(q.dtype)
    runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, probs)
    block_m, block_n = 64, 64
    _runtime.launch(_runtime.kernels().dmask.attn_dropout_mask_kernel, (_cdiv(geo.max_seqlen_q, block_m) * geo.batch * geo.nheads,),
        q, k, probs, runtime["Alibi"], *geo.cu_seqlens(probs), runtime["Seed"],
        *geo.strides(q), *geo.strides(k),
        probs.stride(0), probs.stride(1), probs.stride(2),
        runtime["stride_alibi_b"],
        geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k,
        runtime["window_left"], runtime["window_right"],
        softmax_scale, runtime["dropout_p"],
        CAUSAL=flags["CAUSAL"],
        LOCAL=flags["LOCAL"],
        ALIBI=flags["ALIBI"],
        IS_VARLEN=varlen is not None,
        UPCAST=arch == "interp" or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if arch == "interp" or q.dtype == torch.float32 else "tf32",
        HEAD_DIM=geo.head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(geo.head_dim),
    )
    return probs.to(q.dtype)
