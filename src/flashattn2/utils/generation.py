"""The decoding state MHA reads (flash_attn.utils.generation.InferenceParams)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class InferenceParams:
    """KV-cache state shared by the layers of a model while it generates.

    max_seqlen / max_batch_size: the caches' size. seqlen_offset: tokens already in the caches (0:
    the next forward is the prefill). batch_size_offset: the first cache row this batch uses.
    key_value_memory_dict: layer_idx -> (max_batch_size, max_seqlen, 2, nheads_kv, headdim) cache,
    filled by the layers. lengths_per_sample: optional (batch,) int32 tokens per sequence, for
    batches whose sequences differ in length (the caller keeps it up to date).
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


__all__ = ["InferenceParams"]
