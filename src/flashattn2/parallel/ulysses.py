"""Ulysses (DeepSpeed-Ulysses): an all-to-all trades each rank's sequence shard of every head for the whole
sequence of its group of heads; attention runs on that (any flash_attn option: every key is there), and a
second all-to-all trades back. Differentiable: each all-to-all's gradient is the opposite one.

Tensors carry a leading dimension of the ranks this process computes (comm.py). The layout is contiguous.
"""

from __future__ import annotations

import torch


def _seq_to_heads(comm, x: torch.Tensor) -> torch.Tensor:
    """(ranks, batch, s, nheads, *rest) sequence shards -> (ranks, batch, world * s, nheads / world, *rest)."""
    ranks, batch, s, heads, *rest = x.shape
    w = comm.world
    pieces = x.reshape(ranks, batch, s, w, heads // w, *rest).movedim(3, 1)  # (ranks, world, batch, s, h/w, ...)
    got = comm.all_to_all(pieces.contiguous())  # piece p: rank p's sequence shard of our heads
    return got.movedim(1, 2).reshape(ranks, batch, w * s, heads // w, *rest)


def _heads_to_seq(comm, x: torch.Tensor) -> torch.Tensor:
    """_seq_to_heads' inverse: (ranks, batch, world * s, h, *rest) -> (ranks, batch, s, world * h, *rest)."""
    ranks, batch, seq, heads, *rest = x.shape
    w = comm.world
    pieces = x.reshape(ranks, batch, w, seq // w, heads, *rest).movedim(2, 1)  # (ranks, world, batch, s, h, ...)
    got = comm.all_to_all(pieces.contiguous())  # piece p: our sequence shard of rank p's heads
    return got.movedim(1, 3).reshape(ranks, batch, seq // w, w * heads, *rest)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _seq_to_heads(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(ctx.comm, grad.contiguous()), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _heads_to_seq(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(ctx.comm, grad.contiguous()), None


def attention(comm, q, k, v, attend, alibi_slopes=None):
    """q (ranks, batch, s, nheads, d), k/v (ranks, batch, s, nheads_k, d): the sequence shards.
    attend(rank, q, k, v, alibi_slopes) runs attention on one rank's heads over the whole sequence and returns
    (out, lse (batch, heads, seqlen)). nheads_k may be smaller than the world when it divides it: each K/V head
    then goes to the ranks of its query heads (its gradient summed back). Returns (out, lse) in the shards'
    layout: (ranks, batch, s, nheads, dv), (ranks, batch, nheads, s)."""
    w = comm.world
    nheads_k = k.shape[-2]
    if nheads_k % w:
        k, v = (t.repeat_interleave(w // nheads_k, dim=-2) for t in (k, v))
    qh, kh, vh = (SeqToHeads.apply(t, comm) for t in (q, k, v))
    outs, lses = [], []
    for i, rank in enumerate(comm.ranks):
        slopes = None
        if alibi_slopes is not None:
            group = alibi_slopes.shape[-1] // w
            slopes = alibi_slopes[..., rank * group : (rank + 1) * group]
        out, lse = attend(rank, qh[i], kh[i], vh[i], slopes)
        outs.append(out)
        lses.append(lse)
    out = HeadsToSeq.apply(torch.stack(outs), comm)
    # lse (batch, heads, seqlen) travels as (batch, seqlen, heads, 1)
    lse = HeadsToSeq.apply(torch.stack(lses).transpose(-1, -2).unsqueeze(-1), comm)
    return out, lse.squeeze(-1).transpose(-1, -2)
