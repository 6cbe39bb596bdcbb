"""Reference attention in plain PyTorch, with flash_attn's semantics (layout, bottom-right causal
alignment, GQA head mapping, empty rows giving zeros and logsumexp +inf)."""

from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: j <= i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def local_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal=False, device=None):
    """(seqlen_q, seqlen_k) bool, True where query i may see key j: with d = seqlen_k - seqlen_q,
    i + d - left <= j <= i + d + right, -1 meaning unbounded; causal sets right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def attention_ref(
    q,
    k,
    v,
    causal=False,
    softmax_scale=None,
    upcast=True,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_mask=None,
    dropout_p=0.0,
    learnable_sink=None,
    p_dtype=None,
):
    """Attention on (batch, seqlen, nheads, headdim) inputs (v's head dim may differ from q's and k's: out has
    v's); returns (out, lse).

    upcast=True computes in float32 (float64 for float32 and float64 inputs): the oracle. upcast=False does
    the same math in the input dtype, as PyTorch would: its error against the oracle is the
    yardstick of flash_attn's tolerance rule. out is returned in the input dtype when
    upcast=False, in the compute dtype otherwise; lse (batch, nheads, seqlen_q) in the compute
    dtype for upcast, float32 otherwise.

    Scores: s = q k^T * softmax_scale; with softcap, softcap * tanh(s / softcap); with
    alibi_slopes ((nheads,) or (batch, nheads)), minus slope * |i + seqlen_k - seqlen_q - j|;
    then the causal / window mask. dropout_mask ((batch, nheads, seqlen_q, seqlen_k) bool, True =
    kept) multiplies the probabilities by mask / (1 - dropout_p) before they meet v.
    learnable_sink ((nheads,)): one more logit per head in every row's softmax, dropped before v (a row
    that sees no key then has out 0 and lse the sink's logit). Differentiable: the oracle of its gradient.
    p_dtype: the FP8 forward's rounding (reference.fp8): the probabilities meet v as exp(s - rowmax) rounded to
    p_dtype (each <= 1), divided by their exact sum after.
    """
    dtype = q.dtype
    if upcast:
        compute = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    k = k.repeat_interleave(nheads // nheads_k, dim=2)
    v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(-1, nheads)[:, :, None, None].to(scores.dtype)
        dist = (
            torch.arange(seqlen_q, device=q.device)[:, None]
            + (seqlen_k - seqlen_q)
            - torch.arange(seqlen_k, device=q.device)[None, :]
        ).abs()
        scores = scores - slopes * dist.to(scores.dtype)
    if causal or tuple(window_size) != (-1, -1):
        visible = local_mask(seqlen_q, seqlen_k, window_size, causal, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(scores.dtype)[None, :, None, None].expand(batch, nheads, seqlen_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    empty = torch.isneginf(lse)
    if p_dtype is None:
        attn = torch.softmax(scores, dim=-1).masked_fill(empty[..., None], 0.0)
    else:
        p = torch.exp(scores - scores.amax(-1, keepdim=True).masked_fill(empty[..., None], 0.0))
        attn = (p.to(p_dtype).to(p.dtype) / p.sum(-1, keepdim=True)).masked_fill(empty[..., None], 0.0)
    if learnable_sink is not None:
        attn = attn[..., :-1]
    if dropout_mask is not None:
        attn = attn.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out, lse.masked_fill(empty, float("inf"))
