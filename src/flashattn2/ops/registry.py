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


def _mods(causal, window_left, window_right, softcap, alibi_slopes) -> attention.ScoreMods:
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    return attention.ScoreMods(causal, window_left, window_right, softcap, alibi_slopes)


@torch.library.custom_op("flashattn2::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float,
        alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (_for_kernels(t) for t in (q, k, v))
    mods = _mods(causal, window_left, window_right, softcap, alibi_slopes)
    with _runtime.device_of(q):
        return attention.forward(q, k, v, softmax_scale, mods)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashattn2::bwd", mutates_args=("dq", "dk", "dv"))
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor,
        dv: torch.Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
        softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    dout, q, k, v, out = (_for_kernels(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    mods = _mods(causal, window_left, window_right, softcap, alibi_slopes)
    with _runtime.device_of(q):
        attention.backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, mods)


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes):
    return None


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, *options, alibi_slopes = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.args = (softmax_scale, *options)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = _runtime.empty_like(q), _runtime.empty_like(k), _runtime.empty_like(v)
    bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, *ctx.args, alibi_slopes)
    return dq, dk, dv, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


class PackedAttention(torch.autograd.Function):
    """Attention over packed inputs whose backward writes one packed gradient (no concat).

    packing "qkv": `packed` is (batch, seqlen, 3, nheads, headdim) and `q` is None;
    packing "kv": `packed` is (batch, seqlen_k, 2, nheads_k, headdim) beside `q`.
    `options` are fwd's (softmax_scale, causal, window_left, window_right, softcap).
    """

    @staticmethod
    def forward(ctx, q, packed, alibi_slopes, packing, *options):
        if packing == "qkv":
            q, k, v = packed.unbind(dim=2)
        else:
            k, v = packed.unbind(dim=2)
        out, lse = fwd(q, k, v, *options, alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.packing, ctx.options = packing, options
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        if ctx.packing == "qkv":
            dpacked = _runtime.empty((*q.shape[:2], 3, *q.shape[2:]), q.dtype, q.device)
            dq, dk, dv = dpacked.unbind(dim=2)
        else:
            dq = _runtime.empty_like(q)
            dpacked = _runtime.empty((*k.shape[:2], 2, *k.shape[2:]), k.dtype, k.device)
            dk, dv = dpacked.unbind(dim=2)
        bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, *ctx.options, alibi_slopes)
        nones = (None,) * (2 + len(ctx.options))
        return (None if ctx.packing == "qkv" else dq), dpacked, *nones
