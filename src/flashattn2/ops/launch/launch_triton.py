"""The Triton kernels' launches (kernels/fwd.py, kernels/bwd_preprocess.py, kernels/bwd.py, kernels/dmask.py):
every arch, every option, dense and varlen. What runs is decided before (ops.planning's Plan); Forward and Backward
are made once per prepared call (ops.run.call) with every argument but the tensors, and launch on each call's
tensors."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels.constexprs import FP8_DOTS, FP8_DOTS_INTERP, DkdvShape, DmaskScore, Path, PreprocessShape, Tile
from .. import _runtime
from . import launcher
from ..request import seqlens
from ..planning.geometry import block_d, cdiv
from .layout import BackwardTensors, ForwardTensors, Layout, contiguous_strides, rows_strides
from ..planning import Plan, TileConfig
from .tma import host_desc


def _path(layout: Layout, plan: Plan) -> Path:
    vt_tma = plan.fp8 == FP8_DOTS and plan.tma  # (kernels/fwd.vt_src)
    return Path(plan.tma, plan.host_desc, layout.upcast, "ieee" if layout.upcast else "tf32", plan.fp8, vt_tma)


def _tile(layout: Layout, cfg) -> Tile:
    """The forward's, dK/dV's and dQ's TILE for a tile config (planning.TileConfig)."""
    d, dv = layout.head_dim, layout.head_dim_v
    return Tile(d, cfg.block_m, cfg.block_n, block_d(d), dv, block_d(dv))


class TailFill:
    """Varlen: the rows past cu_seqlens[-1] of up to three tensors (x: (total, ...) with the other dimensions of a row
    one contiguous block, or lse (nheads, total) with rows_dim 1) get a value -- 0 for outputs and gradients, +inf for
    the logsumexp -- in one launch (kernels/fill.py), skipped when every cu_seqlens is known to end at its last row
    (ops.request.seqlens.known). slots: (shape, strides, value, rows_dim) of each tensor; the tensors come with each
    call."""

    __slots__ = ("launch", "grid", "slots", "totals", "batch", "rowless")

    def __init__(self, batch: int, *slots):
        self.batch = batch
        self.totals = [shape[rows_dim] for shape, _, _, rows_dim in slots]
        self.rowless = max(self.totals, default=0) == 0
        self.slots = []
        fill = _runtime.kernels().fill
        for shape, strides, value, rows_dim in slots:
            if rows_dim == 0:
                row = fill.FillSlot(
                    total_rows=shape[0],
                    stride_r=strides[0],
                    stride_c=1,
                    ncols=int(torch.Size(shape[1:]).numel()),
                    value=value,
                )
            else:
                row = fill.FillSlot(total_rows=shape[1], stride_r=strides[1], stride_c=strides[0], ncols=shape[0],
                                    value=value)  # fmt: skip
            self.slots.append(row)
        self.slots += self.slots[:1] * (3 - len(slots))  # unused slots: never read (SLOTS is a constexpr)
        block_r = 64
        self.grid = (cdiv(max(self.totals, default=0), block_r),)
        self.launch = launcher.Launch(fill.fill_tail_kernel, SLOTS=len(slots), BLOCK_R=block_r, BLOCK_C=128)

    def __call__(self, *pairs) -> None:
        """pairs: (tensor, cu_seqlens) for each slot."""
        if self.rowless:
            return
        for (_, cu), total in zip(pairs, self.totals):
            seen = seqlens.entry(cu)
            if seen is None or seen.values is None or seen.values[0] != total:
                break
        else:  # every cu_seqlens is known to end at its last row
            return
        pairs = (*pairs, *pairs[:1] * (3 - len(pairs)))
        (x0, cu0), (x1, cu1), (x2, cu2) = pairs
        s0, s1, s2 = self.slots
        self.launch(self.grid, x0, cu0, s0, x1, cu1, s1, x2, cu2, s2, self.batch)


class Forward:
    """kernels/fwd.py into out and lse (varlen: the rows past cu_seqlens_q[-1] filled too), as one prepared call
    launches it."""

    __slots__ = (
        "layout",
        "plan",
        "grid",
        "launches",
        "rows",
        "tail",
        "empty",
        "no_rows",
        "dropped_lse",
        "vt",
        "v_strides",
    )

    def __init__(self, layout: Layout, plan: Plan):
        self.layout, self.plan = layout, plan
        cfg = plan.tile
        self.rows = (cfg.block_m, cfg.block_n)
        self.grid = (cdiv(layout.max_seqlen_q, cfg.block_m) * layout.batch * layout.nheads,)
        self.empty = torch.Size(layout.out_shape).numel() == 0
        self.no_rows = layout.batch == 0 or layout.max_seqlen_q == 0  # varlen with no query rows in any sequence
        self.dropped_lse = None
        # the e4m3 dots read V transposed (kernels/fwd.vt_src): (the copy's shape, v's keys, v's permutation into
        # it), its rows padded to 16 keys (TMA's alignment; varlen: each sequence's first key 16-aligned too,
        # vt_columns); v_strides: the kernel's V strides, (batch, row, head) or the copy's (batch, head-dim row, head)
        self.vt, self.v_strides = None, layout.v_strides
        if plan.fp8 in (FP8_DOTS, FP8_DOTS_INTERP):
            keys, dv, hk = layout.v_keys, layout.head_dim_v, layout.nheads_k
            padded = -(-keys // 16) * 16
            if layout.varlen:
                padded = -(-(keys + 16 * (layout.batch + 1)) // 16) * 16
                self.vt = ((hk, dv, padded), keys, (1, 2, 0))
                self.v_strides = (0, padded, dv * padded)
            else:
                self.vt = ((layout.batch, hk, dv, padded), keys, (0, 2, 3, 1))
                self.v_strides = (hk * dv * padded, padded, dv * padded)
        kw = dict(
            MODS=layout.mods,
            IS_VARLEN=layout.varlen,
            PATH=_path(layout, plan),
            TILE=_tile(layout, cfg),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        kernel = _runtime.kernels().fwd.attn_fwd_kernel
        # SORTED: a varlen call's sequences longest first, where ops.request.seqlens knows their order
        self.launches = {sort: launcher.Launch(kernel, SORTED=sort, **kw) for sort in (False, True)}
        self.tail = None
        if layout.varlen:
            out, lse = layout.out_shape, layout.lse_shape
            self.tail = TailFill(
                layout.batch,
                (out, contiguous_strides(out), 0.0, 0),
                (lse, contiguous_strides(lse), float("inf"), 1),
            )

    def __call__(self, t: ForwardTensors, lse_wanted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse); lse_wanted False: the caller drops the logsumexp (_runtime.output_lse). t.descale: an FP8
        call's (q_descale, k_descale, v_descale), each None for 1."""
        q, k, v, cu_q, cu_k, alibi, sink, seed, descale = t
        layout = self.layout
        dtype = layout.result_dtype
        out = _runtime.empty(layout.out_shape, layout.out_dtype, q.device)
        lse = _runtime.output_lse(self, layout.lse_shape, q.device, lse_wanted)
        if self.empty:
            return out.to(dtype), lse
        if self.no_rows:
            out.zero_(), lse.fill_(float("inf"))
            return out.to(dtype), lse
        # a query block's work grows with its sequence's keys: order the slots by cu_seqlens_k
        seen = None if cu_k is None else seqlens.entry(cu_k)
        order = None if seen is None else seen.order
        descales = (None, None, None)
        if layout.descale_strides is not None:
            q, k, v, descales = self._fp8(q, k, v, descale, cu_k)
        if self.plan.host_desc:
            bm, bn = self.rows
            q, k, v, dst = host_desc(q, bm), host_desc(k, bn), host_desc(v, bn), host_desc(out, bm)
        else:
            dst = out
            if self.plan.tma and layout.arch != "interp":
                _runtime.ensure_tma_allocator()
        self.launches[order is not None](
            self.grid,
            q,
            k,
            v,
            dst,
            lse,
            lse if alibi is None else alibi,
            lse if sink is None else sink,
            lse if cu_q is None else cu_q,
            lse if cu_k is None else cu_k,
            lse if seed is None else seed,
            lse if order is None else order,
            *descales,
            layout.q_strides,
            layout.k_strides,
            self.v_strides,
            layout.out_strides,
            layout.lse_strides,
            layout.alibi_stride,
            layout.descale_strides,
            layout.shape,
            layout.score,
        )
        if self.tail is not None:
            self.tail((out, cu_q), (lse, cu_q))
        return (out if out.dtype == dtype else out.to(dtype)), lse

    def _fp8(self, q, k, v, descale, cu_k):
        """An FP8 call's q, k, v as its path reads them (the uint8 codes where they are decoded in the kernel: Triton
        has no e4m3 type below sm_89) and its three descales (None, a constexpr to the kernel: 1)."""
        if self.plan.fp8 != FP8_DOTS:
            q, k, v = q.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        if self.vt is not None:  # V transposed: one pass over V's bytes, a small part of the attention's time
            shape, keys, order = self.vt
            vt = torch.empty(shape, dtype=v.dtype, device=v.device)
            if cu_k is None:
                vt[..., :keys].copy_(v.permute(*order))
            else:
                vt[..., vt_columns(cu_k, keys)] = v.permute(*order)
            v = vt
        return q, k, v, descale if descale is not None else (None, None, None)


def vt_columns(cu_k: torch.Tensor, keys: int) -> torch.Tensor:
    """Each varlen key's column in the transposed V copy: sequence b's keys from round16(cu_k[b]) + 16 b on (kernels/fwd's
    vt_col0), so each starts 16-aligned and none overlaps the next (the keys past cu_k[-1] follow the last); on the
    device, nothing read back."""
    j = torch.arange(keys, dtype=cu_k.dtype, device=cu_k.device)
    seq = torch.searchsorted(cu_k[1:], j, right=True)
    starts = cu_k.long()
    shift = (starts + 15) // 16 * 16 - starts + 16 * torch.arange(starts.shape[0], device=starts.device)
    return j + shift[seq]


class SinkGrad:
    """The learnable sink's gradient, d sink_h = -sum over batch and rows of exp(sink_h - lse_i) * delta_i: each
    preprocess program writes its rows' share into `parts` ((batch, nheads, row blocks) in the grid's order), then
    one torch reduction per head into `dsink` (fp32 (nheads,)) -- a fixed order, no atomics: deterministic=True
    stays bitwise."""

    __slots__ = ("sinks", "dsink", "batch", "parts")

    def __init__(self, sinks: torch.Tensor, dsink: torch.Tensor, batch: int):
        self.sinks, self.dsink, self.batch, self.parts = sinks, dsink, batch, None

    def finish(self) -> None:
        torch.sum(self.parts.view(self.batch, self.dsink.shape[0], -1), dim=(0, 2), out=self.dsink)


class PreprocessTensors(NamedTuple):
    """What one run of the backward's preprocess reads and writes: delta (fp32, lse's layout) = rowsum(dO * O), from
    dlse too where given; lse_pad and acc, the Gluon backward's padded logsumexp (copied) and dQ accumulator (zeroed);
    sink, a learnable sink's gradient (SinkGrad)."""

    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None
    delta: torch.Tensor
    cu_seqlens: torch.Tensor | None
    lse_pad: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    sink: SinkGrad | None = None


class Preprocess:
    """kernels/bwd_preprocess.py: delta = rowsum(dO * O) - dlse into `delta` (lse's shape, or with seqlen_pad its rows
    padded); with a sink, the learnable sink's gradient too (SinkGrad). With seqlen_pad (the Gluon backward, dense
    inputs): delta (batch, nheads, seqlen_pad) gets 0 past seqlen_q, the fp32 dQ accumulator (batch, seqlen_pad, nheads,
    headdim) is zeroed, and with copy_lse lse_pad (delta's shape) gets lse with +inf past seqlen_q -- one launch. out
    and dout: their layouts (dout's may differ from the output's)."""

    __slots__ = ("launch", "grid", "ints")

    def __init__(
        self, layout: Layout, out, dout, dlse: bool, sink: bool, seqlen_pad: int | None = None, copy_lse: bool = False
    ):
        padded = seqlen_pad is not None
        rows = seqlen_pad if padded else layout.max_seqlen_q
        bd = block_d(layout.head_dim_v)  # O's and dO's
        wide = max(bd, block_d(layout.head_dim)) if padded else bd  # (the accumulator's rows: q's head dim)
        pre_m = 64 if wide <= 128 else 32 if wide <= 256 else 16
        self.grid = (cdiv(rows, pre_m) * layout.batch * layout.nheads,)
        if padded:
            delta_strides = contiguous_strides((layout.batch, layout.nheads, seqlen_pad))[:2]
            acc = contiguous_strides((layout.batch, seqlen_pad, layout.nheads, layout.head_dim))[:3]
        else:
            delta_strides, acc = layout.lse_strides, (0, 0, 0)
        self.ints = (
            rows_strides(out, layout.varlen),
            rows_strides(dout, layout.varlen),
            layout.lse_strides,
            delta_strides,
            acc,
            PreprocessShape(nheads=layout.nheads, max_seqlen_q=layout.max_seqlen_q, seqlen_pad=rows),
        )
        self.launch = launcher.Launch(
            _runtime.kernels().bwd_preprocess.attn_bwd_preprocess_kernel,
            HAS_DLSE=dlse,
            IS_VARLEN=layout.varlen,
            PADDED=padded,
            COPY_LSE=copy_lse,
            SINK=sink,
            HEAD_DIM=layout.head_dim_v,
            BLOCK_M=pre_m,
            BLOCK_D=bd,
            ACC_DIM=layout.head_dim,  # the dQ accumulator's: q's
            BLOCK_ACC=block_d(layout.head_dim),
        )

    def __call__(self, t: PreprocessTensors):
        """The tensors absent from the call (dlse, lse_pad, acc, a sink's) get delta in their places (never read)."""
        out, dout, lse, dlse, delta, cu_seqlens, lse_pad, acc, sink = t
        if sink is not None:
            sink.parts = _runtime.empty(self.grid, torch.float32, delta.device)
        self.launch(
            self.grid,
            out,
            dout,
            delta,
            delta if dlse is None else dlse,
            delta if cu_seqlens is None else cu_seqlens,
            lse,
            delta if lse_pad is None else lse_pad,
            delta if acc is None else acc,
            delta if sink is None else sink.sinks,
            delta if sink is None else sink.parts,
            *self.ints,
        )
        if sink is not None:
            sink.finish()


def sink_grad_(dsink: torch.Tensor, sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> None:
    """d sink_h = -sum over batch and rows of exp(sink_h - lse_i) * delta_i, into dsink (fp32 (nheads,)), in torch:
    for a backward that runs no kernel (no keys; the kernels' backward has SinkGrad in its preprocess). lse and
    delta share a layout whose second-to-last dimension is the head ((batch, nheads, rows) dense, (nheads, total)
    varlen); rows with lse +inf (varlen tails, padding) add 0 whatever delta holds there. torch reductions: a fixed
    order, no atomics (deterministic=True stays bitwise)."""
    w = torch.exp(sinks[:, None] - lse)
    term = torch.where(w > 0, w * delta, 0.0)
    dims = tuple(d for d in range(term.dim()) if d != term.dim() - 2)
    torch.sum(term, dim=dims, out=dsink)
    dsink.neg_()


class Backward:
    """kernels/bwd_preprocess.py's delta preprocess, then kernels/bwd.py's dK/dV (one program per key block over its
    query blocks) and dQ (one program per query block over its key blocks): deterministic, no atomics. A sink changes
    only lse (which P = exp(S - lse) reads) and adds its gradient from lse and delta (SinkGrad, in the preprocess).
    Made once per prepared backward (ops.run.call.BackwardCall): dout's and the gradients' layouts are its spec's."""

    __slots__ = ("layout", "plan", "pre", "dkdv", "dq", "grids", "grad_strides", "dout_strides", "tail", "sink",
                 "dkdv_shape")  # fmt: skip

    def __init__(self, layout: Layout, plan: Plan, out, dout, grads, dlse: bool, sink: bool):
        self.layout, self.plan, self.sink = layout, plan, sink
        self.pre = Preprocess(layout, out, dout, dlse, sink)
        # where the kernels write: the interpreter writes fp32, into contiguous buffers that torch casts into 16-bit
        # gradients (Backward.__call__)
        staged = layout.arch == "interp" and grads[0].dtype != torch.float32
        grads = [g._replace(stride=contiguous_strides(g.shape)) if staged else g for g in grads]
        self.grad_strides = [rows_strides(g, layout.varlen) for g in grads]
        self.dout_strides = rows_strides(dout, layout.varlen)
        shape = layout.shape
        self.dkdv_shape = DkdvShape(
            nheads=shape.nheads,
            nheads_k=layout.nheads_k,
            max_seqlen_q=shape.max_seqlen_q,
            max_seqlen_k=shape.max_seqlen_k,
            group_size=shape.group_size,
        )
        # head dims past 256: each key / query block's dK, dV, dQ columns split over DSPLIT programs (the grid's second
        # axis; their column chunks are pointer loads and stores, so no host-built descriptors)
        dsplit = plan.dsplit
        mods = layout.mods._replace(SINK=False)
        bwd = _runtime.kernels().bwd
        path = _path(layout, plan)
        launches = []
        for kernel, cfg in ((bwd.attn_bwd_dkdv_kernel, plan.tile), (bwd.attn_bwd_dq_kernel, plan.dq_tile)):
            kw = dict(MODS=mods, IS_VARLEN=layout.varlen, PATH=path, TILE=_tile(layout, cfg), DSPLIT=dsplit)
            kw.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            launches.append({sort: launcher.Launch(kernel, SORTED=sort, **kw) for sort in (False, True)})
        self.dkdv, self.dq = launches
        cfg, dq_cfg = plan.tile, plan.dq_tile
        self.grids = (
            (cdiv(layout.max_seqlen_k, cfg.block_n) * layout.batch * layout.nheads_k, dsplit),
            (cdiv(layout.max_seqlen_q, dq_cfg.block_m) * layout.batch * layout.nheads, dsplit),
        )
        self.tail = None
        if layout.varlen:  # rows past cu_seqlens[-1] belong to no sequence: their gradient is 0
            self.tail = TailFill(
                layout.batch,
                *((g.shape, g.stride, 0.0, 0) for g in grads),
            )

    def __call__(self, t: BackwardTensors) -> None:
        layout, plan = self.layout, self.plan
        dout, q, k, v, out, lse, dlse, dq, dk, dv = t.dout, t.q, t.k, t.v, t.out, t.lse, t.dlse, t.dq, t.dk, t.dv
        cu_q, cu_k, alibi, sinks, seed, dsink = t.cu_seqlens_q, t.cu_seqlens_k, t.alibi, t.sink, t.seed, t.dsink
        # delta = rowsum(dO * O) - dlse: the lse gradient enters dS = P * (dP - delta) for free
        delta = _runtime.empty(layout.lse_shape, torch.float32, q.device)
        sink = SinkGrad(sinks, dsink, layout.batch) if self.sink else None
        self.pre(PreprocessTensors(out, dout, lse, dlse, delta, cu_q, sink=sink))
        gq, gk, gv = dq, dk, dv
        if layout.arch == "interp" and dq.dtype != torch.float32:
            gq, gk, gv = (_runtime.empty(g.shape, torch.float32, g.device) for g in (dq, dk, dv))
        if self.tail is not None:
            self.tail((gq, cu_q), (gk, cu_k), (gv, cu_k))
        # longest first: a key block's work grows with its sequence's queries, a query block's with its keys
        order_q = None if cu_q is None else seqlens.remembered(cu_q)[1]
        order_k = None if cu_k is None else seqlens.remembered(cu_k)[1]
        cfg, dq_cfg = plan.tile, plan.dq_tile
        if plan.host_desc:
            sq, sk, sv, sdo = (
                host_desc(q, cfg.block_m),
                host_desc(k, cfg.block_n),
                host_desc(v, cfg.block_n),
                host_desc(dout, cfg.block_m),
            )
            sdk, sdv = host_desc(gk, cfg.block_n), host_desc(gv, cfg.block_n)
        else:
            sq, sk, sv, sdo, sdk, sdv = q, k, v, dout, gk, gv
            if plan.tma and layout.arch != "interp":
                _runtime.ensure_tma_allocator()
        alibi = lse if alibi is None else alibi
        seed = lse if seed is None else seed
        cu_q_, cu_k_ = (lse, lse) if cu_q is None else (cu_q, cu_k)
        (sgq, sgk, sgv), strides = self.grad_strides, layout
        self.dkdv[order_q is not None](
            self.grids[0], sq, sk, sv, sdo, lse, delta, sdk, sdv, alibi, cu_q_, cu_k_, seed,
            lse if order_q is None else order_q,
            strides.q_strides, strides.k_strides, strides.v_strides, self.dout_strides, sgk, sgv, layout.lse_strides,
            layout.alibi_stride, self.dkdv_shape, layout.score,
        )  # fmt: skip
        if plan.host_desc:
            sq, sk, sv = host_desc(q, dq_cfg.block_m), host_desc(k, dq_cfg.block_n), host_desc(v, dq_cfg.block_n)
            sdo, sdq = host_desc(dout, dq_cfg.block_m), host_desc(gq, dq_cfg.block_m)
        else:
            sdq = gq
        self.dq[order_k is not None](
            self.grids[1], sq, sk, sv, sdo, lse, delta, sdq, alibi, cu_q_, cu_k_, seed,
            lse if order_k is None else order_k,
            strides.q_strides, strides.k_strides, strides.v_strides, self.dout_strides, sgq, layout.lse_strides,
            layout.alibi_stride, layout.shape, layout.score,
        )  # fmt: skip
        for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
            if src is not dst:
                dst.copy_(src)


# dropout_probs' one tile at every head dim; its K blocks unpipelined (Triton's default three stages of them at head
# dim 512 need 270,336 bytes of shared memory, sm_90 has 232,448: an H100 refused the launch)
DROPOUT_PROBS_TILE = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)


def dropout_probs(layout: Layout, q, k, cu_q, cu_k, alibi, seed) -> torch.Tensor:
    """S_dmask (batch, nheads, round128(seqlen_q), round128(seqlen_k)) in q's dtype: exp(score - rowmax) where kept,
    its negative where dropped, 0 where not visible (a testing aid: a launch no loop repeats)."""
    round128 = lambda n: cdiv(n, 128) * 128
    shape = (layout.batch, layout.nheads, round128(layout.max_seqlen_q), round128(layout.max_seqlen_k))
    probs = torch.zeros(shape, dtype=layout.out_dtype, device=q.device)
    if probs.numel() == 0 or layout.max_seqlen_q == 0:
        return probs.to(q.dtype)
    mods, score = layout.mods, layout.score
    tile = DROPOUT_PROBS_TILE
    launcher.launch(
        _runtime.kernels().dmask.attn_dropout_mask_kernel,
        (cdiv(layout.max_seqlen_q, tile.block_m) * layout.batch * layout.nheads,),
        q,
        k,
        probs,
        probs if alibi is None else alibi,
        probs if cu_q is None else cu_q,
        probs if cu_k is None else cu_k,
        seed,
        layout.q_strides,
        layout.k_strides,
        probs.stride()[:3],
        layout.alibi_stride,
        layout.shape,
        DmaskScore(
            window_left=score.window_left,
            window_right=score.window_right,
            sm_scale=score.sm_scale,
            dropout_p=score.dropout_p,
        ),
        CAUSAL=mods.CAUSAL,
        LOCAL=mods.LOCAL,
        ALIBI=mods.ALIBI,
        IS_VARLEN=layout.varlen,
        UPCAST=layout.upcast,
        DOT_PRECISION="ieee" if layout.upcast else "tf32",
        HEAD_DIM=layout.head_dim,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=block_d(layout.head_dim),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return probs.to(q.dtype)
