"""Dense and varlen attention: plan the call (ops.planning), then launch the Gluon kernels (ops.launch_gluon) or
the Triton ones (ops.launch_triton).

Inputs arrive validated (api.py / checks.py): (batch, seqlen, nheads, headdim) with the last
dimension contiguous, one dtype, one device.
"""

from __future__ import annotations

import torch

from . import _runtime, invariance, kvcache, launch_gluon, launch_triton, planning
from .geometry import Geometry, Varlen
from .options import ScoreMods


def _arch(device: torch.device) -> str:
    return "interp" if _runtime.interpreted() else planning.arch_of(device)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    mods: ScoreMods,
    varlen: Varlen | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q in q's dtype with v's head dim; lse fp32 (batch, nheads, seqlen_q), or (nheads, total_q) in varlen."""
    if invariance.enabled():
        return _invariant_forward(q, k, v, softmax_scale, mods, varlen)
    key = launch_gluon.forward_key(q, k, v, mods) if varlen is None and not _runtime.interpreted() else None
    if key is not None:
        launch = launch_gluon.FWD_PLANS.get(key)
        if launch is not None:
            return launch.run(q, k, v, softmax_scale, mods.sinks)
    geo = Geometry.of(q, k, varlen, v)
    arch = _arch(q.device)
    out = _runtime.empty((*q.shape[:-1], geo.head_dim_v), launch_triton.out_dtype(q.dtype, arch), q.device)
    lse = _runtime.empty(geo.lse_shape(q), torch.float32, q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    if geo.batch == 0 or geo.max_seqlen_q == 0:  # varlen with no query rows in any sequence
        out.zero_(), lse.fill_(float("inf"))
        return out.to(q.dtype), lse
    runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    features = planning.Features(
        varlen=varlen is not None,
        score_mods=not ScoreMods.only_causal(flags),
        gluon=launch_gluon.ready("fwd", arch, geo, q, q, k, v, out),
    )
    plan = planning.plan(
        arch, q.dtype, geo.head_dim, flags["CAUSAL"], geo.max_seqlen_k, features, "fwd", geo.head_dim_v
    )
    if plan.kernel != "fwd":
        launch_gluon.forward(plan, q, k, v, out, lse, geo, softmax_scale, mods.sinks, key)
        return out, lse
    launch_triton.forward(plan, q, k, v, out, lse, geo, arch, runtime, flags, softmax_scale)
    return out.to(q.dtype), lse


def _invariant_forward(q, k, v, softmax_scale: float, mods: ScoreMods, varlen: Varlen | None):
    """The batch-invariant mode's forward (ops.invariance): the KV-cache kernel over k and v as a cache -- dense: a
    contiguous cache of seqlen_k keys a sequence; varlen: one cache row holding every sequence, sequence b's keys from
    cu_seqlens_k[b] (its left padding) to cu_seqlens_k[b + 1] (its cache_seqlens) -- with q's rows packed as that
    kernel packs a decode step's, so that a prefill row and the decode step of the same token compute alike."""
    if mods.dropout_p > 0:
        raise NotImplementedError(
            "dropout_p > 0 in batch-invariant mode: the mode's kernel (the KV cache's) has no dropout; turn the mode "
            "off for training with dropout (flashattn2.batch_invariant(False))"
        )
    if varlen is None:
        cache = kvcache.Cache(k, v, None, k.shape[1], None, None, None)
        return kvcache.forward(q, cache, 0, softmax_scale, mods, 0)
    cu_k = varlen.cu_seqlens_k
    rows = torch.zeros(cu_k.shape[0] - 1, dtype=torch.int32, device=cu_k.device)
    cache = kvcache.Cache(k.unsqueeze(0), v.unsqueeze(0), cu_k[1:], 0, rows, cu_k[:-1], None, varlen.max_seqlen_k)
    return kvcache.forward(q, cache, 0, softmax_scale, mods, 0, varlen_q=(varlen.cu_seqlens_q, varlen.max_seqlen_q))


def backward(
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
    softmax_scale: float,
    mods: ScoreMods,
    varlen: Varlen | None = None,
    deterministic: bool = True,
    dsink: torch.Tensor | None = None,
) -> None:
    """Writes dq, dk, dv (any strides with a contiguous last dim; views of one packed tensor are
    fine), and with mods.sinks their gradient into dsink. `dlse` is the gradient flowing into the returned
    logsumexp, or None. deterministic=False lets the plan take the Gluon backward (dQ added in any order: its last
    bits may move run to run)."""
    # the kernels read lse, dlse and delta with one set of strides, lse's: all contiguous
    # (registry.bwd_impl makes lse and dlse so; direct callers may not)
    lse = lse if lse.is_contiguous() else lse.contiguous()
    dlse = dlse if dlse is None or dlse.is_contiguous() else dlse.contiguous()
    key = None
    if not deterministic and varlen is None and not _runtime.interpreted():
        key = launch_gluon.backward_key(dout, q, k, v, out, dlse, mods)
        launch = launch_gluon.BWD_PLANS.get(key)
        if launch is not None:
            launch.run(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, mods.sinks, dsink)
            return
    geo = Geometry.of(q, k, varlen, v)
    if q.numel() == 0 or k.numel() == 0 or geo.batch == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        if dsink is not None:  # no key: O = 0, so delta = -dlse
            launch_triton.sink_grad_(dsink, mods.sinks, lse, torch.zeros_like(lse) if dlse is None else -dlse)
        return
    arch = _arch(q.device)
    runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
    features = planning.Features(
        varlen=varlen is not None,
        score_mods=not ScoreMods.only_causal(flags),
        deterministic=deterministic,
        gluon=not deterministic and launch_gluon.ready("bwd", arch, geo, q, q, k, v, dout),
    )
    plan = planning.plan(
        arch, q.dtype, geo.head_dim, flags["CAUSAL"], geo.max_seqlen_k, features, "bwd", geo.head_dim_v
    )
    if plan.kernel == "bwd_hopper":
        launch_gluon.backward(
            plan, dout, q, k, v, out, lse, dlse, dq, dk, dv, geo, arch, softmax_scale, mods.sinks, dsink, key
        )
        return
    launch_triton.backward(
        plan, dout, q, k, v, out, lse, dlse, dq, dk, dv, geo, arch, runtime, flags, softmax_scale, dsink
    )


dropout_probs = launch_triton.dropout_probs
