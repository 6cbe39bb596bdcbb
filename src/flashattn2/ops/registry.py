"""torch.library registration: `flashattn2::fwd` (functional, differentiable) and
`flashattn2::bwd` (writes dq, dk, dv in place, so packed callers can pass views of one tensor).
Both have fake implementations, so torch.compile traces them without a graph break."""
from __future__ import annotations

import torch

from . import _runtime, attention


def _for_kernels(t: torch.Tensor) -> torch.Tensor:
    """Last dimension contiguous and no broadcast (stride-0) dimension: what the kernels and TMA
    descriptors accept. A gradient of out.sum() arrives expanded, with stride 0."""
    if t.stride(-1) != 1 or 0 in t.stride():
        return t.contiguous()
    return t


@torch.library.custom_op("flashattn2::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (_for_kernels(t) for t in (q, k, v))
    with _runtime.device_of(q):
        return attention.forward(q, k, v, softmax_scale, causal)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashattn2::bwd", mutates_args=("dq", "dk", "dv"))
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
        dv: torch.Tensor, softmax_scale: float, causal: bool) -> None:
    dout, q, k, v, out = (_for_kernels(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    with _runtime.device_of(q):
        attention.backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal)


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal):
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _runtime.empty_like(q), _runtime.empty_like(k), _runtime.empty_like(v)
    bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, ctx.softmax_scale, ctx.causal)
    return dq, dk, dv, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


class PackedAttention(torch.autograd.Function):
    """Attention over packed inputs whose backward writes one packed gradient (no concat).

    packing "qkv": `packed` is (batch, seqlen, 3, nheads, headdim) and `q` is None;
    packing "kv": `packed` is (batch, seqlen_k, 2, nheads_k, headdim) beside `q`.
    """

    @staticmethod
    def forward(ctx, q, packed, softmax_scale, causal, packing):
        if packing == "qkv":
            q, k, v = packed.unbind(dim=2)
        else:
            k, v = packed.unbind(dim=2)
        out, lse = fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, packing)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        softmax_scale, causal, packing = ctx.args
        if packing == "qkv":
            dpacked = _runtime.empty((*q.shape[:2], 3, *q.shape[2:]), q.dtype, q.device)
            dq, dk, dv = dpacked.unbind(dim=2)
        else:
            dq = _runtime.empty_like(q)
            dpacked = _runtime.empty((*k.shape[:2], 2, *k.shape[2:]), k.dtype, k.device)
            dk, dv = dpacked.unbind(dim=2)
        bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal)
        if packing == "qkv":
            return None, dpacked, None, None, None
        return dq, dpacked, None, None, None
