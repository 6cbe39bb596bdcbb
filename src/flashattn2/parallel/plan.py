"""Which attention blocks a rank computes against the keys it holds at a ring step: host-side planning,
cached per argument set.

A block is a rectangle of the rank's query rows against the visiting rank's key rows, with the causal flag,
window and (for packed documents) cu_seqlens that make one flash_attn call on it equal to the global mask's
restriction. flash_attn aligns causal and windows to the block's bottom-right corner; `band` shifts the window
by the block's global offset and trims the rows and columns the global mask leaves empty, so every block is
a plain call. Blocks the mask leaves empty are not planned.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from .layout import chunks_of, num_chunks

INF = math.inf


@dataclass(frozen=True)
class Sharding:
    """How the global sequence axis is cut: `seqlen` tokens (a dense sequence, or a packed batch with its
    documents' global `cu_seqlens`), in the layout's chunks over `world` ranks."""

    world: int
    layout: str
    seqlen: int
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def chunk(self) -> int:
        return self.seqlen // num_chunks(self.world, self.layout)

    @property
    def local(self) -> int:
        """Tokens per rank."""
        return self.chunk * len(chunks_of(0, self.world, self.layout))


@dataclass(frozen=True)
class Block:
    """Query rows [q_rows) of the rank against key rows [k_rows) of the keys it holds, as one call."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    causal: bool
    window: tuple[int, int]
    cu_q: tuple[int, ...] | None = None  # packed documents: the block's own cu_seqlens, or None (dense)
    cu_k: tuple[int, ...] | None = None

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:])) if self.cu_q else self.q_rows[1] - self.q_rows[0]

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:])) if self.cu_k else self.k_rows[1] - self.k_rows[0]


@dataclass(frozen=True)
class Band:
    """A block's rows [i0, i1) and columns [j0, j1) the mask reaches, and the flash_attn mask on them."""

    i0: int
    i1: int
    j0: int
    j1: int
    causal: bool
    window: tuple[int, int]


def band(offset: int, seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> Band | None:
    """Query i sees key j when their global positions differ by d = (j - i) - offset within the window
    [-left, right] (right <= 0 when causal), where offset = q's first position - k's first position."""
    left, right = window
    lo = -INF if left < 0 else -left
    hi = INF if right < 0 else right
    if causal:
        hi = min(hi, 0)
    a, b = lo + offset, hi + offset  # j - i in [a, b]
    i0, i1 = max(0, -b), min(seqlen_q, seqlen_k - a)
    j0, j1 = max(0, a), min(seqlen_k, seqlen_q + b)
    if not (i0 < i1 and j0 < j1):
        return None
    i0, i1, j0, j1 = int(i0), int(i1), int(j0), int(j1)
    nq, nk = i1 - i0, j1 - j0
    a, b = a - j0 + i0, b - j0 + i0  # in the trimmed block's coordinates
    corner = nk - nq  # where flash_attn puts j - i = 0 of its window: the bottom-right diagonal
    # an edge no row of the block reaches is unbounded (-1): full blocks take the unmasked kernels
    left = -1 if a <= -(nq - 1) else int(corner - a)
    right = -1 if b >= nk - 1 else int(b - corner)
    if right == 0:
        return Band(i0, i1, j0, j1, True, (left, -1))
    return Band(i0, i1, j0, j1, False, (left, right))


def _doc_bounds(cu: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    """cu_seqlens of the documents' parts within tokens [start, stop), from 0; rows past the last document are
    left out (the kernels fill them as rows of no sequence)."""
    inner = [c - start for c in cu if start < c < stop]
    end = min(cu[-1], stop) - start
    return tuple(dict.fromkeys([0, *[c for c in inner if c < end], max(end, 0)]))


def _shared_doc(cu: tuple[int, ...], first: tuple[int, int], second: tuple[int, int]) -> tuple[int, int] | None:
    """The one document with tokens in both of two disjoint token ranges, or None (documents are contiguous, so
    at most one reaches from one range into the other)."""
    later, earlier = (first, second) if first[0] > second[0] else (second, first)
    pos = later[0]
    if pos >= cu[-1]:
        return None
    d = bisect.bisect_right(cu, pos) - 1
    if cu[d] < earlier[1]:
        return cu[d], cu[d + 1]
    return None


def _chunk_pairs(sharding: Sharding, rank: int, src: int):
    """(q chunk, its first local row, k chunk, its first local row) for every chunk pair."""
    c = sharding.chunk
    for qi, qa in enumerate(chunks_of(rank, sharding.world, sharding.layout)):
        for ki, kb in enumerate(chunks_of(src, sharding.world, sharding.layout)):
            yield qa, qi * c, kb, ki * c


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Dense full blocks side by side (same key rows and adjacent query rows, or the reverse) as one call."""
    merged = True
    while merged:
        merged = False
        for x in range(len(blocks)):
            for y in range(len(blocks)):
                p, q = blocks[x], blocks[y]
                if x == y or p.cu_q is not None or q.cu_q is not None or p.causal or q.causal:
                    continue
                if p.window != (-1, -1) or q.window != (-1, -1):
                    continue
                if p.k_rows == q.k_rows and p.q_rows[1] == q.q_rows[0]:
                    joined = Block((p.q_rows[0], q.q_rows[1]), p.k_rows, False, (-1, -1))
                elif p.q_rows == q.q_rows and p.k_rows[1] == q.k_rows[0]:
                    joined = Block(p.q_rows, (p.k_rows[0], q.k_rows[1]), False, (-1, -1))
                else:
                    continue
                blocks = [b for n, b in enumerate(blocks) if n not in (x, y)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda b: (b.q_rows, b.k_rows))


@functools.lru_cache(maxsize=4096)
def blocks(sharding: Sharding, rank: int, src: int, causal: bool, window: tuple[int, int]) -> tuple[Block, ...]:
    """The calls rank makes against the keys of rank src."""
    local = sharding.local
    windowed = window != (-1, -1)
    if rank == src and not windowed:
        # the rank's own keys: its chunks are in position order, so one call over the shard is the global mask
        if sharding.cu_seqlens is None:
            return (Block((0, local), (0, local), causal, (-1, -1)),)
        cu = _local_docs(sharding, rank)
        return (Block((0, local), (0, local), causal, (-1, -1), cu, cu),) if cu[-1] > 0 else ()
    c = sharding.chunk
    out = []
    for qa, q0, kb, k0 in _chunk_pairs(sharding, rank, src):
        if sharding.cu_seqlens is None:
            b = band((qa - kb) * c, c, c, causal, window)
            if b is not None:
                out.append(Block((q0 + b.i0, q0 + b.i1), (k0 + b.j0, k0 + b.j1), b.causal, b.window))
            continue
        cu = sharding.cu_seqlens
        if qa == kb:
            docs = _doc_bounds(cu, qa * c, (qa + 1) * c)
            if docs[-1] > 0:
                out.append(Block((q0, q0 + c), (k0, k0 + c), causal, window, docs, docs))
            continue
        doc = _shared_doc(cu, (qa * c, (qa + 1) * c), (kb * c, (kb + 1) * c))
        if doc is None:
            continue
        qs, qe = max(doc[0], qa * c), min(doc[1], (qa + 1) * c)
        ks, ke = max(doc[0], kb * c), min(doc[1], (kb + 1) * c)
        b = band(qs - ks, qe - qs, ke - ks, causal, window)
        if b is None:
            continue
        nq, nk = b.i1 - b.i0, b.j1 - b.j0
        rq = q0 + qs - qa * c + b.i0
        rk = k0 + ks - kb * c + b.j0
        out.append(Block((rq, rq + nq), (rk, rk + nk), b.causal, b.window, (0, nq), (0, nk)))
    return tuple(_coalesce(out))


def _local_docs(sharding: Sharding, rank: int) -> tuple[int, ...]:
    """cu_seqlens of the rank's shard as one stream of tokens: its chunks' document parts, where a document
    runs from the end of one of its chunks into the next one joined (no token between them is on this rank, so
    the mask restricted to the shard is the mask of the joined part)."""
    c, cu = sharding.chunk, sharding.cu_seqlens
    bounds = [0]
    previous_end = None
    for n, chunk in enumerate(chunks_of(rank, sharding.world, sharding.layout)):
        part = _doc_bounds(cu, chunk * c, (chunk + 1) * c)
        base = n * c
        if previous_end is not None and bounds[-1] == base and _same_doc(cu, previous_end - 1, chunk * c):
            bounds.pop()
        bounds.extend(base + p for p in part[1:])
        if part[-1] < c:
            break  # the documents end in this chunk: the rest of the shard is rows of no sequence
        previous_end = (chunk + 1) * c
    return tuple(dict.fromkeys(bounds))


def _same_doc(cu: tuple[int, ...], first: int, second: int) -> bool:
    """Whether tokens first < second belong to one document."""
    if second >= cu[-1]:
        return False
    return cu[bisect.bisect_right(cu, second) - 1] <= first
