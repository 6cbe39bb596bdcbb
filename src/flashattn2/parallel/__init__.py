"""Context parallelism: one sequence sharded across the ranks of a torch.distributed process group.

- `ring_flash_attn_func` / `zigzag_ring_flash_attn_func` (and `_varlen_`, `_kvpacked_`, `_qkvpacked_` forms):
  the keys and values go round a ring of the ranks while each computes its blocks; partial outputs merge by
  logsumexp in fp32. Names and argument order are ring-flash-attention's.
- `ulysses_flash_attn_func` (and `_varlen_`): an all-to-all from sequence shards to head groups and back.
- `shard`, `unshard`, `gather`: the layouts (`contiguous`, `zigzag`) on a dense or a packed sequence axis.
- `ContextParallelAttention`: an MHA's inner attention on shards (models and the GPT example).
- `SimulatedGroup(n)`: every rank in this process (a leading rank dimension), the communication by copies.

NCCL on GPUs, gloo on the CPU (through Triton's interpreter): torch.distributed's own transport.
"""

from .comm import SimulatedGroup
from .functions import (
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ulysses_flash_attn_func,
    ulysses_flash_attn_varlen_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
)
from .layout import LAYOUTS, gather, shard, unshard
from .module import ContextParallelAttention

__all__ = [
    "ContextParallelAttention",
    "LAYOUTS",
    "SimulatedGroup",
    "gather",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "shard",
    "ulysses_flash_attn_func",
    "ulysses_flash_attn_varlen_func",
    "unshard",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
]
