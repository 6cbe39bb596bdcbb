"""Rotary position embedding in plain PyTorch (the oracle for layers.rotary and the KV cache)."""

from __future__ import annotations

import torch


def rotary_ref(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None, conjugate=False):
    """x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (batch + 1,);
    cos/sin (seqlen_ro, rotary_dim / 2). Token i of sequence b sits at position
    i + seqlen_offsets[b] (an int offset is shared); its first rotary_dim features are rotated by
    the angle whose cos/sin are row `position` (GPT-NeoX halves, or GPT-J pairs when interleaved);
    positions past seqlen_ro are left as they are. conjugate rotates by minus the angle (the
    backward). Computed in float32, returned in x's dtype."""
    if cu_seqlens is not None:
        rows = []
        for b, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            off = seqlen_offsets if isinstance(seqlen_offsets, int) else int(seqlen_offsets[b])
            rows.append(rotary_ref(x[None, s:e], cos, sin, interleaved, off, conjugate=conjugate)[0])
        return torch.cat(rows) if rows else x.clone()
    batch, seqlen = x.shape[:2]
    half = cos.shape[1]
    rd = 2 * half
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1).expand(batch)
    pos = offsets[:, None] + torch.arange(seqlen, device=x.device)[None, :]  # (batch, seqlen)
    inside = pos < cos.shape[0]
    idx = pos.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.float()[idx], 1.0)[:, :, None, :]  # (b, s, 1, half)
    s = torch.where(inside[..., None], sin.float()[idx], 0.0)[:, :, None, :]
    if conjugate:
        s = -s
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0:rd:2], xf[..., 1:rd:2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:rd]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot, xf[..., rd:]), dim=-1).to(x.dtype)
