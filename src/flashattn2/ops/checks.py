"""Argument validation shared by the public entry points: every error names the argument."""
from __future__ import annotations

import torch

from . import _runtime

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; flashattn2 supports float16, bfloat16 and float32")


def check_qkv(q, k, v) -> None:
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim)."""
    _tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _tensor("k", k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    _tensor("v", v, 4, "(batch, seqlen_k, nheads_k, headdim)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must have one dtype: q is {q.dtype}, {name} is {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q, k and v must be on one device: q is on {q.device}, {name} on {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch, seqlen_q, nheads, head_dim = q.shape
    batch_k, seqlen_k, nheads_k, head_dim_k = k.shape
    if batch_k != batch:
        raise ValueError(f"batch size of k/v ({batch_k}) differs from q's ({batch})")
    if head_dim_k != head_dim:
        raise ValueError(f"headdim of k/v ({head_dim_k}) differs from q's ({head_dim})")
    if head_dim < 1 or seqlen_q < 1 or seqlen_k < 1 or nheads < 1 or nheads_k < 1:
        raise ValueError(f"seqlens, nheads and headdim must be >= 1: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if nheads % nheads_k:
        raise ValueError(f"GQA: nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k})")
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(f"headdim {head_dim} > {MAX_HEAD_DIM} is not supported")
    check_device(q.device, "q")


def check_device(device: torch.device, name: str) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu":
        if not _runtime.interpreted():
            raise ValueError(
                f"{name} is a CPU tensor: flashattn2 runs on CUDA GPUs, or on the CPU through Triton's "
                "interpreter when TRITON_INTERPRET=1 is set in the environment before Python starts")
        return
    raise ValueError(f"{name} is on {device}; flashattn2 supports CUDA devices (and the CPU interpreter)")


def check_options(dropout_p, softmax_scale, window_size, softcap) -> None:
    """Validate the options, and refuse those not implemented yet rather than ignore them."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None and not softmax_scale >= 0:
        raise NotImplementedError(f"softmax_scale must be >= 0 (got {softmax_scale})")
    window = tuple(window_size)
    if len(window) != 2 or any(int(w) != w or w < -1 for w in window):
        raise ValueError(f"window_size must be (left, right) with integers >= -1, got {window_size}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 is not implemented yet in flashattn2")


def check_alibi(alibi_slopes, q) -> None:
    """alibi_slopes: None, or float32 (nheads,) or (batch, nheads) on q's device."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    batch, nheads = q.shape[0], q.shape[-2]
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                         f"({batch}, {nheads}), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")


def check_packed(name: str, t, count: int) -> None:
    """qkv (batch, seqlen, 3, nheads, headdim) or kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    layout = f"(batch, seqlen, {count}, nheads, headdim)"
    _tensor(name, t, 5, layout)
    if t.shape[2] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
