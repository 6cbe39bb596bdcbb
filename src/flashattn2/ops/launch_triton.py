"""The Triton kernels' launches (kernels/fwd.py, kernels/bwd_preprocess.py, kernels/bwd.py, kernels/dmask.py):
every arch, every option, dense and varlen. What runs is decided before (ops.planning's Plan); this allocates,
builds the arguments, launches."""

from __future__ import annotations

import torch

from ..kernels.constexprs import Mods, Path, Tile
from . import _runtime, launcher, planning
from .geometry import Geometry, Varlen, block_d, cdiv, fill_tails
from .options import ScoreMods
from .planning import Plan
from .tma import host_desc, use_tma


def tma_flags(q: torch.Tensor, arch: str, *tensors: torch.Tensor) -> dict:
    upcast = arch == "interp" or q.dtype == torch.float32
    tma = use_tma(arch, *tensors)
    if tma and arch != "interp":
        _runtime.ensure_tma_allocator()
    return dict(
        USE_TMA=tma,
        # the interpreter's bf16 arithmetic is wrong (TRITON-ON-CPU.md): it computes in fp32
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
    )


def out_dtype(dtype: torch.dtype, arch: str) -> torch.dtype:
    # the interpreter truncates fp32 -> bf16 instead of rounding: it writes fp32 and torch casts
    return torch.float32 if arch == "interp" else dtype


def sources(geo: Geometry, tma: bool, *pairs: tuple[torch.Tensor, int]) -> tuple[list, bool]:
    """(the kernel's tensor arguments, HOST_DESC) for (tensor, rows of its tile) pairs: with the
    TMA path on dense inputs whose head dims are powers of two and whose heads are adjacent in
    memory, descriptors (launcher.HostDesc) over (batch, seqlen, heads * headdim) with a
    [1, rows, headdim] box (unless force(host_desc=False); use_tma checked the 16-byte alignment TMA needs);
    otherwise the tensors (the kernels make their own descriptors). Host-built descriptors: backward 1.04-1.41x
    at 512 and 2k tokens, the forward 1.0-1.33x (H200, bitwise-equal outputs)."""
    tensors = [t for t, _ in pairs]
    if not (
        planning.forced().host_desc is not False
        and tma
        and geo.varlen is None
        and all(t.shape[-1] == block_d(t.shape[-1]) and t.stride(2) == t.shape[-1] for t in tensors)
    ):
        return tensors, False
    return [host_desc(t, rows) for t, rows in pairs], True


def score_scalars(runtime: dict, softmax_scale: float) -> tuple:
    """The forward's, dK/dV's and dQ's `score` argument: (window_left, window_right, sm_scale, softcap, dropout_p)."""
    return runtime["window_left"], runtime["window_right"], softmax_scale, runtime["softcap"], runtime["dropout_p"]


def tile_of(geo: Geometry, cfg) -> Tile:
    """The forward's, dK/dV's and dQ's TILE for a tile config (planning.TileConfig)."""
    return Tile(geo.head_dim, cfg.block_m, cfg.block_n, block_d(geo.head_dim), geo.head_dim_v, block_d(geo.head_dim_v))


def forward(
    plan: Plan, q, k, v, out, lse, geo: Geometry, arch: str, runtime: dict, flags: dict, softmax_scale: float
) -> None:
    """kernels/fwd.py into out and lse (varlen: the rows past cu_seqlens_q[-1] filled too)."""
    cfg = plan.tile
    grid = (cdiv(geo.max_seqlen_q, cfg.block_m) * geo.batch * geo.nheads,)
    # a query block's work grows with its sequence's keys: order the slots by cu_seqlens_k
    order, is_sorted = geo.order("k", lse)
    tma = tma_flags(q, arch, q, k, v, out)
    srcs, host = sources(geo, tma["USE_TMA"], (q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, cfg.block_m))
    launcher.launch(
        _runtime.kernels().fwd.attn_fwd_kernel,
        grid,
        *srcs,
        lse,
        runtime["Alibi"],
        runtime["Sinks"],
        *geo.cu_seqlens(lse),
        runtime["Seed"],
        order,
        geo.strides(q),
        geo.strides(k),
        geo.strides(v),
        geo.strides(out),
        geo.lse_strides(lse),
        runtime["stride_alibi_b"],
        (geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k),
        score_scalars(runtime, softmax_scale),
        MODS=Mods(**flags),
        IS_VARLEN=geo.varlen is not None,
        SORTED=is_sorted,
        PATH=Path(**tma, HOST_DESC=host),
        TILE=tile_of(geo, cfg),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if geo.varlen is not None:
        cu_q, known_q = geo.varlen.cu_seqlens_q, geo.varlen.known_q
        fill_tails((out, cu_q, 0.0, 0, known_q), (lse, cu_q, float("inf"), 1, known_q))


def preprocess(
    out,
    dout,
    lse,
    dlse,
    geo: Geometry,
    delta: torch.Tensor,
    seqlen_pad: int | None = None,
    lse_pad: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
    sink: SinkGrad | None = None,
) -> tuple:
    """delta = rowsum(dO * O) - dlse into `delta` (lse's shape, or with seqlen_pad its rows padded); with `sink`,
    the learnable sink's gradient too (SinkGrad).
    With seqlen_pad (the Gluon backward, dense inputs): delta (batch, nheads, seqlen_pad) gets 0 past
    seqlen_q, the fp32 dQ accumulator `acc` (batch, seqlen_pad, nheads, headdim) is zeroed, and
    `lse_pad` (delta's shape), if given, gets lse with +inf past seqlen_q -- one launch. Returns the
    launch's (grid, integer arguments (tuples), keywords): the Gluon backward's cached plan repeats it with them."""
    padded = seqlen_pad is not None
    rows = seqlen_pad if padded else geo.max_seqlen_q
    bd = block_d(geo.head_dim_v)  # O's and dO's
    wide = max(bd, block_d(geo.head_dim)) if padded else bd  # (the accumulator's rows: q's head dim)
    pre_m = 64 if wide <= 128 else 32 if wide <= 256 else 16
    acc_strides = acc.stride()[:3] if padded else (0, 0, 0)
    grid = (cdiv(rows, pre_m) * geo.batch * geo.nheads,)
    ints = (
        geo.strides(out),
        geo.strides(dout),
        geo.lse_strides(lse),
        geo.lse_strides(delta),
        acc_strides,
        (geo.nheads, geo.max_seqlen_q, rows),
    )
    kwargs = dict(
        HAS_DLSE=dlse is not None,
        IS_VARLEN=geo.varlen is not None,
        PADDED=padded,
        COPY_LSE=lse_pad is not None,
        SINK=sink is not None,
        HEAD_DIM=geo.head_dim_v,
        BLOCK_M=pre_m,
        BLOCK_D=bd,
        ACC_DIM=geo.head_dim,  # the dQ accumulator's: q's
        BLOCK_ACC=block_d(geo.head_dim),
    )
    pre = (grid, ints, kwargs)
    cu = geo.cu_seqlens(lse)[0]
    launch_preprocess(pre, out, dout, lse, dlse, delta, cu, lse_pad, acc if padded else delta, sink)
    return pre


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


def launch_preprocess(pre: tuple, out, dout, lse, dlse, delta, cu_seqlens, lse_pad, acc, sink=None) -> None:
    """The delta preprocess launch with preprocess's (grid, integer arguments, keywords); the
    tensors absent from the call (dlse, lse_pad, a sink's) get delta in their places (never read)."""
    grid, ints, kwargs = pre
    if sink is not None:
        sink.parts = _runtime.empty(grid, torch.float32, delta.device)
    launcher.launch(
        _runtime.kernels().bwd_preprocess.attn_bwd_preprocess_kernel,
        grid,
        out,
        dout,
        delta,
        dlse if dlse is not None else delta,
        cu_seqlens,
        lse,
        lse_pad if lse_pad is not None else delta,
        acc,
        sink.sinks if sink is not None else delta,
        sink.parts if sink is not None else delta,
        *ints,
        **kwargs,
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
    runtime: dict,
    mod_flags: dict,
    softmax_scale: float,
    dsink: torch.Tensor | None = None,
) -> None:
    """kernels/bwd_preprocess.py's delta preprocess, then kernels/bwd.py's dK/dV (one program per key block over its
    query blocks) and dQ (one program per query block over its key blocks): deterministic, no atomics. A sink
    changes only lse (which P = exp(S - lse) reads) and adds its gradient from lse and delta (SinkGrad, in the
    preprocess)."""
    K = _runtime.kernels().bwd
    cu_q, cu_k = geo.cu_seqlens(lse)
    is_varlen = geo.varlen is not None

    # delta = rowsum(dO * O) - dlse: the lse gradient enters dS = P * (dP - delta) for free
    delta = _runtime.empty(lse.shape, torch.float32, q.device)
    mod_flags = dict(mod_flags)
    sink = SinkGrad(runtime["Sinks"], dsink, geo.batch) if mod_flags.pop("SINK") else None
    preprocess(out, dout, lse, dlse, geo, delta, sink=sink)

    # where the kernels write: the interpreter writes fp32 and torch casts (copied into dq, dk, dv at the end)
    gq, gk, gv = dq, dk, dv
    if arch == "interp":
        gq, gk, gv = (_runtime.empty(g.shape, torch.float32, g.device) for g in (dq, dk, dv))
    if is_varlen:
        # rows past cu_seqlens[-1] belong to no sequence: their gradient is 0
        known_q, known_k = geo.varlen.known_q, geo.varlen.known_k
        fill_tails((gq, cu_q, 0.0, 0, known_q), (gk, cu_k, 0.0, 0, known_k), (gv, cu_k, 0.0, 0, known_k))
    flags = tma_flags(q, arch, q, k, v, dout, gq, gk, gv)
    group = geo.nheads // geo.nheads_k
    # head dims past 256: each key / query block's dK, dV, dQ columns split over DSPLIT programs (the grid's second
    # axis; their column chunks are pointer loads and stores, so no host-built descriptors)
    dsplit = dict(plan.constexprs).get("DSPLIT", 1)
    mods = Mods(**mod_flags, SINK=False)
    # longest first: a key block's work grows with its sequence's queries, a query block's with its keys
    order_q, sorted_q = geo.order("q", cu_q)
    order_k, sorted_k = geo.order("k", cu_k)

    cfg = plan.tile
    (sq, sk, sv, sdo, sdk, sdv), host = sources(
        geo,
        flags["USE_TMA"] and dsplit == 1,
        (q, cfg.block_m),
        (k, cfg.block_n),
        (v, cfg.block_n),
        (dout, cfg.block_m),
        (gk, cfg.block_n),
        (gv, cfg.block_n),
    )
    launcher.launch(
        K.attn_bwd_dkdv_kernel,
        (cdiv(geo.max_seqlen_k, cfg.block_n) * geo.batch * geo.nheads_k, dsplit),
        sq,
        sk,
        sv,
        sdo,
        lse,
        delta,
        sdk,
        sdv,
        runtime["Alibi"],
        cu_q,
        cu_k,
        runtime["Seed"],
        order_q,
        geo.strides(q),
        geo.strides(k),
        geo.strides(v),
        geo.strides(dout),
        geo.strides(gk),
        geo.strides(gv),
        geo.lse_strides(lse),
        runtime["stride_alibi_b"],
        (geo.nheads, geo.nheads_k, geo.max_seqlen_q, geo.max_seqlen_k, group),
        score_scalars(runtime, softmax_scale),
        MODS=mods,
        IS_VARLEN=is_varlen,
        SORTED=sorted_q,
        PATH=Path(**flags, HOST_DESC=host),
        TILE=tile_of(geo, cfg),
        DSPLIT=dsplit,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    cfg = plan.dq_tile
    (sq, sk, sv, sdo, sdq), host = sources(
        geo,
        flags["USE_TMA"] and dsplit == 1,
        (q, cfg.block_m),
        (k, cfg.block_n),
        (v, cfg.block_n),
        (dout, cfg.block_m),
        (gq, cfg.block_m),
    )
    launcher.launch(
        K.attn_bwd_dq_kernel,
        (cdiv(geo.max_seqlen_q, cfg.block_m) * geo.batch * geo.nheads, dsplit),
        sq,
        sk,
        sv,
        sdo,
        lse,
        delta,
        sdq,
        runtime["Alibi"],
        cu_q,
        cu_k,
        runtime["Seed"],
        order_k,
        geo.strides(q),
        geo.strides(k),
        geo.strides(v),
        geo.strides(dout),
        geo.strides(gq),
        geo.lse_strides(lse),
        runtime["stride_alibi_b"],
        (geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, group),
        score_scalars(runtime, softmax_scale),
        MODS=mods,
        IS_VARLEN=is_varlen,
        SORTED=sorted_k,
        PATH=Path(**flags, HOST_DESC=host),
        TILE=tile_of(geo, cfg),
        DSPLIT=dsplit,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        if src is not dst:
            dst.copy_(src)


def dropout_probs(
    q: torch.Tensor, k: torch.Tensor, softmax_scale: float, mods: ScoreMods, varlen: Varlen | None = None
) -> torch.Tensor:
    """S_dmask (batch, nheads, round128(seqlen_q), round128(seqlen_k)) in q's dtype: exp(score -
    rowmax) where kept, its negative where dropped, 0 where not visible (a testing aid)."""
    geo = Geometry.of(q, k, varlen)
    round128 = lambda n: cdiv(n, 128) * 128
    arch = "interp" if _runtime.interpreted() else planning.arch_of(q.device)
    shape = (geo.batch, geo.nheads, round128(geo.max_seqlen_q), round128(geo.max_seqlen_k))
    probs = torch.zeros(shape, dtype=out_dtype(q.dtype, arch), device=q.device)
    if probs.numel() == 0 or geo.max_seqlen_q == 0:
        return probs.to(q.dtype)
    runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, probs)
    block_m, block_n = 64, 64
    launcher.launch(
        _runtime.kernels().dmask.attn_dropout_mask_kernel,
        (cdiv(geo.max_seqlen_q, block_m) * geo.batch * geo.nheads,),
        q,
        k,
        probs,
        runtime["Alibi"],
        *geo.cu_seqlens(probs),
        runtime["Seed"],
        geo.strides(q),
        geo.strides(k),
        probs.stride()[:3],
        runtime["stride_alibi_b"],
        (geo.batch, geo.nheads, geo.max_seqlen_q, geo.max_seqlen_k, geo.nheads // geo.nheads_k),
        (runtime["window_left"], runtime["window_right"], softmax_scale, runtime["dropout_p"]),
        CAUSAL=flags["CAUSAL"],
        LOCAL=flags["LOCAL"],
        ALIBI=flags["ALIBI"],
        IS_VARLEN=varlen is not None,
        UPCAST=arch == "interp" or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if arch == "interp" or q.dtype == torch.float32 else "tf32",
        HEAD_DIM=geo.head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d(geo.head_dim),
    )
    return probs.to(q.dtype)
