"""MHA's inner attention over a sequence sharded across a process group (context parallelism)."""

from __future__ import annotations

from torch import nn

from ..errors import ArgumentError
from . import functions

ALGORITHMS = {
    "zigzag": (functions.zigzag_ring_flash_attn_func, "zigzag"),
    "ring": (functions.ring_flash_attn_func, "contiguous"),
    "ulysses": (functions.ulysses_flash_attn_func, "contiguous"),
}


class ContextParallelAttention(nn.Module):
    """FlashCrossAttention's forward(q, kv, causal=None) on each rank's shard of the sequence: swap it in for an
    MHA's inner_cross_attn (flashattn2.modules.mha) and feed every rank its shard (flashattn2.parallel.shard with
    `self.layout`, positions too).

    ContextParallelAttention(causal=False, softmax_scale=None, window_size=(-1, -1), deterministic=False,
                             algorithm="zigzag", group=None)
    forward(q, kv, causal=None): q (batch, seqlen_local, nheads, headdim), kv (batch, seqlen_local, 2, nheads_k,
        headdim); returns (batch, seqlen_local, nheads, headdim). algorithm: "zigzag", "ring" or "ulysses"; group: a
        torch.distributed process group (None: the world) or a SimulatedGroup.
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        window_size=(-1, -1),
        deterministic=False,
        algorithm="zigzag",
        group=None,
    ):
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise ArgumentError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
        self.causal, self.softmax_scale, self.window_size = causal, softmax_scale, tuple(window_size)
        self.deterministic, self.algorithm, self.group = deterministic, algorithm, group

    @property
    def layout(self) -> str:
        """The layout the inputs' shards must be in."""
        return ALGORITHMS[self.algorithm][1]

    def forward(self, q, kv, causal=None, **kwargs):
        if kwargs:
            raise NotImplementedError(f"ContextParallelAttention: {sorted(kwargs)} (padding or varlen) not supported")
        func = ALGORITHMS[self.algorithm][0]
        k, v = kv.unbind(dim=-3)
        return func(
            q,
            k,
            v,
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size,
            deterministic=self.deterministic,
            group=self.group,
        )
