"""The Gluon kernels' launches (kernels/fwd_hopper.py, kernels/bwd_hopper.py: sm_90, dense, causal or not).

A training or serving loop repeats a few call signatures, and on the H200's host making the choices below cost
about a third of a forward's host time: each launch's arguments beyond the tensors are kept per signature
(ForwardLaunch, BackwardLaunch in FWD_PLANS / BWD_PLANS, keyed by forward_key / backward_key)."""

from __future__ import annotations

import torch

from . import _runtime, launcher, planning
from .geometry import Geometry, cdiv, column_parts
from .launch_triton import SinkGrad, launch_preprocess, preprocess
from .options import ScoreMods
from .planning import Plan
from .tma import host_desc, use_tma

_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (the first: 2^31 - 1)


def ready(direction: str, arch: str, geo: Geometry, q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """What planning.Features.gluon says for a call: sm_90 exactly (wgmma, which sm_100 lacks), the Gluon module
    for `direction` ("fwd", "bwd") importing under this Triton, dense inputs, and every tensor with its heads
    adjacent in memory (3-D descriptors over (batch, seqlen, heads * headdim)) and TMA's alignment; the (q/k, v)
    head dims a pair of planning.GLUON_HEAD_DIMS[direction] (a `v = k[..., :dv]` view has heads that are not
    adjacent: it runs the Triton kernels)."""
    if not (
        arch == "sm90"
        and geo.varlen is None
        and (geo.head_dim, geo.head_dim_v) in planning.GLUON_HEAD_DIMS[direction]
        and planning.wgmma(q.device)
    ):
        return False
    if not (all(t.stride(2) == t.shape[3] for t in tensors) and use_tma(arch, *tensors)):
        return False
    hopper = _runtime.hopper_kernels()
    if hopper is None or getattr(hopper, direction) is None:
        if planning.forced().hopper is not False:  # not asked for the Triton kernels: say what is lost
            _runtime.warn_without_gluon(direction)
        return False
    return True


def remember(plans: dict, key, launch) -> None:
    """plans[key] = launch unless key is None; past 1024 signatures (a loop that never repeats one)
    the dict starts over."""
    if key is None:
        return
    if len(plans) >= 1024:
        plans.clear()
    plans[key] = launch


class ForwardLaunch:
    """The Gluon forward of one call signature: kernel, tile rows, grid size, integer arguments, constexprs (sink:
    whether the call has a learnable sink, the tensor passed to each run)."""

    __slots__ = ("kernel", "rows", "lse_shape", "head_dim_v", "tiles", "persist", "ints", "kwargs")

    def __init__(self, plan: Plan, geo: Geometry, lse_shape, sink: bool):
        kernels = _runtime.hopper_kernels().fwd
        self.persist = plan.kernel == "fwd_hopper_persist"
        self.kernel = kernels.attn_fwd_persist_kernel if self.persist else kernels.attn_fwd_ws_kernel
        cfg = plan.tile
        self.rows, self.lse_shape, self.head_dim_v = (cfg.block_m, cfg.block_n), lse_shape, geo.head_dim_v
        self.tiles = cdiv(geo.max_seqlen_q, plan.rows) * geo.batch * geo.nheads
        self.ints = (geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k)
        self.kwargs = dict(
            CAUSAL=plan.causal,
            SINK=sink,
            HEAD_DIM=geo.head_dim,
            HEAD_DIM_V=geo.head_dim_v,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.num_stages,
            **dict(plan.constexprs),
            num_warps=plan.num_warps,
        )

    def run(self, q, k, v, softmax_scale: float, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
        out = _runtime.empty((*q.shape[:-1], self.head_dim_v), q.dtype, q.device)
        lse = _runtime.empty(self.lse_shape, torch.float32, q.device)
        self.launch(q, k, v, out, lse, softmax_scale, sinks)
        return out, lse

    def launch(self, q, k, v, out, lse, softmax_scale: float, sinks=None) -> None:
        rows_m, rows_n = self.rows
        s = lse.stride()
        grid = (min(self.tiles, _runtime.sm_count(q.device)) if self.persist else self.tiles,)
        # q's and k's head dim in two parts where it is not a power of two (kernels/fwd_hopper_tile.py's FwdConfig)
        hi, lo = column_parts(q.shape[-1])
        launcher.launch(
            self.kernel,
            grid,
            host_desc(q, rows_m, gluon=True, cols=hi),
            host_desc(k, rows_n, gluon=True, cols=hi),
            host_desc(v, rows_n, gluon=True),
            host_desc(out, rows_m, gluon=True),
            host_desc(q, rows_m, gluon=True, cols=lo) if lo else None,
            host_desc(k, rows_n, gluon=True, cols=lo) if lo else None,
            lse,
            sinks if sinks is not None else lse,
            s[0],
            s[1],
            *self.ints,
            softmax_scale,
            **self.kwargs,
        )


FWD_PLANS: dict = {}


def forward_key(q, k, v, mods: ScoreMods):
    """What the Gluon forward's choices read (ForwardLaunch), for a dense call without ALiBi or
    dropout; None otherwise (those are not remembered). The output is new and contiguous: its
    layout follows from q's shape. A sink enters as present or not (its tensor is an argument of each run)."""
    if mods.alibi_slopes is not None or mods.dropout_p != 0:
        return None
    return (
        q.shape,
        k.shape,
        v.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16,
        mods.causal,
        mods.window_left,
        mods.window_right,
        mods.softcap,
        mods.sinks is not None,
        planning.forced(),
    )


def forward(plan: Plan, q, k, v, out, lse, geo: Geometry, softmax_scale: float, sinks=None, key=None) -> None:
    """The Gluon forward (the plan's fwd_hopper_persist or fwd_hopper_ws) into out and lse; remembered under key."""
    launch = ForwardLaunch(plan, geo, lse.shape, sinks is not None)
    launch.launch(q, k, v, out, lse, softmax_scale, sinks)
    remember(FWD_PLANS, key, launch)


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def bwd_grid(n_n: int, n_bh: int, heads: int) -> tuple[int, int, int]:
    """The Gluon backward's grid (G, n_n, n_bh // G) for n_n key blocks and n_bh (batch, kv head) pairs: CUDA starts
    its programs x fastest (observed), so the heads go in groups of G, each group key block by key block
    (kernels/bwd_hopper_config.py, _ws_program). G is the largest divisor of n_bh (whole groups) not above `heads`
    (l2_heads; a prime n_bh below it gets 1, the head-major order), or the smallest that keeps
    n_bh // G within CUDA's 65535."""
    divisors = _divisors(n_bh)
    g = max(d for d in divisors if d <= max(heads, 1))
    if n_bh // g > _GRID_YZ:
        g = min(d for d in divisors if n_bh // d <= _GRID_YZ)
    return g, n_n, n_bh // g


def l2_heads(budget: int, n_bh: int, bytes_per_bh: int) -> int:
    """Heads (batch, kv head pairs) per group in the Gluon backward's program order: 1, the head-major order, when
    the plan's budget (Plan.l2_group_bytes) is 0; else as many of the n_bh heads as the budget holds of
    bytes_per_bh each (a head's Q and dO, its group of query heads')."""
    if budget == 0:
        return 1
    return max(1, min(n_bh, budget // bytes_per_bh))


class BackwardLaunch:
    """The Gluon backward of one call signature: tile, ring constexprs, padded length, grid (see ForwardLaunch).
    One preprocess launch writes what the kernel reads besides the inputs (launch_triton.preprocess): delta,
    the zeroed fp32 dQ accumulator whose rows are padded to a multiple of BLOCK_M, and, where seqlen_q is not
    such a multiple, lse (contiguous) padded the same way (+inf; delta 0: the padded rows contribute nothing).
    Then the kernel, then dQ cast from the accumulator into dq."""

    __slots__ = ("kernels", "geo", "arch", "plan", "seqlen_q_pad", "grid", "pre")

    def __init__(self, plan: Plan, geo: Geometry, arch: str, dtype: torch.dtype):
        self.kernels, self.geo, self.arch, self.plan = _runtime.hopper_kernels().bwd, geo, arch, plan
        cfg = plan.tile
        self.seqlen_q_pad = cdiv(geo.max_seqlen_q, cfg.block_m) * cfg.block_m
        # the grid, whose shape is the programs' order (bwd_grid): at most as many heads per group as keep their Q
        # and dO (a kv head's query heads') in L2
        head_bytes = 2 * geo.max_seqlen_q * geo.head_dim * dtype.itemsize * (geo.nheads // geo.nheads_k)
        n_bh = geo.batch * geo.nheads_k
        self.grid = bwd_grid(cdiv(geo.max_seqlen_k, cfg.block_n), n_bh, l2_heads(plan.l2_group_bytes, n_bh, head_bytes))
        self.pre = None  # the preprocess launch's grid and integer arguments (preprocess), at the first run

    def run(self, dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale: float, sinks=None, dsink=None) -> None:
        geo, plan, arch = self.geo, self.plan, self.arch
        cfg, rings = plan.tile, dict(plan.constexprs)
        seqlen_q, seqlen_k, seqlen_q_pad = geo.max_seqlen_q, geo.max_seqlen_k, self.seqlen_q_pad
        delta = _runtime.empty((geo.batch, geo.nheads, seqlen_q_pad), torch.float32, q.device)
        # the kernel reads lse and delta with one set of strides (lse arrives contiguous): a tail needs a padded copy
        lse_pad = _runtime.empty(delta.shape, torch.float32, q.device) if seqlen_q_pad != seqlen_q else None
        acc = _runtime.empty((geo.batch, seqlen_q_pad, geo.nheads, geo.head_dim), torch.float32, q.device)
        sink = SinkGrad(sinks, dsink, geo.batch) if sinks is not None else None
        if self.pre is None:  # strides and shapes all follow from the key's
            self.pre = preprocess(out, dout, lse, dlse, geo, delta, seqlen_q_pad, lse_pad, acc, sink)
        else:  # (dense: lse in cu_seqlens' place, never read)
            launch_preprocess(self.pre, out, dout, lse, dlse, delta, lse, lse_pad, acc, sink)
        lse = lse_pad if lse_pad is not None else lse
        # dK/dV by TMA store where their heads are adjacent and aligned (and their dtype is the inputs'),
        # else into buffers copied back
        gk, gv = (
            g
            if g.dtype == q.dtype and g.stride(2) == g.shape[3] and use_tma(arch, g)
            else _runtime.empty(g.shape, q.dtype, g.device)
            for g in (dk, dv)
        )
        bm, bn = cfg.block_m, cfg.block_n
        lse_strides = delta.stride()
        # q's and k's head dim in two parts where it is not a power of two (kernels/bwd_hopper_config.py's BwdConfig): Q, K,
        # dK and the dQ accumulator get a descriptor for each (dQ_i's parts are the head dim's)
        hi, lo = column_parts(geo.head_dim)
        lo_desc = (lambda t, rows: host_desc(t, rows, gluon=True, cols=lo)) if lo else (lambda t, rows: None)
        launcher.launch(
            self.kernels.attn_bwd_ws_kernel,
            self.grid,
            host_desc(q, bm, gluon=True, cols=hi),
            host_desc(k, bn, gluon=True, cols=hi),
            host_desc(v, bn, gluon=True),
            host_desc(dout, bm, gluon=True),
            host_desc(gk, bn, gluon=True, cols=hi),
            host_desc(gv, bn, gluon=True),
            host_desc(acc, bm, gluon=True, cols=hi if lo else geo.head_dim // rings["DQ_SPLIT"]),
            lo_desc(q, bm),
            lo_desc(k, bn),
            lo_desc(gk, bn),
            lo_desc(acc, bm),
            lse,
            delta,
            softmax_scale,
            seqlen_q,
            seqlen_k,
            seqlen_q_pad,
            geo.nheads,
            geo.nheads_k,
            lse_strides[0],
            lse_strides[1],
            CAUSAL=plan.causal,
            HEAD_DIM=geo.head_dim,
            HEAD_DIM_V=geo.head_dim_v,
            BLOCK_M=bm,
            BLOCK_N=bn,
            STAGES=cfg.num_stages,
            GQA=geo.nheads != geo.nheads_k,
            **rings,
            num_warps=plan.num_warps,
        )
        dq.copy_(acc[:, :seqlen_q] if seqlen_q_pad != seqlen_q else acc)
        for dst, src in ((dk, gk), (dv, gv)):
            if src is not dst:
                dst.copy_(src)


BWD_PLANS: dict = {}


def backward_key(dout, q, k, v, out, dlse, mods: ScoreMods):
    """What the Gluon backward's choices read (BackwardLaunch) for a dense call without ALiBi or
    dropout, or None. (Where dK/dV are written is decided at each call.)"""
    if mods.alibi_slopes is not None or mods.dropout_p != 0:
        return None
    return (
        q.shape,
        k.shape,
        v.shape,
        out.shape,
        dout.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        out.stride(),
        dout.stride(),
        q.dtype,
        k.dtype,
        v.dtype,
        out.dtype,
        dout.dtype,
        q.device,
        (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | dout.data_ptr()) % 16,
        dlse is None,
        mods.causal,
        mods.window_left,
        mods.window_right,
        mods.softcap,
        mods.sinks is not None,
        planning.forced(),
    )


def backward(
    plan: Plan,
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    dq,
    dk,
    dv,
    geo: Geometry,
    arch: str,
    softmax_scale: float,
    sinks=None,
    dsink=None,
    key=None,
) -> None:
    """The Gluon backward (the plan's bwd_hopper) into dq, dk, dv (and the sink's gradient); remembered under key."""
    launch = BackwardLaunch(plan, geo, arch, q.dtype)
    launch.run(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, sinks, dsink)
    remember(BWD_PLANS, key, launch)
