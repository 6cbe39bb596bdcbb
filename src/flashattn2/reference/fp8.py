"""float8_e4m3fn attention inputs as FA3 takes them: a tensor of e4m3 codes and a float32 descale per (batch,
kv head), the value meant being code * descale. The oracle dequantizes (exactly, in float32/64) and runs the plain
reference; `quantize` is the rounding every path uses (FA3's and flashattn2's KV-cache append: divide, saturate at
+-448, round to nearest even)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value; fn: no infinities


def _per_row(descale: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """descale (batch, nheads_k) broadcast over x: (batch, seqlen, nheads, d), or varlen (total, nheads, d) with each
    sequence's rows taking its batch row (rows past cu_seqlens[-1] take 0); head h of x's nheads (a multiple of
    nheads_k: q's) takes kv head h // (nheads // nheads_k)'s."""
    descale = descale.repeat_interleave(x.shape[-2] // descale.shape[-1], dim=-1)
    if cu_seqlens is None:
        return descale[:, None, :, None]
    lengths = cu_seqlens.diff().long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
    rows = torch.zeros(x.shape[0], *descale.shape[1:], dtype=descale.dtype, device=x.device)
    rows[: seq.shape[0]] = descale[seq]
    return rows[:, :, None]


def quantize(x: torch.Tensor, descale: torch.Tensor | None = None, cu_seqlens=None) -> torch.Tensor:
    """e4m3(x / descale), saturating at +-448 (NaN stays NaN); descale None means 1."""
    x = x.float()
    if descale is not None:
        x = x / _per_row(descale.float(), x, cu_seqlens)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(x: torch.Tensor, descale: torch.Tensor | None = None, cu_seqlens=None, dtype=torch.float64):
    """The values an e4m3 tensor and its descale stand for, in dtype (exact in float32 and float64)."""
    x = x.to(dtype)
    if descale is None:
        return x
    return x * _per_row(descale.to(dtype), x, cu_seqlens)
