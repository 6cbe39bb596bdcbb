"""flash_attn.layers.rotary on a Triton kernel: apply_rotary_emb (differentiable, optionally in
place), apply_rotary_emb_qkv_ / apply_rotary_emb_kv_ (in place on packed tensors), their autograd
Functions, the RotaryEmbedding module, and the plain-PyTorch rotate_half / apply_rotary_emb_torch,
with flash_attn's signatures and layouts.

cos/sin are (seqlen_ro, rotary_dim / 2); rotary_dim <= headdim, and the features past it are
left as they are. interleaved=False is GPT-NeoX (halves), True is GPT-J (pairs)."""

from __future__ import annotations

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..ops.request import checks
from ..ops.launch import rotary as _rotary


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, what="x"):
    checks.check_device(x.device, what)  # a CPU tensor runs only in Triton's interpreter, as the attention's
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ArgumentError(
            f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
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
            raise ArgumentError(
                f"seqlen_offsets must be an int or an int32/int64 ({batch},) tensor, got "
                f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}"
            )
        if seqlen_offsets.device != x.device:
            raise ArgumentError(f"seqlen_offsets is on {seqlen_offsets.device}, {what} on {x.device}")
    elif int(seqlen_offsets) < 0:
        raise ArgumentError(f"seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if cu_seqlens is None and x.shape[1] > cos.shape[0]:
        # flash_attn's rule: positions past the table (from an offset) are left unrotated
        raise ArgumentError(f"seqlen {x.shape[1]} exceeds the {cos.shape[0]} positions of cos/sin")


def rotate_half(x, interleaved=False):
    """(x1, x2) -> (-x2, x1) over the last dimension: its halves (GPT-NeoX), or its even and odd
    features when interleaved (GPT-J)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """The rotary embedding in plain PyTorch, as flash_attn's reference: x (batch, seqlen, nheads,
    headdim); cos/sin (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2), one row per
    token of x (no offsets: slice or gather the rows first). Returns a new tensor."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ArgumentError(f"rotary_dim {rotary_dim} (2 * cos.shape[-1]) exceeds headdim {x.shape[-1]}")
    if interleaved:
        cos, sin = (t.repeat_interleave(2, dim=-1) for t in (cos, sin))
    else:
        cos, sin = (torch.cat((t, t), dim=-1) for t in (cos, sin))
    # (..., seqlen, rotary_dim) -> (..., seqlen, 1, rotary_dim): shared by the heads
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = x[..., :rotary_dim]
    return torch.cat((rot * cos + rotate_half(rot, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


def _save_offsets(ctx, seqlen_offsets, *tensors):
    """save_for_backward takes tensors only: an int offset goes on ctx."""
    if isinstance(seqlen_offsets, torch.Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _saved(ctx):
    """(saved tensors without the offsets, seqlen_offsets)."""
    if ctx.seqlen_offsets is None:
        *tensors, offsets = ctx.saved_tensors
        return tensors, offsets
    return list(ctx.saved_tensors), ctx.seqlen_offsets


def _dense(grad):
    # rotated in place: a private dense copy (the incoming gradient may be shared, strided or
    # expanded with stride 0)
    return grad.clone(memory_format=torch.contiguous_format)


class ApplyRotaryEmb(torch.autograd.Function):
    """apply_rotary_emb's autograd Function; apply() takes its arguments in the same order."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
        _check(x, cos, sin, seqlen_offsets, cu_seqlens)
        out = x if inplace else x.clone()
        _rotary.rotate_(out, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen=max_seqlen)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, do):
        (cos, sin, cu_seqlens), offsets = _saved(ctx)
        dx = _dense(do)
        _rotary.rotate_(dx, cos, sin, ctx.interleaved, offsets, cu_seqlens, conjugate=True, max_seqlen=ctx.max_seqlen)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (batch + 1,)
    int32 and max_seqlen; cos/sin (seqlen_ro, rotary_dim / 2) in x's dtype; seqlen_offsets an
    int or a (batch,) tensor (token i of sequence b is at position i + seqlen_offsets[b], as in
    KV-cache decoding). Returns x with its first rotary_dim features rotated (x itself when
    inplace)."""
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


# flash_attn keeps this name for backward compatibility
apply_rotary_emb_func = apply_rotary_emb


def _qk_views(qkv, num_heads_q):
    """The (q, k) views of a packed qkv: 5-d (batch, seqlen, 3, nheads, headdim), or 4-d
    (batch, seqlen, nheads_q + 2 * nheads_k, headdim) with num_heads_q."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ArgumentError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() == 4:
        if num_heads_q is None or (qkv.shape[2] - num_heads_q) % 2 or num_heads_q >= qkv.shape[2]:
            raise ArgumentError(
                "a 4-d qkv needs num_heads_q with nheads_q + 2 * nheads_k = qkv.shape[2], got "
                f"num_heads_q={num_heads_q} and shape {tuple(qkv.shape)}"
            )
        hk = (qkv.shape[2] - num_heads_q) // 2
        return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + hk]
    raise ArgumentError(f"qkv must be 5-d (batch, seqlen, 3, nheads, headdim) or 4-d, got {tuple(qkv.shape)}")


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """apply_rotary_emb_qkv_'s autograd Function; apply() takes its arguments in the same order."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None):
        cos_k = cos if cos_k is None else cos_k
        sin_k = sin if sin_k is None else sin_k
        q, k = _qk_views(qkv, num_heads_q)
        _check(q, cos, sin, seqlen_offsets, None, "q")
        _check(k, cos_k, sin_k, seqlen_offsets, None, "k")
        _rotary.rotate_(q, cos, sin, interleaved, seqlen_offsets)
        _rotary.rotate_(k, cos_k, sin_k, interleaved, seqlen_offsets)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        (cos, sin, cos_k, sin_k), offsets = _saved(ctx)
        dqkv = _dense(dqkv)
        dq, dk = _qk_views(dqkv, ctx.num_heads_q)
        _rotary.rotate_(dq, cos, sin, ctx.interleaved, offsets, conjugate=True)
        _rotary.rotate_(dk, cos_k, sin_k, ctx.interleaved, offsets, conjugate=True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None):
    """In place on qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 *
    nheads_k, headdim) with num_heads_q (GQA): rotates q and k (k with cos_k/sin_k when given).
    Returns qkv."""
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


def _k_view(kv):
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ArgumentError(f"kv must be (batch, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return kv[:, :, 0]


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """apply_rotary_emb_kv_'s autograd Function; apply() takes its arguments in the same order."""

    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        k = _k_view(kv)
        _check(k, cos, sin, seqlen_offsets, None, "k")
        _rotary.rotate_(k, cos, sin, interleaved, seqlen_offsets)
        _save_offsets(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        (cos, sin), offsets = _saved(ctx)
        dkv = _dense(dkv)
        _rotary.rotate_(_k_view(dkv), cos, sin, ctx.interleaved, offsets, conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """In place on kv (batch, seqlen, 2, nheads_k, headdim): rotates k. Returns kv."""
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding (RoFormer, GPT-NeoX / GPT-J) with cached cos/sin, as flash_attn's module:
    forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None) rotates q and k in
    place and returns qkv, or (q, kv) when kv is given. dim is the rotary dimension.

    pos_idx_in_fp32 (flashattn2's, keyword-only; flash_attn 2.8 always behaves as True): the
    tables come from fp32 positions and an fp32 inv_freq (recomputed when the module was cast to
    fp16/bf16). False builds them in inv_freq's dtype, as older flash_attn releases could, to
    match models trained in pure bf16."""

    def __init__(
        self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None, *, pos_idx_in_fp32=True
    ):
        super().__init__()
        if dim % 2:
            raise ArgumentError(f"rotary dim must be even, got {dim}")
        if scale_base is not None:
            raise NotImplementedError("RotaryEmbedding(scale_base=...) (XPos) is not supported by flashattn2")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.scale_base = self.scale = None
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None
        self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if (
            seqlen > self._seq_len_cached
            or self._cos_cached is None
            or self._cos_cached.device != device
            or self._cos_cached.dtype != dtype
            or (self.training and self._cos_cached.is_inference())
        ):
            self._seq_len_cached = seqlen
            if self.pos_idx_in_fp32:
                t = torch.arange(seqlen, device=device, dtype=torch.float32)
                # a module cast to fp16/bf16 holds a rounded inv_freq: recompute it in fp32
                inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
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
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, torch.Tensor):
            raise ArgumentError("a tensor seqlen_offset needs max_seqlen (the cos/sin cache length)")
        else:
            self._update_cos_sin_cache(seqlen + int(seqlen_offset), device=qkv.device, dtype=qkv.dtype)
        cos, sin = self._cos_cached, self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, cos, sin, interleaved=self.interleaved, seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q
            )
        q = apply_rotary_emb(qkv, cos, sin, interleaved=self.interleaved, inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos, sin, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv


__all__ = [
    "rotate_half",
    "apply_rotary_emb_torch",
    "ApplyRotaryEmb",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "ApplyRotaryEmbQKV_",
    "apply_rotary_emb_qkv_",
    "ApplyRotaryEmbKV_",
    "apply_rotary_emb_kv_",
    "RotaryEmbedding",
]
