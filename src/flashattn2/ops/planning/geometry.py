"""Where a call's rows live: dense (batch, seqlen, nheads, headdim) or varlen (total, nheads, headdim) with
cu_seqlens; the strides and lengths the kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import seqlens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_d(head_dim: int) -> int:
    """The kernels' head-dim block: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def column_parts(head_dim: int) -> tuple[int, int]:
    """A head dim as the kernels' column blocks (tl.arange and Gluon's tiles are powers of two): (head_dim's block,
    0), unless head_dim is two powers of two, the second at least 16 -- DeepSeek-V3's 192 = 128 + 64, the MLA
    decode's 576 = 512 + 64 -- which are two blocks, (the largest power of two below it, the rest), computed
    without padding (192 padded would run as 256, 576 as 1024)."""
    hi = 1 << (head_dim.bit_length() - 1)
    lo = head_dim - hi
    if lo >= 16 and lo & (lo - 1) == 0:
        return hi, lo
    return block_d(head_dim), 0


@dataclass(frozen=True)
class Varlen:
    """Sequences packed along the first dimension: q (total_q, nheads, headdim) holds sequence b
    in rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (int32, (batch + 1,)); likewise k and v.
    known_*/order_*: what checks remembers of a cu_seqlens whose values were checked ((last
    value, longest sequence) and the sequences longest first), or None; `of` looks them up."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    known_q: tuple[int, int] | None = None
    known_k: tuple[int, int] | None = None
    order_q: torch.Tensor | None = None
    order_k: torch.Tensor | None = None

    @staticmethod
    def of(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> "Varlen":
        known_q, order_q = seqlens.remembered(cu_seqlens_q)
        known_k, order_k = seqlens.remembered(cu_seqlens_k)
        return Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, known_q, known_k, order_q, order_k)


@dataclass(frozen=True)
class Geometry:
    batch: int
    nheads: int
    nheads_k: int
    head_dim: int  # q's and k's
    max_seqlen_q: int
    max_seqlen_k: int
    varlen: Varlen | None
    head_dim_v: int  # v's and the output's (head_dim unless the call has a value head dim of its own)

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None, v: torch.Tensor | None = None) -> "Geometry":
        head_dim = q.shape[-1]
        head_dim_v = head_dim if v is None else v.shape[-1]
        if varlen is None:
            batch, seqlen_q, nheads, _ = q.shape
            return Geometry(batch, nheads, k.shape[2], head_dim, seqlen_q, k.shape[1], None, head_dim_v)
        return Geometry(
            varlen.cu_seqlens_q.shape[0] - 1,
            q.shape[1],
            k.shape[1],
            head_dim,
            varlen.max_seqlen_q,
            varlen.max_seqlen_k,
            varlen,
            head_dim_v,
        )

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, seqlen, head) strides in elements; varlen has no batch stride."""
        s = t.stride()  # one call, not three: host time
        if self.varlen is not None:
            return 0, s[0], s[1]
        return s[0], s[1], s[2]

    def lse_shape(self, q: torch.Tensor) -> tuple[int, ...]:
        # flash_attn's layouts: (batch, nheads, seqlen_q), or (nheads, total_q) in varlen
        return (self.nheads, q.shape[0]) if self.varlen is not None else (self.batch, self.nheads, q.shape[1])

    def lse_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        s = lse.stride()
        return (0, s[0]) if self.varlen is not None else (s[0], s[1])

    def cu_seqlens(self, like: torch.Tensor):
        if self.varlen is None:
            return like, like  # never read: IS_VARLEN is off
        return self.varlen.cu_seqlens_q, self.varlen.cu_seqlens_k

    def order(self, side: str, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(SeqOrder, SORTED): the sequences longest first by their "q" or "k" lengths, known once
        that cu_seqlens was checked (Varlen.order_*); the grid's slots follow that order.
        Otherwise `like` and False (never read)."""
        order = None if self.varlen is None else getattr(self.varlen, "order_" + side)
        return (like, False) if order is None else (order, True)
