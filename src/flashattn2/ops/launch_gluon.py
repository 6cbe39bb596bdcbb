"""The Gluon kernels' launches (kernels/fwd_hopper.py, kernels/bwd_hopper.py: sm_90, dense, causal or not).

A training or serving loop repeats a few call signatures, and on the H200's host making the choices below cost
about a third of a forward's host time: each launch's arguments beyond the tensors are made once per prepared call
(ops.call: ForwardLaunch and BackwardLaunch are kept on the call of their spec) and reused by its later calls."""

from __future__ import annotations

import torch

from . import _runtime, launcher
from .geometry import Geometry, cdiv, column_parts
from .launch_triton import SinkGrad, launch_preprocess, preprocess
from .planning import Plan
from .tma import host_desc, use_tma

_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (the first: 2^31 - 1)


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
