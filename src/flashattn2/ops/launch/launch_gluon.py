"""The Gluon kernels' launches (kernels/fwd_hopper.py, kernels/bwd_hopper.py: sm_90, dense, causal or not).

A training or serving loop repeats a few call signatures, and on the H200's host making the choices below cost
about a third of a forward's host time: each launch's arguments beyond the tensors are made once per prepared call
(ops.run.call: ForwardLaunch and BackwardLaunch are kept on the call of their spec) and reused by its later calls."""

from __future__ import annotations

import torch

from ...kernels.constexprs import FP8_KEY_DIMS, FP8_KEY_GROUP, FP8_KEY_ORDER
from .. import _runtime
from . import launcher
from ..request import spec as specs
from ..planning.geometry import cdiv, column_parts
from .launch_triton import Preprocess, PreprocessTensors, SinkGrad
from .layout import BackwardTensors, ForwardTensors, Layout
from ..planning import Plan, tma_ok
from .tma import gluon_layout, host_desc

_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes (the first: 2^31 - 1)


class ForwardLaunch:
    """The Gluon forward (the plan's fwd_hopper_persist or fwd_hopper_ws) of one prepared call: kernel, tile rows,
    grid size, integer arguments and constexprs made once (sink: whether the call has a learnable sink). FP8 (e4m3
    q, k, v): V goes to the kernel transposed, a copy per call (vt_shape: (batch, kv heads, v's head dim, keys
    padded to 32), keys contiguous: wgmma's e4m3 operands are K-major; fp8_vt), with the descales; O is bf16."""

    __slots__ = ("launch", "rows", "layout", "tiles", "persist", "ints", "parts", "dropped_lse", "vt_shape")

    def __init__(self, plan: Plan, layout: Layout, sink: bool):
        kernels = _runtime.hopper_kernels().fwd
        self.persist = plan.kernel == "fwd_hopper_persist"
        self.dropped_lse = None
        kernel = kernels.attn_fwd_persist_kernel if self.persist else kernels.attn_fwd_ws_kernel
        cfg = plan.tile
        self.rows, self.layout = (cfg.block_m, cfg.block_n), layout
        self.tiles = cdiv(layout.max_seqlen_q, plan.rows) * layout.batch * layout.nheads
        # q's and k's head dim in two parts where it is not a power of two (kernels/fwd_hopper_tile.py's FwdConfig)
        self.parts = column_parts(layout.head_dim)
        self.ints = (*layout.lse_strides, *layout.shape, layout.score.sm_scale)
        self.vt_shape = None
        if layout.descale_strides is not None:
            keys = -(-layout.v_keys // FP8_KEY_GROUP) * FP8_KEY_GROUP
            self.vt_shape = (layout.batch, layout.nheads_k, layout.head_dim_v, keys)
        self.launch = launcher.Launch(
            kernel,
            CAUSAL=plan.causal,
            SINK=sink,
            HEAD_DIM=layout.head_dim,
            HEAD_DIM_V=layout.head_dim_v,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.num_stages,
            **dict(plan.constexprs),
            num_warps=plan.num_warps,
        )

    def __call__(self, t: ForwardTensors, lse_wanted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse), as launch_triton.Forward's; t.descale: an FP8 call's (q_descale, k_descale, v_descale), each
        None for 1. (No ALiBi, dropout or varlen here: the plan takes the Triton kernel for those.)"""
        q, k, v, _, _, _, sink, _, descale = t
        layout = self.layout
        out = _runtime.empty(layout.out_shape, layout.out_dtype, q.device)
        lse = _runtime.output_lse(self, layout.lse_shape, q.device, lse_wanted)
        rows_m, rows_n = self.rows
        grid = (min(self.tiles, _runtime.sm_count(q.device)) if self.persist else self.tiles,)
        hi, lo = self.parts
        if self.vt_shape is None:
            v_desc, fp8 = host_desc(v, rows_n, gluon=True), _NO_FP8
        else:
            v_desc = vt_desc(fp8_vt(v, _runtime.empty(self.vt_shape, v.dtype, v.device)), rows_n)
            fp8 = (*(descale if descale is not None else (None, None, None)), layout.descale_strides)
        self.launch(
            grid,
            host_desc(q, rows_m, gluon=True, cols=hi),
            host_desc(k, rows_n, gluon=True, cols=hi),
            v_desc,
            host_desc(out, rows_m, gluon=True),
            host_desc(q, rows_m, gluon=True, cols=lo) if lo else None,
            host_desc(k, rows_n, gluon=True, cols=lo) if lo else None,
            lse,
            lse if sink is None else sink,
            *self.ints,
            *fp8,
        )
        return out, lse


# a 16-bit call's FP8 arguments: the descales and their strides, None (constexprs)
_NO_FP8 = (None, None, None, None)


def vt_desc(vt: torch.Tensor, rows_n: int) -> launcher.HostDesc:
    """The FP8 Gluon forward's V descriptor: over fp8_vt's copy (batch, kv heads, head dim, padded keys) seen as
    (batch, kv heads * head dim, padded keys), a [1, head dim, BLOCK_N] box."""
    b, hk, dv, padded = vt.shape
    box = (1, dv, rows_n)
    return launcher.HostDesc(
        (vt, (b, hk * dv, padded), (hk * dv * padded, padded, 1), box, gluon_layout(vt.dtype, box))
    )


def fp8_vt(v: torch.Tensor, vt: torch.Tensor) -> torch.Tensor:
    """vt (batch, kv heads, head dim, padded keys, a multiple of 32, contiguous) filled with v (batch, keys, kv heads,
    head dim) transposed, each group of FP8_KEY_GROUP keys in the FP8 Gluon forward's order (constexprs.FP8_KEY_ORDER:
    no shuffle of P between threads), zeros for the keys past v's (vt holds ceil(keys / 32) groups): one strided copy
    of the whole groups, and the last group's through a zero-padded 32-key staging tensor where the keys do not fill
    it."""
    b, keys, hk, dv = v.shape
    whole, rest = divmod(keys, FP8_KEY_GROUP)
    dst = vt.unflatten(3, (vt.shape[3] // FP8_KEY_GROUP, *(FP8_KEY_DIMS[i] for i in FP8_KEY_ORDER)))
    order = (0, 6, 7, 1, *(2 + i for i in FP8_KEY_ORDER))  # (batch, kv head, head dim, group, its key dims)
    if whole:
        src = v[:, : whole * FP8_KEY_GROUP].unflatten(1, (whole, *FP8_KEY_DIMS))
        dst[:, :, :, :whole].copy_(src.permute(order))
    if rest:
        tail = v.new_zeros((b, FP8_KEY_GROUP, hk, dv))
        tail[:, :rest] = v[:, whole * FP8_KEY_GROUP :]
        dst[:, :, :, whole : whole + 1].copy_(tail.unflatten(1, (1, *FP8_KEY_DIMS)).permute(order))
    return vt


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
    """The Gluon backward of one prepared backward: tile, ring constexprs, padded length, grid made once (see
    ForwardLaunch). One preprocess launch writes what the kernel reads besides the inputs (launch_triton.Preprocess):
    delta, the zeroed fp32 dQ accumulator whose rows are padded to a multiple of BLOCK_M, and, where seqlen_q is not
    such a multiple, lse (contiguous) padded the same way (+inf; delta 0: the padded rows contribute nothing). Then the
    kernel, then dQ cast from the accumulator into dq. dK/dV are written by TMA where their heads are adjacent and
    aligned (the prepared backward's spec says), else into buffers copied back."""

    __slots__ = ("launch", "layout", "plan", "seqlen_q_pad", "grid", "pre", "direct", "parts", "ints", "dq_cols")

    def __init__(self, plan: Plan, layout: Layout, spec: specs.BackwardSpec, sink: bool):
        self.layout, self.plan = layout, plan
        cfg, rings = plan.tile, dict(plan.constexprs)
        self.seqlen_q_pad = cdiv(layout.max_seqlen_q, cfg.block_m) * cfg.block_m
        # the grid, whose shape is the programs' order (bwd_grid): at most as many heads per group as keep their Q
        # and dO (a kv head's query heads') in L2
        head_bytes = 2 * layout.max_seqlen_q * layout.head_dim * layout.dtype.itemsize * (layout.shape[4])
        n_bh = layout.batch * layout.nheads_k
        heads = l2_heads(plan.l2_group_bytes, n_bh, head_bytes)
        self.grid = bwd_grid(cdiv(layout.max_seqlen_k, cfg.block_n), n_bh, heads)
        pad = self.seqlen_q_pad
        self.pre = Preprocess(layout, spec.out, spec.dout, spec.dlse, sink, pad, pad != layout.max_seqlen_q)
        modes = spec.forward.modes
        self.direct = tuple(
            g.dtype == layout.dtype
            and g.heads_adjacent
            and tma_ok(modes.arch, modes.forced, specs.all_aligned(spec.aligned), g)
            for g in spec.grads[1:]
        )
        # q's and k's head dim in two parts where it is not a power of two (kernels/bwd_hopper_config.py's
        # BwdConfig): Q, K, dK and the dQ accumulator get a descriptor for each (dQ_i's parts are the head dim's)
        self.parts = column_parts(layout.head_dim)
        self.dq_cols = self.parts[0] if self.parts[1] else layout.head_dim // rings["DQ_SPLIT"]
        pad = self.seqlen_q_pad
        delta_strides = (layout.nheads * pad, pad)  # delta's (and the padded lse's)
        self.ints = (
            layout.score.sm_scale, layout.max_seqlen_q, layout.max_seqlen_k, pad, layout.nheads, layout.nheads_k,
            *delta_strides,
        )  # fmt: skip
        self.launch = launcher.Launch(
            _runtime.hopper_kernels().bwd.attn_bwd_ws_kernel,
            CAUSAL=plan.causal,
            HEAD_DIM=layout.head_dim,
            HEAD_DIM_V=layout.head_dim_v,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            STAGES=cfg.num_stages,
            GQA=layout.nheads != layout.nheads_k,
            **rings,
            num_warps=plan.num_warps,
        )

    def __call__(self, t: BackwardTensors) -> None:
        """dq, dk, dv (and dsink) of the call's tensors (its sequences, ALiBi and dropout are not the Gluon backward's:
        the plan sends those calls to the Triton one)."""
        layout, plan = self.layout, self.plan
        dout, q, k, v, out, lse, dlse, dq, dk, dv = t.dout, t.q, t.k, t.v, t.out, t.lse, t.dlse, t.dq, t.dk, t.dv
        sinks, dsink = t.sink, t.dsink
        cfg = plan.tile
        seqlen_q, pad = layout.max_seqlen_q, self.seqlen_q_pad
        delta = _runtime.empty((layout.batch, layout.nheads, pad), torch.float32, q.device)
        # the kernel reads lse and delta with one set of strides (lse arrives contiguous): a tail needs a padded copy
        lse_pad = _runtime.empty(delta.shape, torch.float32, q.device) if pad != seqlen_q else None
        acc = _runtime.empty((layout.batch, pad, layout.nheads, layout.head_dim), torch.float32, q.device)
        sink = SinkGrad(sinks, dsink, layout.batch) if sinks is not None else None
        self.pre(PreprocessTensors(out, dout, lse, dlse, delta, None, lse_pad=lse_pad, acc=acc, sink=sink))
        lse = lse_pad if lse_pad is not None else lse
        gk, gv = (
            g if direct else _runtime.empty(g.shape, q.dtype, g.device) for g, direct in zip((dk, dv), self.direct)
        )
        bm, bn = cfg.block_m, cfg.block_n
        hi, lo = self.parts
        lo_desc = (lambda t, rows: host_desc(t, rows, gluon=True, cols=lo)) if lo else (lambda t, rows: None)
        self.launch(
            self.grid,
            host_desc(q, bm, gluon=True, cols=hi),
            host_desc(k, bn, gluon=True, cols=hi),
            host_desc(v, bn, gluon=True),
            host_desc(dout, bm, gluon=True),
            host_desc(gk, bn, gluon=True, cols=hi),
            host_desc(gv, bn, gluon=True),
            host_desc(acc, bm, gluon=True, cols=self.dq_cols),
            lo_desc(q, bm),
            lo_desc(k, bn),
            lo_desc(gk, bn),
            lo_desc(acc, bm),
            lse,
            delta,
            *self.ints,
        )
        dq.copy_(acc[:, :seqlen_q] if pad != seqlen_q else acc)
        for dst, src in ((dk, gk), (dv, gv)):
            if src is not dst:
                dst.copy_(src)
