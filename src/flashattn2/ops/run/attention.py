"""Dense and varlen attention: a prepared call's plan (ops.run.call, ops.planning) launched on its tensors -- the Gluon
kernels (ops.launch.launch_gluon), the Triton ones (ops.launch.launch_triton), or in the batch-invariant mode the
KV-cache kernel (ops.launch.kvcache).

Inputs arrive validated (the prepared call): (batch, seqlen_q, nheads, headdim) or (total, nheads, headdim), one
dtype, one device, the last dimension contiguous (registry.for_kernels).
"""

from __future__ import annotations

import torch

from ..launch import kvcache, launch_gluon, launch_triton
from .call import AttentionCall, BackwardCall
from ..launch.layout import BackwardTensors, ForwardTensors
from ..planning import DecodePlan


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def _launch(call: AttentionCall):
    """The forward's launch, made at the call's first run: the Gluon kernel's (launch_gluon.ForwardLaunch) or the
    Triton kernel's (launch_triton.Forward)."""
    layout = call.layout
    if call.plan.gluon:
        return launch_gluon.ForwardLaunch(call.plan, layout, call.spec.sink is not None)
    return launch_triton.Forward(layout, call.plan)


def forward(call: AttentionCall, t: ForwardTensors, lse_wanted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """out like q in q's dtype (bf16 for FP8 inputs) with v's head dim; lse fp32 (batch, nheads, seqlen_q), or
    (nheads, total_q) in varlen (lse_wanted False: the caller drops it, _runtime.output_lse). The launches get ALiBi's
    slopes and the sink contiguous."""
    alibi, sink = t.alibi, t.sink
    if (alibi is not None and not alibi.is_contiguous()) or (sink is not None and not sink.is_contiguous()):
        t = t._replace(alibi=_contiguous(alibi), sink=_contiguous(sink))
    if isinstance(call.plan, DecodePlan):  # (the batch-invariant mode)
        return _invariant_forward(call, t)
    launch = call.launch
    if launch is None:
        launch = call.launch = _launch(call)
    return launch(t, lse_wanted)


def _invariant_forward(call: AttentionCall, t: ForwardTensors):
    """The batch-invariant mode's forward (ops.request.invariance): the KV-cache kernel over k and v as a cache
    (kvcache.invariant_shape), with q's rows packed as that kernel packs a decode step's, so that a prefill row and
    the decode step of the same token compute alike. FP8 inputs: that kernel's FP8 path, descales as given."""
    if call.options.dropout_p > 0:
        raise NotImplementedError(
            "dropout_p > 0 in batch-invariant mode: the mode's kernel (the KV cache's) has no dropout; turn the mode "
            "off for training with dropout (flashattn2.batch_invariant(False))"
        )
    decode = call.launch
    spec = call.spec
    fp8 = call.layout.descale_strides is not None
    if decode is None:
        specs_ = (spec.descales or (None, None, None))[:3] if fp8 else kvcache.NO_DESCALES
        decode = call.launch = kvcache.Decode(call.plan, kvcache.invariant_shape(call, specs_), spec.modes.arch)
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sink, _, descale = t
    descales = (descale or kvcache.NO_DESCALES) if fp8 else kvcache.NO_DESCALES
    if cu_seqlens_q is None:  # the keys as a cache of k.shape[1] positions a sequence
        return decode(q, kvcache.Cache(k, v, None, k.shape[1], descales=descales), None, alibi, sink)
    # packed keys as one cache row: sequence b's at its cu_seqlens_k[b] (leftpad), cu_seqlens_k[b + 1] the end
    rows = torch.zeros(cu_seqlens_k.shape[0] - 1, dtype=torch.int32, device=cu_seqlens_k.device)
    cache = kvcache.Cache(k.unsqueeze(0), v.unsqueeze(0), cu_seqlens_k[1:], 0, rows, cu_seqlens_k[:-1], None, descales)
    return decode(q, cache, cu_seqlens_q, alibi, sink)


def backward(bcall: BackwardCall, call: AttentionCall, t: BackwardTensors) -> None:
    """Writes t.dq, t.dk, t.dv (any strides with a contiguous last dim; views of one packed tensor are fine), and with
    a sink its gradient into t.dsink. t.dlse is the gradient flowing into the returned logsumexp, or None. The plan
    (bcall) says which backward runs: the Gluon one only for deterministic=False (dQ added in any order: its last
    bits may move run to run)."""
    # the kernels read lse, dlse and delta with one set of strides, lse's: all contiguous
    lse, dlse, sink, dsink = t.lse, t.dlse, t.sink, t.dsink
    lse = lse if lse.is_contiguous() else lse.contiguous()
    dlse = dlse if dlse is None or dlse.is_contiguous() else dlse.contiguous()
    layout = call.layout
    if t.q.numel() == 0 or t.k.numel() == 0 or layout.batch == 0:
        t.dq.zero_(), t.dk.zero_(), t.dv.zero_()
        if dsink is not None:  # no key: O = 0, so delta = -dlse
            launch_triton.sink_grad_(dsink, sink, lse, torch.zeros_like(lse) if dlse is None else -dlse)
        return
    launch = bcall.launch
    if launch is None:
        plan = bcall.plan
        if plan.gluon:
            launch = launch_gluon.BackwardLaunch(plan, layout, bcall.spec, sink is not None)
        else:
            b = bcall.spec
            launch = launch_triton.Backward(layout, plan, b.out, b.dout, b.grads, b.dlse, sink is not None)
        bcall.launch = launch
    alibi, sink_ = _contiguous(t.alibi), _contiguous(sink)
    if lse is not t.lse or dlse is not t.dlse or alibi is not t.alibi or sink_ is not sink:  # (_replace costs us)
        t = t._replace(lse=lse, dlse=dlse, alibi=alibi, sink=sink_)
    launch(t)


def dropout_probs(call: AttentionCall, q, k, cu_seqlens_q, cu_seqlens_k, alibi, seed) -> torch.Tensor:
    """S_dmask for the dropout mask the forward drew with the same seed (a testing aid)."""
    alibi = _contiguous(alibi)
    return launch_triton.dropout_probs(call.layout, q, k, cu_seqlens_q, cu_seqlens_k, alibi, seed)
