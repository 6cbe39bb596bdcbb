"""flash_attn.modules.mha on flashattn2's kernels, with the same constructors and forwards.

- `FlashSelfAttention(qkv)` / `FlashCrossAttention(q, kv)`: the attention alone, padded
  `(batch, seqlen, ...)` or varlen `(total, ...)` with `cu_seqlens`; `SelfAttention` /
  `CrossAttention` are the same in plain PyTorch (flash_attn's reference versions).
- `MHA`: projections + attention + output projection; GQA/MQA (`num_heads_kv`), cross-attention,
  rotary, ALiBi, a local window, varlen input, `key_padding_mask`, and KV-cache decoding through
  `flash_attn_with_kvcache` (`inference_params`, see `flashattn2.utils.generation`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..api import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from ..bert_padding import index_first_axis, pad_input, unpad_input
from ..errors import ArgumentError, ArgumentTypeError
from ..layers.rotary import RotaryEmbedding


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's per-head slopes (Press et al.): a geometric sequence, interleaved when nheads is
    not a power of two."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(nheads).is_integer():
        return power_of_2(nheads)
    closest = 2 ** math.floor(math.log2(nheads))
    return power_of_2(closest) + get_alibi_slopes(2 * closest)[0::2][: nheads - closest]


def _dropout_p(module: nn.Module) -> float:
    return module.drop.p if module.training else 0.0


def _check_window_and_slopes(window_size, alibi_slopes):
    """Caught at construction: FlashSelfAttention and FlashCrossAttention take these two in
    opposite positional orders (as flash_attn's do), so a swap is a likely mistake."""
    # the values are checked by the attention functions
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ArgumentTypeError(
            f"window_size must be a pair (left, right), -1 for unbounded, got {type(window_size).__name__}"
        )
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise ArgumentTypeError(
            f"alibi_slopes must be None or a (nheads,) or (batch, nheads) tensor, got {type(alibi_slopes).__name__}"
        )


class _FlashAttention(nn.Module):
    """What FlashSelfAttention and FlashCrossAttention share: the options and the dropout."""

    def __init__(self, causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic):
        super().__init__()
        _check_window_and_slopes(window_size, alibi_slopes)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def slopes(self):
        """The ALiBi slopes as the kernels take them (fp32), or None."""
        return None if self.alibi_slopes is None else self.alibi_slopes.float()

    def _options(self, causal, learnable_sink=None):
        return dict(
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            alibi_slopes=self.slopes(),
            window_size=self.window_size,
            deterministic=self.deterministic,
            learnable_sink=learnable_sink,
        )


class FlashSelfAttention(_FlashAttention):
    """softmax(Q K^T * scale) V of packed qkv.

    FlashSelfAttention(causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                       alibi_slopes=None, deterministic=False)
    forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None, *, learnable_sink=None):
        qkv: (batch, seqlen, 3, nheads, headdim), or (total, 3, nheads, headdim) with cu_seqlens
        ((batch + 1,) int32) and max_seqlen (int). Returns (batch, seqlen, nheads, headdim) or
        (total, nheads, headdim). causal overrides the constructor's for this call; learnable_sink:
        float32 (nheads,) attention sinks (flash_attn_func's).
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
    ):
        super().__init__(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None, *, learnable_sink=None):
        options = self._options(causal, learnable_sink)
        if cu_seqlens is None:
            return flash_attn_qkvpacked_func(qkv, _dropout_p(self), **options)
        if max_seqlen is None:
            raise ArgumentError("FlashSelfAttention: cu_seqlens needs max_seqlen")
        return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, _dropout_p(self), **options)


class FlashCrossAttention(_FlashAttention):
    """softmax(Q K^T * scale) V with K/V packed apart from Q (cross-attention, GQA/MQA).

    FlashCrossAttention(causal=False, softmax_scale=None, attention_dropout=0.0, alibi_slopes=None,
                        window_size=(-1, -1), deterministic=False): alibi_slopes before
    window_size, the reverse of FlashSelfAttention's order, as in flash_attn.
    forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
        q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim), nheads
        a multiple of nheads_k. Varlen: q (total_q, ...), kv (total_k, ...) with cu_seqlens /
        max_seqlen for q and cu_seqlens_k / max_seqlen_k for kv (defaulting to q's: self-attention).
        Causal with seqlen_q != seqlen_k is aligned to the bottom-right corner. Keyword-only
        learnable_sink: float32 (nheads,) attention sinks (flash_attn_func's).
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        alibi_slopes=None,
        window_size=(-1, -1),
        deterministic=False,
    ):
        super().__init__(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(
        self,
        q,
        kv,
        causal=None,
        cu_seqlens=None,
        max_seqlen=None,
        cu_seqlens_k=None,
        max_seqlen_k=None,
        *,
        learnable_sink=None,
    ):
        options = self._options(causal, learnable_sink)
        if cu_seqlens is None:
            if cu_seqlens_k is not None:
                raise ArgumentError("FlashCrossAttention: cu_seqlens_k without cu_seqlens")
            return flash_attn_kvpacked_func(q, kv, _dropout_p(self), **options)
        if max_seqlen is None:
            raise ArgumentError("FlashCrossAttention: cu_seqlens needs max_seqlen")
        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        elif max_seqlen_k is None:
            raise ArgumentError("FlashCrossAttention: cu_seqlens_k needs max_seqlen_k")
        return flash_attn_varlen_kvpacked_func(
            q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, _dropout_p(self), **options
        )


def _reference_attention(q, k, v, causal, softmax_scale, key_padding_mask, drop, self_attention):
    """q (b, sq, h, d), k/v (b, sk, h_k, d): plain PyTorch, masked scores at -10000 as flash_attn's
    reference modules (a row whose keys are all masked averages them instead of giving NaN).
    Causal: self-attention's diagonal starts at the first token of each (right-padded) sequence;
    cross-attention's is aligned to the bottom-right corner of each sequence's valid keys."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    if k.shape[2] != nheads:  # GQA/MQA: each K/V head serves nheads // nheads_k query heads
        k, v = (t.repeat_interleave(nheads // k.shape[2], dim=2) for t in (k, v))
    scale = softmax_scale or 1.0 / math.sqrt(headdim)
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -10000.0)
    if causal:
        # bottom-right alignment; with padding, each sequence's own key count sets the diagonal
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)
        keys = seqlen_k
        if key_padding_mask is not None and not self_attention:
            keys = key_padding_mask.sum(-1)[:, None, None, None]
        scores = scores.masked_fill(cols > rows + keys - seqlen_q, -10000.0)
    attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
    return torch.einsum("bhts,bshd->bthd", drop(attention), v)


class SelfAttention(nn.Module):
    """FlashSelfAttention's math in plain PyTorch; forward(qkv, causal=None, key_padding_mask=None),
    key_padding_mask (batch, seqlen) bool, True where the token is kept."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        return self.attend(*qkv.unbind(dim=2), causal=causal, key_padding_mask=key_padding_mask)

    def attend(self, q, k, v, causal=None, key_padding_mask=None):
        """The same on q, k, v (batch, seqlen, nheads(_k), headdim) apart."""
        return _reference_attention(
            q,
            k,
            v,
            self.causal if causal is None else causal,
            self.softmax_scale,
            key_padding_mask,
            self.drop,
            self_attention=True,
        )


class CrossAttention(SelfAttention):
    """FlashCrossAttention's math in plain PyTorch; forward(q, kv, causal=None, key_padding_mask=None),
    key_padding_mask (batch, seqlen_k) bool over the keys."""

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        k, v = kv.unbind(dim=2)
        return _reference_attention(
            q,
            k,
            v,
            self.causal if causal is None else causal,
            self.softmax_scale,
            key_padding_mask,
            self.drop,
            self_attention=False,
        )


def _update_kv_cache(kv, inference_params, layer_idx):
    """Write kv (batch, seqlen, 2, nheads_k, headdim) into this layer's cache at the batch and
    sequence offsets of inference_params (allocating the cache on first use); returns the cache's
    (batch, seqlen_offset + seqlen, 2, nheads_k, headdim) prefix."""
    num_heads, head_dim = kv.shape[-2:]
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = torch.empty(
            inference_params.max_batch_size,
            inference_params.max_seqlen,
            2,
            num_heads,
            head_dim,
            dtype=kv.dtype,
            device=kv.device,
        )
        inference_params.key_value_memory_dict[layer_idx] = cache
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    seq_start = inference_params.seqlen_offset
    seq_end = seq_start + kv.shape[1]
    if batch_end > cache.shape[0] or seq_end > cache.shape[1]:
        raise ArgumentError(
            f"inference_params: the KV cache holds {tuple(cache.shape[:2])} (batch, seqlen); "
            f"writing rows {batch_start}:{batch_end}, positions {seq_start}:{seq_end}"
        )
    cache[batch_start:batch_end, seq_start:seq_end] = kv
    return cache[batch_start:batch_end, :seq_end]


class MHA(nn.Module):
    """Multi-head self- or cross-attention layer, as flash_attn.modules.mha.MHA.

    embed_dim = num_heads * headdim. num_heads_kv (default num_heads) K/V heads: GQA/MQA.
    cross_attn: q from x, k/v from x_kv. rotary_emb_dim > 0 rotates the first rotary_emb_dim
    channels of q and k (GPT-NeoX, or GPT-J with rotary_emb_interleaved). use_alibi adds ALiBi
    biases; window_size is the local window (left, right), -1 for unbounded. use_flash_attn=False
    (flash_attn's default) runs the plain-PyTorch SelfAttention/CrossAttention instead of the
    kernels. fused_bias_fc=True takes nn.Linear (the same math as flash_attn's fused layer).
    return_residual: forward returns (out, x). checkpointing recomputes the attention in the
    backward. layer_idx names this layer's KV cache in inference_params. Keyword-only learnable_sink=True
    (use_flash_attn=True) adds learnable attention sinks, a float32 parameter `learnable_sink` (num_heads,)
    starting at 0: one logit per head in every row's softmax denominator (gpt-oss), in training and decoding.

    forward(x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
            inference_params=None):
        x: (batch, seqlen, embed_dim), or (total, embed_dim) with cu_seqlens and max_seqlen
        (varlen, kernels only). key_padding_mask (batch, seqlen) bool, True for kept tokens; the
        kernel path drops padded tokens (their attention output is 0, so their rows of the
        result are out_proj's bias). inference_params: prefill when
        seqlen_offset == 0, else decoding against the cache (batch, seqlen = new tokens).
        Returns (batch, seqlen, embed_dim) (or (total, embed_dim)).
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        num_heads_kv=None,
        cross_attn=False,
        qkv_proj_bias=True,
        out_proj_bias=True,
        dropout=0.0,
        softmax_scale=None,
        causal=False,
        layer_idx=None,
        dwconv=False,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_scale_base=None,
        rotary_emb_interleaved=False,
        use_alibi=False,
        window_size=(-1, -1),
        fused_bias_fc=False,
        use_flash_attn=False,
        return_residual=False,
        checkpointing=False,
        device=None,
        dtype=None,
        *,
        learnable_sink=False,
    ):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads:
            raise ArgumentError(f"MHA: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads_kv <= 0 or num_heads % num_heads_kv:
            raise ArgumentError(f"MHA: num_heads ({num_heads}) must be a multiple of num_heads_kv ({num_heads_kv})")
        self.head_dim = embed_dim // num_heads
        if rotary_emb_dim < 0 or rotary_emb_dim > self.head_dim or rotary_emb_dim % 2:
            raise ArgumentError(
                f"MHA: rotary_emb_dim ({rotary_emb_dim}) must be even and at most the head dimension ({self.head_dim})"
            )
        if dwconv:
            raise NotImplementedError("MHA(dwconv=True) (depthwise convolution of q/k/v) is not supported")
        if not use_flash_attn and (use_alibi or tuple(window_size) != (-1, -1) or learnable_sink):
            raise ArgumentError("MHA: use_alibi, window_size and learnable_sink need use_flash_attn=True")
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.cross_attn, self.causal, self.layer_idx = cross_attn, causal, layer_idx
        self.dwconv, self.rotary_emb_dim = False, rotary_emb_dim
        self.use_flash_attn, self.return_residual, self.checkpointing = use_flash_attn, return_residual, checkpointing
        alibi_slopes = torch.tensor(get_alibi_slopes(num_heads), device=device) if use_alibi else None
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(
                rotary_emb_dim,
                base=rotary_emb_base,
                scale_base=rotary_emb_scale_base,
                interleaved=rotary_emb_interleaved,
                device=device,
            )
        kv_dim = 2 * self.head_dim * num_heads_kv
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        if use_flash_attn:
            # by keyword: the two modules take window_size and alibi_slopes in opposite orders
            options = dict(
                causal=causal,
                softmax_scale=softmax_scale,
                attention_dropout=dropout,
                window_size=window_size,
                alibi_slopes=alibi_slopes,
            )
            self.inner_attn = FlashSelfAttention(**options)
            self.inner_cross_attn = FlashCrossAttention(**options)
        else:
            self.inner_attn = SelfAttention(causal, softmax_scale, dropout)
            self.inner_cross_attn = CrossAttention(causal, softmax_scale, dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)
        # float32 whatever the layer's dtype: the kernels take the sinks in fp32
        self.learnable_sink = nn.Parameter(torch.zeros(num_heads, device=device)) if learnable_sink else None

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """An empty KV cache (batch_size, max_seqlen, 2, num_heads_kv, headdim) for this layer."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return torch.empty(
            batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype, device=self.out_proj.weight.device
        )

    def _update_kv_cache(self, kv, inference_params):
        if self.layer_idx is None:
            raise ArgumentError("MHA: generation with inference_params needs layer_idx in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _decode(self, q, kv, inference_params, rotate):
        """One decoding step on the kernels: append kv to the cache (rotating q and k first when
        rotate) and attend over it, in one flash_attn_with_kvcache call."""
        if self.layer_idx is None:
            raise ArgumentError("MHA: generation with inference_params needs layer_idx in the constructor")
        batch = q.shape[0]
        cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        lengths = inference_params.lengths_per_sample
        cache_seqlens = lengths[:batch] if lengths is not None else inference_params.seqlen_offset
        cos = sin = None
        if rotate:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            cos, sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        inner = self.inner_cross_attn
        return flash_attn_with_kvcache(
            q,
            cache[:, :, 0],
            cache[:, :, 1],
            kv[:, :, 0],
            kv[:, :, 1],
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=cache_seqlens,
            softmax_scale=inner.softmax_scale,
            causal=inner.causal,
            window_size=inner.window_size,
            rotary_interleaved=rotate and self.rotary_emb.interleaved,
            alibi_slopes=inner.slopes(),
            learnable_sink=self.learnable_sink,
        )

    def _attend(self, q, kv, inference_params, **kwargs):
        """q (..., nheads, headdim), kv (..., 2, nheads_kv, headdim), rotated unless the decoding
        kernel rotates them: the KV cache, then attention."""
        if inference_params is not None and inference_params.seqlen_offset > 0 and self.use_flash_attn:
            return self._decode(q, kv, inference_params, rotate=self._fused_rotary(inference_params))
        if inference_params is not None:  # prefill, or any step of the PyTorch path
            sink = {} if self.learnable_sink is None else dict(learnable_sink=self.learnable_sink)
            return self.inner_cross_attn(q, self._update_kv_cache(kv, inference_params), **sink)
        attend = self.inner_cross_attn
        if not self.use_flash_attn and not self.cross_attn:  # with padding, self-attention's causal rule
            attend = self._self_attend
        if self.checkpointing:
            return checkpoint(attend, q, kv, use_reentrant=False, **kwargs)
        return attend(q, kv, **kwargs)

    def _self_attend(self, q, kv, **kwargs):
        return self.inner_attn.attend(q, *kv.unbind(dim=2), **kwargs)

    def _fused_rotary(self, inference_params) -> bool:
        """Whether flash_attn_with_kvcache rotates q and k itself (decoding steps, rotary dim a
        multiple of 16, as flash_attn's MHA decides)."""
        return (
            self.rotary_emb_dim > 0
            and self.rotary_emb_dim % 16 == 0
            and self.use_flash_attn
            and inference_params is not None
            and inference_params.seqlen_offset > 0
        )

    def _project(self, x, x_kv, mixer_subset, inference_params):
        """(q (..., nheads, headdim), kv (..., 2, nheads_kv, headdim)), rotary applied (in place,
        on the projections' outputs) unless the decoding kernel applies it."""
        if self.cross_attn:
            q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
            kv = self.Wkv(x_kv if x_kv is not None else x).unflatten(-1, (2, self.num_heads_kv, self.head_dim))
        else:
            qkv = self.Wqkv(x)
            # one view for all heads: the rotary rotates it in place before q and kv are sliced
            qkv = qkv.unflatten(-1, (self.num_heads + 2 * self.num_heads_kv, self.head_dim))
        if self.rotary_emb_dim > 0 and not self._fused_rotary(inference_params):
            offset, max_seqlen = 0, None
            if inference_params is not None:
                lengths = inference_params.lengths_per_sample
                offset = lengths if lengths is not None else inference_params.seqlen_offset
                max_seqlen = inference_params.max_seqlen
            if self.cross_attn:
                q, kv = self.rotary_emb(q, kv, seqlen_offset=offset, max_seqlen=max_seqlen)
            else:
                qkv = self.rotary_emb(qkv, seqlen_offset=offset, max_seqlen=max_seqlen, num_heads_q=self.num_heads)
        if not self.cross_attn:
            q = qkv[..., : self.num_heads, :]
            kv = qkv[..., self.num_heads :, :].unflatten(-2, (2, self.num_heads_kv))
        return q, kv

    def forward(
        self,
        x,
        x_kv=None,
        key_padding_mask=None,
        cu_seqlens=None,
        max_seqlen=None,
        mixer_subset=None,
        inference_params=None,
        **kwargs,
    ):
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ArgumentError("MHA: cu_seqlens needs max_seqlen")
            if not self.use_flash_attn:
                raise ArgumentError("MHA: cu_seqlens (varlen input) needs use_flash_attn=True")
            if key_padding_mask is not None:
                raise ArgumentError("MHA: give key_padding_mask or cu_seqlens, not both")
            if self.rotary_emb_dim > 0:
                raise NotImplementedError("MHA: rotary embedding with cu_seqlens (varlen input)")
        if inference_params is not None and (key_padding_mask is not None or cu_seqlens is not None):
            raise ArgumentError("MHA: inference_params takes padded input without key_padding_mask or cu_seqlens")
        if (mixer_subset is not None or x_kv is not None) and not self.cross_attn:
            raise ArgumentError("MHA: x_kv and mixer_subset are for cross-attention (cross_attn=True)")
        if key_padding_mask is not None and self.use_flash_attn:
            if self.cross_attn:
                raise NotImplementedError(
                    "MHA: key_padding_mask with cross_attn and use_flash_attn=True; "
                    "pass cu_seqlens for q and cu_seqlens_k for the keys instead"
                )
            if key_padding_mask.shape != x.shape[:2] or key_padding_mask.dtype != torch.bool:
                raise ArgumentError(
                    f"MHA: key_padding_mask must be bool of shape {tuple(x.shape[:2])}, got "
                    f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                )
        if self.learnable_sink is not None:
            kwargs = dict(learnable_sink=self.learnable_sink, **kwargs)
        q, kv = self._project(x, x_kv, mixer_subset, inference_params)
        if key_padding_mask is not None and self.use_flash_attn:
            # drop the padded tokens, attend varlen, pad again (padded queries' rows come back 0)
            q_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, key_padding_mask)
            kv_unpad = index_first_axis(kv.reshape(-1, *kv.shape[2:]), indices)
            context = self.inner_cross_attn(q_unpad, kv_unpad, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
            context = pad_input(context, indices, *x.shape[:2])
        else:
            if cu_seqlens is not None:
                kwargs = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
            elif key_padding_mask is not None:
                kwargs = dict(key_padding_mask=key_padding_mask, **kwargs)
            context = self._attend(q, kv, inference_params, **kwargs)
        out = self.out_proj(context.flatten(-2))
        return (out, x) if self.return_residual else out


__all__ = ["FlashSelfAttention", "FlashCrossAttention", "SelfAttention", "CrossAttention", "MHA", "get_alibi_slopes"]
