"""The implementations measured, each given inputs in its own native layout.

flashattn2 takes (batch, seqlen, nheads, headdim); SDPA and the naive version take
(batch, nheads, seqlen, headdim). Each provider returns a function computing the output.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

import flashattn2


def _naive(q, k, v, causal):
    """The FlashAttention paper's "standard attention": matmul, softmax in fp32, matmul (K/V
    heads repeated for GQA)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _flashattn2(q, k, v, causal):
    return flashattn2.flash_attn_func(q, k, v, causal=causal)


def providers() -> dict[str, tuple[str, callable]]:
    """name -> (layout, fn(q, k, v, causal)); layout is "bshd" or "bhsd"."""
    from torch.nn.attention import SDPBackend

    return {
        "flashattn2": ("bshd", _flashattn2),
        "sdpa_flash": ("bhsd", _sdpa(SDPBackend.FLASH_ATTENTION)),
        "sdpa_cudnn": ("bhsd", _sdpa(SDPBackend.CUDNN_ATTENTION)),
        "sdpa_efficient": ("bhsd", _sdpa(SDPBackend.EFFICIENT_ATTENTION)),
        "naive": ("bhsd", _naive),
    }


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode) -> float:
    """FLOPs as the FlashAttention-2 paper counts them: 4·b·h·n²·d forward, halved when causal
    (for seqlen_q = seqlen_k), 2.5x that for the backward, 3.5x for forward + backward."""
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
