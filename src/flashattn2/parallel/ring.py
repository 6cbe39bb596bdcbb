"""Ring attention: each rank keeps its queries, the keys and values go round the ring, one rank's per step.

Forward: at step t rank r holds the keys and values of rank r - t; while the next ones travel (comm.shift,
on the process group's stream), it runs its planned blocks (plan.blocks) against them and merges each
block's output into an fp32 accumulator by logsumexp (ops.launch.merge). Backward: the keys and values go round
again with an fp32 dK/dV accumulator travelling one step behind them; each step adds the blocks' gradients
computed from the global out and logsumexp (P = exp(S - LSE), D = rowsum(dO * O) - dLSE), and after the
last step one more shift brings every rank its own dK/dV. dQ stays home, in fp32.

Tensors carry a leading dimension of the ranks this process computes (comm.py): one, or every rank of a
SimulatedGroup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops import _runtime
from ..ops.run import registry
from ..ops.launch.merge import merge_
from ..ops.launch.layout import BackwardTensors
from ..ops.request.options import Options
from . import plan
from .plan import Block, Sharding


@dataclass(frozen=True)
class RingOptions:
    """flash_attn_func's options the ring serves, resolved (softmax_scale a float)."""

    softmax_scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    deterministic: bool


@dataclass(frozen=True)
class Ring:
    """One ring call: its ranks' communicator (comm.py), how the sequence is sharded over them, its options."""

    comm: object
    sharding: Sharding
    options: RingOptions


@functools.lru_cache(maxsize=1024)
def _cu_on(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _rows(t: torch.Tensor, rows: tuple[int, int], dim: int) -> torch.Tensor:
    return t.narrow(dim, rows[0], rows[1] - rows[0])


def _options(blk: Block, o: RingOptions, device) -> Options:
    """A block's flash_attn call: its own sequences (packed documents) and mask, the ring's scale and softcap."""
    cu_q = cu_k = None
    if blk.cu_q is not None:
        cu_q, cu_k = _cu_on(blk.cu_q, device), _cu_on(blk.cu_k, device)
    return Options(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=blk.max_q if cu_q is not None else 0,
        max_seqlen_k=blk.max_k if cu_q is not None else 0,
        softmax_scale=o.softmax_scale,
        causal=blk.causal,
        window_left=blk.window[0],
        window_right=blk.window[1],
        softcap=o.softcap,
    )


def _block_forward(q, k, v, blk: Block, o: RingOptions, seq: int):
    qb, kb, vb = _rows(q, blk.q_rows, seq), _rows(k, blk.k_rows, seq), _rows(v, blk.k_rows, seq)
    return registry.forward(qb, kb, vb, _options(blk, o, q.device))


def forward(ring: Ring, q, k, v):
    """q (ranks, batch, seqlen, nheads, d) or packed (ranks, total, nheads, d); k, v likewise with their heads.
    Returns (out in q's dtype, lse float32 (ranks, batch, nheads, seqlen) or (ranks, nheads, total))."""
    comm, sharding, o = ring.comm, ring.sharding, ring.options
    seq = q.dim() - 4  # the sequence axis of one rank's tensor
    acc = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.empty((*q.shape[:-3], q.shape[-2], q.shape[-3]), dtype=torch.float32, device=q.device)
    started = [False] * len(comm.ranks)
    for step in range(comm.world):
        pending = comm.shift([k, v]) if step + 1 < comm.world else None
        for i, rank in enumerate(comm.ranks):
            for blk in plan.blocks(sharding, rank, (rank - step) % comm.world, o.causal, o.window):
                out_b, lse_b = _block_forward(q[i], k[i], v[i], blk, o, seq)
                first = not started[i] and blk.q_rows == (0, sharding.local)
                if not started[i] and not first:
                    acc[i].zero_()
                    lse[i].fill_(float("-inf"))
                started[i] = True
                merge_(_rows(acc[i], blk.q_rows, seq), _rows(lse[i], blk.q_rows, -1), out_b, lse_b, first)
        if pending is not None:
            k, v = comm.wait(pending)
    for i, done in enumerate(started):
        if not done:
            acc[i].zero_()
            lse[i].fill_(float("-inf"))
    # rows no key reached: out 0 and flash_attn's logsumexp +inf (a backward then sees P = 0)
    return acc.to(q.dtype), lse.masked_fill_(lse == float("-inf"), float("inf"))


def backward(ring: Ring, dout, dlse, q, k, v, out, lse):
    """(dq, dk, dv) in the inputs' dtypes; dlse may be None."""
    comm, sharding, o = ring.comm, ring.sharding, ring.options
    seq = q.dim() - 4
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_pending = None
    for step in range(comm.world):
        kv_pending = comm.shift([k, v]) if step + 1 < comm.world else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, rank in enumerate(comm.ranks):
            for blk in plan.blocks(sharding, rank, (rank - step) % comm.world, o.causal, o.window):
                qb, kb, vb = _rows(q[i], blk.q_rows, seq), _rows(k[i], blk.k_rows, seq), _rows(v[i], blk.k_rows, seq)
                dqb, dkb, dvb = (_runtime.empty(t.shape, t.dtype, t.device) for t in (qb, kb, vb))
                tensors = BackwardTensors(
                    _rows(dout[i], blk.q_rows, seq),
                    qb,
                    kb,
                    vb,
                    _rows(out[i], blk.q_rows, seq),
                    _rows(lse[i], blk.q_rows, -1),
                    None if dlse is None else _rows(dlse[i], blk.q_rows, -1),
                    dqb,
                    dkb,
                    dvb,
                )
                registry.backward(tensors, _options(blk, o, q.device), o.deterministic)
                _rows(dq[i], blk.q_rows, seq).add_(dqb)
                _rows(dk[i], blk.k_rows, seq).add_(dkb)
                _rows(dv[i], blk.k_rows, seq).add_(dvb)
        if dkv_pending is not None:  # the accumulator of these keys from the ranks before, one step behind
            dk_before, dv_before = comm.wait(dkv_pending)
            dk += dk_before
            dv += dv_before
        if comm.world > 1:
            dkv_pending = comm.shift([dk, dv])
        if kv_pending is not None:
            k, v = comm.wait(kv_pending)
    if dkv_pending is not None:
        dk, dv = comm.wait(dkv_pending)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        out, lse = forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(ctx.ring, dout, dlse, q, k, v, out, lse)
        return dq, dk, dv, None
