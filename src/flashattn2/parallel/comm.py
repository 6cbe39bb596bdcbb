"""The communication the algorithms need, on torch.distributed, or simulated in one process.

The algorithms see every tensor with a leading dimension of the ranks computed in this process: one (this
process's rank) under torch.distributed, all of them under a SimulatedGroup. Two operations:

- `shift`: each rank sends tensors to the next rank of the ring and receives the previous rank's. Under
  torch.distributed the sends and receives are one batch_isend_irecv, which runs on the process group's own
  stream (NCCL's) while the caller's stream computes; `wait` orders the caller's stream after them without
  blocking the host (gloo, on the CPU, blocks).
- `all_to_all`: piece p of each rank goes to rank p (Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ArgumentError


@dataclass(frozen=True)
class SimulatedGroup:
    """Every rank of a world of `world_size` in this process, their communication replaced by copies: the
    parallel functions then take and return every rank's shard stacked along a new leading dimension
    (world_size, ...) and run the same algorithm as the ranks of a process group would. For tests and for
    measuring the kernels of a parallel run on one GPU."""

    world_size: int

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ArgumentError(f"SimulatedGroup: world_size must be an int >= 1, got {self.world_size!r}")


class Simulated:
    def __init__(self, group: SimulatedGroup):
        self.world = group.world_size
        self.ranks = tuple(range(self.world))

    def shift(self, tensors):
        return [torch.roll(t, 1, dims=0) for t in tensors]  # rank i receives rank i - 1's: a copy

    def wait(self, pending):
        return pending

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x (ranks, world, ...): piece p of rank i; returns (ranks, world, ...): piece i of rank p."""
        return x.transpose(0, 1).contiguous()


class Distributed:
    def __init__(self, group):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "flashattn2.parallel: torch.distributed is not initialized: call torch.distributed."
                "init_process_group first, or pass group=flashattn2.parallel.SimulatedGroup(n) to run n ranks here"
            )
        self._dist = dist
        self.group = dist.group.WORLD if group is None else group
        self.world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        self.ranks = (rank,)
        self._next = dist.get_global_rank(self.group, (rank + 1) % self.world)
        self._prev = dist.get_global_rank(self.group, (rank - 1) % self.world)

    def shift(self, tensors):
        dist = self._dist
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group) for t in recvs]
        return dist.batch_isend_irecv(ops), recvs, sends

    def wait(self, pending):
        requests, recvs, _sends = pending  # the sends stay referenced until their requests complete
        for request in requests:
            request.wait()
        return recvs

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x[0])
        self._dist.all_to_all_single(out, x[0].contiguous(), group=self.group)
        return out[None]


def communicator(group):
    """The communicator of a `group` argument: a SimulatedGroup, a torch.distributed group, or None (the world)."""
    if isinstance(group, SimulatedGroup):
        return Simulated(group)
    return Distributed(group)
