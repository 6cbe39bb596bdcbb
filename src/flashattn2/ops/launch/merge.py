"""Merging attention computed over disjoint key sets by logsumexp (kernels/merge.py): the partial results of
a ring (flashattn2.parallel) add up to the attention over all the keys, in fp32."""

from __future__ import annotations

import torch
import triton

from .. import _runtime
from ..request import checks
from . import launcher

# rows x head-dim elements a program merges: 8K fp32 elements, 32 KiB of accumulator per program
_ELEMENTS = 8192


def merge_(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor, first: bool) -> None:
    """Merge a block's result into the running one, in place.

    acc: float32 (batch, seqlen, nheads, headdim) or (seqlen, nheads, headdim), the running output
        (normalized); lse: float32 (batch, nheads, seqlen) or (nheads, seqlen), its logsumexp. Any
        strides with the last dimension contiguous (row slices of larger tensors).
    out, out_lse: the block's output (any float dtype) and logsumexp, in the same layouts.
    first: acc and lse hold nothing yet: the block is copied (no read of acc / lse).
    """
    checks.check_device(acc.device, "acc")
    if acc.dim() == 3:
        acc, lse, out, out_lse = acc[None], lse[None], out[None], out_lse[None]
    batch, seqlen, nheads, head_dim = acc.shape
    if seqlen == 0 or batch == 0:
        return
    for name, t in (("acc", acc), ("lse", lse), ("out", out), ("out_lse", out_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"merge_: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    block_d = triton.next_power_of_2(head_dim)
    block_s = max(16, min(128, _ELEMENTS // block_d))
    grid = (triton.cdiv(seqlen, block_s), nheads, batch)
    with _runtime.device_of(acc):
        launcher.launch(
            _runtime.kernels().merge.merge_kernel,
            grid,
            acc,
            lse,
            out,
            out_lse,
            acc.stride()[:3],
            lse.stride()[:2],
            out.stride()[:3],
            out_lse.stride()[:2],
            seqlen,
            head_dim,
            FIRST=first,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
        )
