"""flash_attn.layers.rotary on a Triton kernel: apply_rotary_emb (differentiable, optionally in
place), apply_rotary_emb_qkv_ / apply_rotary_emb_kv_ (in place on packed tensors) and the
RotaryEmbedding module, with flash_attn's signatures and layouts.

cos/sin are (seqlen_ro, rotary_dim / 2); rotary_dim <= headdim, and the features past it are
left as they are. interleaved=False is GPT-NeoX (halves), True is GPT-J (pairs)."""
from __future__ import annotations

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..ops import rotary as _rotary


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, what="x"):
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ArgumentError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    headdim = x.shape[-1]
    if 2 * cos.shape[1] > headdim:
        raise ArgumentError(f"rotary_dim {2 * cos.shape[1]} (2 * cos.shape[1]) exceeds headdim {headdim}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ArgumentTypeError(f"cos/sin ({cos.dtype}/{sin.dtype}) must have {what}'s dtype {x.dtype}")
    if cos.device != x.device or sin.device != x.device:
        raise ArgumentError(f"cos/sin are on {cos.device}/{sin.device}, {what} on {x.device}")
    if x.stride(-1) != 1:
        raise ArgumentError(f"{what} must be contiguous in its last dimension")
    if cu_seqlens is not None:
        if x.dim() != 3:
            raise ArgumentError(f"with cu_seqlens, {what} must be (total, nheads, headdim), got {tuple(x.shape)}")
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise ArgumentTypeError("cu_seqlens must be an int32 (batch + 1,) tensor")
    elif x.dim() != 4:
        raise ArgumentError(f"{what} must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
    if cu_seqlens is not None and cu_seqlens.device != x.device:
        raise ArgumentError(f"cu_seqlens is on {cu_seqlens.device}, {what} on {x.device}")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ArgumentError(f"seqlen_offsets must be an int or an int32/int64 ({batch},) tensor, got "
                             f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            raise ArgumentError(f"seqlen_offsets is on {seqlen_offsets.device}, {what} on {x.device}")
    elif int(seqlen_offsets) < 0:
        raise ArgumentError(f"seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if cu_seqlens is None and x.shape[1] > cos.shape[0]:
        # flash_attn's rule: positions past the table (from an offset) are left unrotated
        raise ArgumentError(f"seqlen {x.shape[1]} exceeds the {cos.shape[0]} positions of cos/sin")


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
        out = x if inplace else x.clone()
        _rotary.rotate_(out, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen=max_seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            ctx.save_for_backward(cos, sin, cu_seqlens, seqlen_offsets)
            ctx.seqlen_offsets = None
        else:
            ctx.save_for_backward(cos, sin, cu_seqlens)
            ctx.seqlen_offsets = seqlen_offsets
        ctx.interleaved, ctx.inplace, ctx.max_seqlen = interleaved, inplace, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.seqlen_offsets is None:
            cos, sin, cu_seqlens, offsets = ctx.saved_tensors
        else:
            (cos, sin, cu_seqlens), offsets = ctx.saved_tensors, ctx.seqlen_offsets
        # rotated in place: a private dense copy (the incoming gradient may be shared, strided or
        # expanded with stride 0)
        grad = grad.clone(memory_format=torch.contiguous_format)
        _rotary.rotate_(grad, cos, sin, ctx.interleaved, offsets, cu_seqlens, conjugate=True,
                        max_seqlen=ctx.max_seqlen)
        return grad, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (batch + 1,)
    int32 and max_seqlen; cos/sin (seqlen_ro, rotary_dim / 2) in x's dtype; seqlen_offsets an
    int or a (batch,) tensor (token i of sequence b is at position i + seqlen_offsets[b], as in
    KV-cache decoding). Returns x with its first rotary_dim features rotated (x itself when
    inplace)."""
    _check(x, cos, sin, seqlen_offsets, cu_seqlens)
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


class _RotateInPlace(torch.autograd.Function):
    """Rotate views of one packed tensor in place (view i with cos[i], sin[i]); the backward
    rotates the same views of the gradient back."""

    @staticmethod
    def forward(ctx, packed, views, cos, sin, interleaved, seqlen_offsets):
        for select, c, s in zip(views, cos, sin):
            _rotary.rotate_(select(packed), c, s, interleaved, seqlen_offsets)
        ctx.views, ctx.cos, ctx.sin, ctx.interleaved, ctx.seqlen_offsets = views, cos, sin, interleaved, seqlen_offsets
        ctx.mark_dirty(packed)
        return packed

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        for select, c, s in zip(ctx.views, ctx.cos, ctx.sin):
            _rotary.rotate_(select(grad), c, s, ctx.interleaved, ctx.seqlen_offsets, conjugate=True)
        return grad, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """In place on qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 *
    nheads_k, headdim) with num_heads_q (GQA): rotates q and k (k with cos_k/sin_k when given).
    Returns qkv."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ArgumentError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        views = (lambda t: t[:, :, 0], lambda t: t[:, :, 1])
    elif qkv.dim() == 4:
        if num_heads_q is None or (qkv.shape[2] - num_heads_q) % 2 or num_heads_q >= qkv.shape[2]:
            raise ArgumentError("a 4-d qkv needs num_heads_q with nheads_q + 2 * nheads_k = qkv.shape[2], got "
                             f"num_heads_q={num_heads_q} and shape {tuple(qkv.shape)}")
        hq, hk = num_heads_q, (qkv.shape[2] - num_heads_q) // 2
        views = (lambda t: t[:, :, :hq], lambda t: t[:, :, hq:hq + hk])
    else:
        raise ArgumentError(f"qkv must be 5-d (batch, seqlen, 3, nheads, headdim) or 4-d, got {tuple(qkv.shape)}")
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    for select, c, s, name in ((views[0], cos, sin, "q"), (views[1], cos_k, sin_k, "k")):
        _check(select(qkv), c, s, seqlen_offsets, None, name)
    return _RotateInPlace.apply(qkv, views, (cos, cos_k), (sin, sin_k), interleaved, seqlen_offsets)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """In place on kv (batch, seqlen, 2, nheads_k, headdim): rotates k. Returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ArgumentError(f"kv must be (batch, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    views = (lambda t: t[:, :, 0],)
    _check(views[0](kv), cos, sin, seqlen_offsets, None, "k")
    return _RotateInPlace.apply(kv, views, (cos,), (sin,), interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding (RoFormer, GPT-NeoX / GPT-J) with cached cos/sin, as flash_attn's module:
    forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None) rotates q and k in
    place and returns qkv, or (q, kv) when kv is given. dim is the rotary dimension."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
                 device=None):
        super().__init__()
        if dim % 2:
            raise ArgumentError(f"rotary dim must be even, got {dim}")
        if scale_base is not None:
            raise NotImplementedError("RotaryEmbedding(scale_base=...) (XPos) is not supported by flashattn2")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.scale = None
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if (seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference())):
            self._seq_len_cached = seqlen
            if self.pos_idx_in_fp32:
                t = torch.arange(seqlen, device=device, dtype=torch.float32)
                inv_freq = self.inv_freq.to(torch.float32) if self.inv_freq.dtype != torch.float32 else self.inv_freq
            else:
                t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
                inv_freq = self.inv_freq
            freqs = torch.outer(t, inv_freq.to(device))
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        """qkv (batch, seqlen, 3, nheads, headdim) (or 4-d with num_heads_q), or q alone
        (batch, seqlen, nheads, headdim) when kv (batch, seqlen, 2, nheads_k, headdim) is given.
        seqlen_offset: an int, or a (batch,) tensor with max_seqlen (decoding)."""
        seqlen = qkv.shape[1]
        if isinstance(seqlen_offset, torch.Tensor):
            if max_seqlen is None:
                raise ArgumentError("a tensor seqlen_offset needs max_seqlen (the cos/sin cache length)")
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        else:
            self._update_cos_sin_cache(seqlen + int(seqlen_offset), device=qkv.device, dtype=qkv.dtype)
        cos, sin = self._cos_cached, self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, cos, sin, interleaved=self.interleaved, inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos, sin, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv


__all__ = ["apply_rotary_emb", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_", "RotaryEmbedding"]
