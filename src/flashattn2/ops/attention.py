"""Dense and varlen attention: a prepared call's plan (ops.call, ops.planning) launched on its tensors -- the Gluon
kernels (ops.launch_gluon), the Triton ones (ops.launch_triton), or in the batch-invariant mode the KV-cache kernel
(ops.kvcache).

Inputs arrive validated (the prepared call): (batch, seqlen_q, nheads, headdim) or (total, nheads, headdim), one
dtype, one device, the last dimension contiguous (registry.for_kernels).
"""

from __future__ import annotations

import torch

from . import _runtime, kvcache, launch_gluon, launch_triton
from .call import AttentionCall, BackwardCall
from .geometry import Geometry, Varlen
from .options import ScoreMods
from .planning import out_dtype


def _geometry(call: AttentionCall, q, k, v, cu_seqlens_q, cu_seqlens_k) -> Geometry:
    o = call.options
    varlen = None if cu_seqlens_q is None else Varlen.of(cu_seqlens_q, cu_seqlens_k, o.max_seqlen_q, o.max_seqlen_k)
    return Geometry.of(q, k, varlen, v)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _mods(call: AttentionCall, alibi, sink, seed) -> ScoreMods:
    o = call.options
    alibi, sink = _contiguous(alibi), _contiguous(sink)
    return ScoreMods(o.causal, o.window_left, o.window_right, o.softcap, alibi, o.dropout_p, seed, sink)


def forward(
    call: AttentionCall, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, alibi=None, sink=None, seed=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q in q's dtype with v's head dim; lse fp32 (batch, nheads, seqlen_q), or (nheads, total_q) in varlen."""
    plan = call.plan
    if plan.kernel == "decode":
        return _invariant_forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sink, seed)
    if plan.gluon:
        launch = call.launch
        if launch is None:
            geo = _geometry(call, q, k, v, None, None)
            launch = call.launch = launch_gluon.ForwardLaunch(plan, geo, geo.lse_shape(q), sink is not None)
        return launch.run(q, k, v, call.options.softmax_scale, _contiguous(sink))
    geo = _geometry(call, q, k, v, cu_seqlens_q, cu_seqlens_k)
    arch = call.spec.modes.arch
    out = _runtime.empty((*q.shape[:-1], geo.head_dim_v), out_dtype(q.dtype, arch), q.device)
    lse = _runtime.empty(geo.lse_shape(q), torch.float32, q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    if geo.batch == 0 or geo.max_seqlen_q == 0:  # varlen with no query rows in any sequence
        out.zero_(), lse.fill_(float("inf"))
        return out.to(q.dtype), lse
    runtime, flags = _mods(call, alibi, sink, seed).kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    launch_triton.forward(plan, q, k, v, out, lse, geo, arch, runtime, flags, call.options.softmax_scale)
    return out.to(q.dtype), lse


def _invariant_forward(call: AttentionCall, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sink, seed):
    """The batch-invariant mode's forward (ops.invariance): the KV-cache kernel over k and v as a cache -- dense: a
    contiguous cache of seqlen_k keys a sequence; varlen: one cache row holding every sequence, sequence b's keys from
    cu_seqlens_k[b] (its left padding) to cu_seqlens_k[b + 1] (its cache_seqlens) -- with q's rows packed as that
    kernel packs a decode step's, so that a prefill row and the decode step of the same token compute alike."""
    o = call.options
    if o.dropout_p > 0:
        raise NotImplementedError(
            "dropout_p > 0 in batch-invariant mode: the mode's kernel (the KV cache's) has no dropout; turn the mode "
            "off for training with dropout (flashattn2.batch_invariant(False))"
        )
    mods = _mods(call, alibi, sink, None)
    if cu_seqlens_q is None:
        cache = kvcache.Cache(k, v, None, k.shape[1], None, None, None)
        return kvcache.forward(call.plan, q, cache, 0, o.softmax_scale, mods)
    rows = torch.zeros(cu_seqlens_k.shape[0] - 1, dtype=torch.int32, device=cu_seqlens_k.device)
    cache = kvcache.Cache(
        k.unsqueeze(0), v.unsqueeze(0), cu_seqlens_k[1:], 0, rows, cu_seqlens_k[:-1], None, o.max_seqlen_k
    )
    return kvcache.forward(call.plan, q, cache, 0, o.softmax_scale, mods, varlen_q=(cu_seqlens_q, o.max_seqlen_q))


def backward(
    bcall: BackwardCall,
    call: AttentionCall,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    alibi=None,
    sink=None,
    seed=None,
    dsink: torch.Tensor | None = None,
) -> None:
    """Writes dq, dk, dv (any strides with a contiguous last dim; views of one packed tensor are fine), and with a
    sink its gradient into dsink. `dlse` is the gradient flowing into the returned logsumexp, or None. The plan
    (bcall) says which backward runs: the Gluon one only for deterministic=False (dQ added in any order: its last
    bits may move run to run)."""
    # the kernels read lse, dlse and delta with one set of strides, lse's: all contiguous
    lse = lse if lse.is_contiguous() else lse.contiguous()
    dlse = dlse if dlse is None or dlse.is_contiguous() else dlse.contiguous()
    plan = bcall.plan
    if plan.gluon:
        launch = bcall.launch
        if launch is None:
            geo = _geometry(call, q, k, v, None, None)
            launch = bcall.launch = launch_gluon.BackwardLaunch(plan, geo, call.spec.modes.arch, q.dtype)
        launch.run(dout, q, k, v, out, lse, dlse, dq, dk, dv, call.options.softmax_scale, _contiguous(sink), dsink)
        return
    geo = _geometry(call, q, k, v, cu_seqlens_q, cu_seqlens_k)
    if q.numel() == 0 or k.numel() == 0 or geo.batch == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        if dsink is not None:  # no key: O = 0, so delta = -dlse
            launch_triton.sink_grad_(dsink, sink, lse, torch.zeros_like(lse) if dlse is None else -dlse)
        return
    arch = call.spec.modes.arch
    runtime, flags = _mods(call, alibi, sink, seed).kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    launch_triton.backward(
        plan, dout, q, k, v, out, lse, dlse, dq, dk, dv, geo, arch, runtime, flags, call.options.softmax_scale, dsink
    )


def dropout_probs(call: AttentionCall, q, k, cu_seqlens_q, cu_seqlens_k, alibi, seed) -> torch.Tensor:
    """S_dmask for the dropout mask the forward drew with the same seed (a testing aid)."""
    varlen = None
    if cu_seqlens_q is not None:
        o = call.options
        varlen = Varlen.of(cu_seqlens_q, cu_seqlens_k, o.max_seqlen_q, o.max_seqlen_k)
    return launch_triton.dropout_probs(q, k, call.options.softmax_scale, _mods(call, alibi, None, seed), varlen)
