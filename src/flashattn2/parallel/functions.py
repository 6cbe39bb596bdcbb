"""The public functions: ring-flash-attention's names and argument order, on flashattn2's kernels.

Each takes the rank's shards (layout.py) and returns the rank's shard of flash_attn_func's output over the
whole sequence; with return_attn_probs also the global logsumexp's shard (and None for S_dmask). With a
SimulatedGroup every argument and result has a leading rank dimension.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import api
from ..errors import ArgumentError, ArgumentTypeError
from ..ops.run import call as calls
from ..ops.request import checks
from . import ring, ulysses
from .comm import Simulated, communicator
from .layout import num_chunks
from .plan import Sharding


class ParallelRequest(NamedTuple):
    """One call of a public function here, its arguments by name in the signatures' order (the dense functions'
    cu_seqlens and max_seqlen None; tests/test_parallel.py holds each signature to these fields)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window_size: tuple
    alibi_slopes: torch.Tensor | None
    deterministic: bool
    return_attn_probs: bool
    group: object
    softcap: float


def _per_rank(comm, name: str, t, dims: int):
    """t with the leading rank dimension the algorithms take."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(comm, Simulated):
        if t.dim() != dims + 1 or t.shape[0] != comm.world:
            raise ArgumentError(
                f"{name}: with a SimulatedGroup of {comm.world} ranks, {name} holds every rank's shard: "
                f"({comm.world}, ...) with {dims + 1} dimensions, got {tuple(t.shape)}"
            )
        return t
    return t[None]


def _result(comm, out, lse, return_attn_probs):
    if not isinstance(comm, Simulated):
        out, lse = out[0], lse[0]
    return (out, lse, None) if return_attn_probs else out


def _check(r: ParallelRequest, q, k, v, varlen: bool):
    """r's arguments checked, q, k and v as the rank's shards with their leading rank dimension (_per_rank)."""
    checks.check_qkv(q[0], k[0], v[0], varlen=varlen)
    checks.check_options(r.dropout_p, r.softmax_scale, r.window_size, r.softcap)
    if not isinstance(r.deterministic, bool):
        raise ArgumentTypeError(f"deterministic must be a bool, got {type(r.deterministic).__name__}")
    seq = 1 if varlen else 2
    if k.shape[seq] != q.shape[seq]:
        raise ArgumentError(
            f"q and k/v must be shards of one sequence (self-attention): {q.shape[seq]} query and "
            f"{k.shape[seq]} key tokens on the rank"
        )


def _global_cu(cu_seqlens, max_seqlen, total: int) -> tuple[int, ...]:
    """The packed batch's documents, read on the host (a CPU tensor costs no device sync)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ArgumentTypeError("cu_seqlens must be an int32 tensor (batch + 1,) of the global packed batch")
    cu = tuple(cu_seqlens.tolist())
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ArgumentError(f"cu_seqlens must start at 0 and not decrease, got {list(cu)[:8]}...")
    if cu[-1] != total:
        raise ArgumentError(
            f"cu_seqlens must describe the global packed batch, every rank's tokens: cu_seqlens[-1] must be "
            f"world_size * q.shape[0] = {total}, got {cu[-1]} (ring-flash-attention takes each rank's own "
            "cu_seqlens; here they are the global ones, and padding is a document of its own)"
        )
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if int(max_seqlen) < longest:
        raise ArgumentError(f"max_seqlen ({int(max_seqlen)}) is below the longest document ({longest})")
    return cu


def _shards(r: ParallelRequest):
    """(comm, varlen, q, k, v): the group's communicator, and r's q, k, v with the leading rank dimension, checked
    with r's other arguments."""
    comm = communicator(r.group)
    varlen = r.cu_seqlens is not None
    dims = 3 if varlen else 4
    q, k, v = (_per_rank(comm, name, t, dims) for name, t in (("q", r.q), ("k", r.k), ("v", r.v)))
    _check(r, q, k, v, varlen)
    return comm, varlen, q, k, v


def _ring(layout: str, r: ParallelRequest):
    comm, varlen, q, k, v = _shards(r)
    cu_seqlens, max_seqlen, softmax_scale, window_size = r.cu_seqlens, r.max_seqlen, r.softmax_scale, r.window_size
    if r.dropout_p > 0:
        raise NotImplementedError(
            "dropout_p > 0 is not supported by the ring (ulysses_flash_attn_func supports it); pass dropout_p=0.0"
        )
    if r.alibi_slopes is not None:
        raise NotImplementedError(
            "alibi_slopes is not supported by the ring: the kernels take ALiBi relative to each block's own "
            "corner; ulysses_flash_attn_func supports it"
        )
    seq = 1 if varlen else 2
    local = q.shape[seq]
    n = num_chunks(comm.world, layout) // comm.world
    if local % n:
        raise ArgumentError(f"the {layout} layout holds {n} equal chunks per rank: {local} tokens do not divide")
    cu = _global_cu(cu_seqlens, max_seqlen, comm.world * local) if varlen else None
    sharding = Sharding(comm.world, layout, comm.world * local, cu)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    window = calls.window_edges(window_size, int(max_seqlen) if varlen else comm.world * local)  # of the whole sequence
    options = ring.RingOptions(
        softmax_scale=scale,
        causal=bool(r.causal),
        window=window,
        softcap=float(r.softcap),
        deterministic=r.deterministic,
    )
    out, lse = ring.RingAttention.apply(q, k, v, ring.Ring(comm=comm, sharding=sharding, options=options))
    return _result(comm, out, lse, r.return_attn_probs)


def ring_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """flash_attn_func over a sequence sharded across the ranks of `group` in the contiguous layout.

    Arguments:
        q: (batch, seqlen_local, nheads, headdim), the rank's shard (flashattn2.parallel.shard).
        k, v: (batch, seqlen_local, nheads_k, headdim / headdim_v), shards of the same sequence.
        dropout_p: 0.0 (the ring raises NotImplementedError otherwise).
        softmax_scale, causal, window_size, softcap, deterministic: as flash_attn_func, over the global sequence.
        alibi_slopes: None (NotImplementedError otherwise; Ulysses takes them).
        return_attn_probs: also return the global logsumexp's shard (batch, nheads, seqlen_local) and None.
        group: a torch.distributed process group (None: the world), or a SimulatedGroup.
    Returns:
        out (batch, seqlen_local, nheads, headdim_v), or (out, softmax_lse, None).
    """
    r = ParallelRequest(
        q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ring("contiguous", r)


def zigzag_ring_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """ring_flash_attn_func on shards in the zigzag layout (rank r holds chunks r and 2 * world - 1 - r of
    2 * world): under a causal mask every rank does the same work at every step."""
    r = ParallelRequest(
        q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ring("zigzag", r)


def ring_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """flash_attn_varlen_func (self-attention) over a packed batch sharded across the ranks as one stream of
    tokens (contiguous layout on dim 0; a document may span ranks).

    Arguments:
        q: (total_local, nheads, headdim), k/v (total_local, nheads_k, headdim): the rank's shards.
        cu_seqlens: int32 (batch + 1,) of the global packed batch; cu_seqlens[-1] = world * total_local. Read on
            the host once a call (a CPU tensor costs no device sync).
        max_seqlen: the longest document (a bound: each block's own is computed).
        Other arguments as ring_flash_attn_func.
    Returns:
        out (total_local, nheads, headdim_v), or with return_attn_probs (out, softmax_lse (nheads, total_local),
        None).
    """
    r = ParallelRequest(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ring("contiguous", r)


def zigzag_ring_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """ring_flash_attn_varlen_func on the packed stream in the zigzag layout."""
    r = ParallelRequest(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ring("zigzag", r)


def _ulysses(r: ParallelRequest):
    comm, varlen, q, k, v = _shards(r)
    alibi_slopes, max_seqlen = r.alibi_slopes, r.max_seqlen
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    w = comm.world
    if nheads % w or (nheads_k % w and w % nheads_k):
        raise NotImplementedError(
            f"Ulysses splits the heads over the {w} ranks: nheads ({nheads}) must be a multiple of the world size, "
            f"and nheads_k ({nheads_k}) a multiple or a divisor of it"
        )
    if alibi_slopes is not None:
        checks.check_alibi(alibi_slopes, q[0], 1 if varlen else q.shape[1])
    if varlen:
        cu = _global_cu(r.cu_seqlens, max_seqlen, w * q.shape[1])
        cu_device = torch.tensor(cu, dtype=torch.int32, device=q.device)
        q, k, v = (t[:, None] for t in (q, k, v))  # one batch row: the packed stream

    def attend(rank, qr, kr, vr, slopes):
        kwargs = dict(
            dropout_p=r.dropout_p,
            softmax_scale=r.softmax_scale,
            causal=r.causal,
            window_size=r.window_size,
            softcap=r.softcap,
            alibi_slopes=slopes,
            deterministic=r.deterministic,
            return_attn_probs=True,
        )
        if not varlen:
            out, lse, _ = api.flash_attn_func(qr, kr, vr, **kwargs)
            return out, lse
        out, lse, _ = api.flash_attn_varlen_func(
            qr[0], kr[0], vr[0], cu_device, cu_device, max_seqlen, max_seqlen, **kwargs
        )
        return out[None], lse[None]

    out, lse = ulysses.attention(comm, q, k, v, attend, alibi_slopes)
    if varlen:
        out, lse = out[:, 0], lse[:, 0]
    return _result(comm, out, lse, r.return_attn_probs)


def ulysses_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """flash_attn_func over a sequence sharded in the contiguous layout, by Ulysses' all-to-all: each rank
    attends over the whole sequence for nheads / world of the heads. Every flash_attn_func option: dropout
    (each rank draws its own seed), ALiBi ((nheads,) or (batch, nheads), the global heads), windows, softcap.
    nheads must be a multiple of the world size; nheads_k a multiple or a divisor of it.
    Shapes and results as ring_flash_attn_func."""
    r = ParallelRequest(
        q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ulysses(r)


def ulysses_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    group=None,
    *,
    softcap=0.0,
):
    """ulysses_flash_attn_func on a packed batch sharded as one stream (contiguous layout on dim 0), with the
    global cu_seqlens as ring_flash_attn_varlen_func takes them."""
    r = ParallelRequest(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, softcap,
    )  # fmt: skip
    return _ulysses(r)


def _unpack_kv(kv):
    return kv.unbind(dim=-3)


def ring_flash_attn_kvpacked_func(q, kv, *args, **kwargs):
    """ring_flash_attn_func with kv (batch, seqlen_local, 2, nheads_k, headdim)."""
    return ring_flash_attn_func(q, *_unpack_kv(kv), *args, **kwargs)


def ring_flash_attn_qkvpacked_func(qkv, *args, **kwargs):
    """ring_flash_attn_func with qkv (batch, seqlen_local, 3, nheads, headdim)."""
    return ring_flash_attn_func(*qkv.unbind(dim=-3), *args, **kwargs)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, *args, **kwargs):
    """zigzag_ring_flash_attn_func with kv (batch, seqlen_local, 2, nheads_k, headdim)."""
    return zigzag_ring_flash_attn_func(q, *_unpack_kv(kv), *args, **kwargs)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, *args, **kwargs):
    """zigzag_ring_flash_attn_func with qkv (batch, seqlen_local, 3, nheads, headdim)."""
    return zigzag_ring_flash_attn_func(*qkv.unbind(dim=-3), *args, **kwargs)
