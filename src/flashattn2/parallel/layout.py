"""Where each rank's tokens come from: the sequence axis cut into equal chunks.

- `contiguous`: `world` chunks, rank r holds chunk r (the ring and Ulysses).
- `zigzag`: `2 * world` chunks, rank r holds chunks r and 2 * world - 1 - r, in that order (the ring, balanced
  under a causal mask: every rank has as many early as late queries).

The sequence axis is dim 1 of dense (batch, seqlen, ...) tensors and dim 0 of packed varlen (total, ...) ones:
a packed batch is cut as one stream of tokens, whatever its documents (a document may span ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ArgumentError

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def chunks_of(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The chunks rank holds, in the order its shard concatenates them."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def _check_world(world_size: int, rank: int | None = None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ArgumentError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """rank's shard of x along its sequence axis `dim` (1 for (batch, seqlen, ...), 0 for packed (total, ...)).

    x.shape[dim] must be a multiple of world_size (contiguous) or 2 * world_size (zigzag). The contiguous shard is a
    view; the zigzag one a new tensor. Differentiable.
    """
    check_layout(layout)
    _check_world(world_size, rank)
    n = num_chunks(world_size, layout)
    if x.shape[dim] % n:
        raise ArgumentError(
            f"shard: the sequence axis (dim {dim}, length {x.shape[dim]}) must be a multiple of {n} "
            f"for the {layout} layout on {world_size} ranks"
        )
    size = x.shape[dim] // n
    parts = [x.narrow(dim, c * size, size) for c in chunks_of(rank, world_size, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard, in rank order: shard's inverse. Differentiable."""
    check_layout(layout)
    world_size = len(shards)
    _check_world(world_size)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    chunks: list[torch.Tensor | None] = [None] * (2 * world_size)
    for rank, s in enumerate(shards):
        if s.shape[dim] % 2:
            raise ArgumentError(f"unshard: a zigzag shard has two equal chunks, got length {s.shape[dim]}")
        for c, part in zip(chunks_of(rank, world_size, layout), s.chunk(2, dim)):
            chunks[c] = part
    return torch.cat(chunks, dim)


def gather(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence on every rank from each rank's shard x (torch.distributed all_gather; not
    differentiable). With a SimulatedGroup, x holds every rank's shard along a leading dimension."""
    from .comm import SimulatedGroup

    if isinstance(group, SimulatedGroup):
        return unshard(list(x.unbind(0)), layout, dim)
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard(parts, layout, dim)
