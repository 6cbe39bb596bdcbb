"""flash_attn_with_kvcache in plain PyTorch: append (with rotary), then attend over the cache."""

from __future__ import annotations

import torch

from .attention import attention_ref
from .rotary import rotary_ref


def kvcache_ref(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    upcast=True,
    learnable_sink=None,
):
    """Returns (out, lse, k_cache_after, v_cache_after); the caches given are not modified.

    Sequence b's keys are cache positions [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of
    cache row cache_batch_idx[b] (or of its pages block_table[b] when paged); new k/v go to
    [cache_seqlens[b], + seqlen_new). Rotary rotates the new k at positions cache_seqlens[b] + i
    and q at the same positions when causal or local, else all of q at cache_seqlens[b]."""
    batch, seqlen_q = q.shape[:2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.long)
    elif isinstance(cache_seqlens, int):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.long)
    else:
        seqlens = cache_seqlens.long().cpu()
    leftpad = torch.zeros(batch, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long().cpu()
    # flash_attn's rule: a window edge past the cache is no edge
    window_size = tuple(-1 if w >= capacity else w for w in window_size)
    local = window_size != (-1, -1)
    outs, lses = [], []
    for b in range(batch):
        if paged:
            pages = block_table[b].long()
            kb = k_cache[pages].flatten(0, 1)  # (capacity, hk, d): a copy, written back below
            vb = v_cache[pages].flatten(0, 1)
        else:
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            kb, vb = k_cache[row], v_cache[row]
        start = int(seqlens[b])
        qb = q[b : b + 1]
        if k is not None:
            kn, vn = k[b : b + 1], v[b : b + 1]
            if rotary_cos is not None:
                kn = rotary_ref(kn, rotary_cos, rotary_sin, rotary_interleaved, start)
            kb[start : start + kn.shape[1]] = kn[0]
            vb[start : start + kn.shape[1]] = vn[0]
            end = start + kn.shape[1]
            if paged:
                k_cache[pages] = kb.unflatten(0, (len(pages), -1))
                v_cache[pages] = vb.unflatten(0, (len(pages), -1))
        else:
            end = start
        if rotary_cos is not None:
            if causal or local:
                qb = rotary_ref(qb, rotary_cos, rotary_sin, rotary_interleaved, start)
            else:  # every query at position cache_seqlens[b]
                angle_cos = rotary_cos[start : start + 1].expand(seqlen_q, -1)
                angle_sin = rotary_sin[start : start + 1].expand(seqlen_q, -1)
                qb = rotary_ref(qb, angle_cos, angle_sin, rotary_interleaved, 0)
        lo = int(leftpad[b])
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        out, lse = attention_ref(
            qb,
            kb[None, lo:end],
            vb[None, lo:end],
            causal=causal,
            softmax_scale=softmax_scale,
            upcast=upcast,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            learnable_sink=learnable_sink,
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache
