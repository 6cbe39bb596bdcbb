"""Argument validation shared by the public entry points: every error names the argument."""

from __future__ import annotations

import contextvars
import os

import torch

from .. import _runtime
from .seqlens import _capturing, in_range, known, remember
from ...errors import ArgumentError, ArgumentTypeError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
E4M3 = torch.float8_e4m3fn  # FA3's FP8 type: the forward's q, k, v and the KV cache's (with float32 descales)
MAX_HEAD_DIM = 512  # q/k's and v's, each
# the most positions a sequence, a KV cache or a varlen pack may hold: the kernels compute positions in int32, and
# their sums (a row, the diagonal seqlen_k - seqlen_q, a window edge of up to seqlen_q + seqlen_k, a block) stay
# below 2**31 while every length is at most 2**29 (docs/design.md, "Index arithmetic and int32")
MAX_POSITIONS = 2**29


def check_positions(name: str, n: int) -> None:
    """n (a length of `name`) at most MAX_POSITIONS, else NotImplementedError naming it and the limit."""
    if n > MAX_POSITIONS:
        raise NotImplementedError(
            f"{name} is {n}: flashattn2's kernels index at most 2**29 = {MAX_POSITIONS} positions in a sequence, a "
            "KV cache or a varlen pack (their position arithmetic is int32)"
        )


def _tensor(name: str, t, ndim: int, layout: str, fp8: bool = False) -> None:
    """fp8: float8_e4m3fn is accepted too (FA3's FP8 inputs); another 8-bit float raises NotImplementedError naming
    it."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ArgumentError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")
    if t.dtype in DTYPES or (fp8 and t.dtype == E4M3):
        return
    if t.dtype.is_floating_point and t.dtype.itemsize == 1 and t.dtype != E4M3:
        raise NotImplementedError(f"{name} has dtype {t.dtype}: flashattn2's 8-bit float is float8_e4m3fn")
    also = ", float8_e4m3fn" if fp8 else " here"
    raise ArgumentTypeError(f"{name} has dtype {t.dtype}; flashattn2 supports float16, bfloat16, float32{also}")


def check_qkv(q, k, v, varlen: bool = False, empty_ok: bool = False, fp8: bool = False) -> None:
    """q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim), v (batch, seqlen_k,
    nheads_k, headdim_v); in varlen q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim / headdim_v).
    v's head dim may differ from q's and k's (the output has v's). empty_ok: a dense seqlen of 0 is accepted (the
    caller runs no kernel then). fp8: float8_e4m3fn accepted (the forward's FA3 inputs)."""
    ndim = 3 if varlen else 4
    prefix = "(total_q, " if varlen else "(batch, seqlen_q, "
    prefix_k = "(total_k, " if varlen else "(batch, seqlen_k, "
    _tensor("q", q, ndim, prefix + "nheads, headdim)", fp8)
    _tensor("k", k, ndim, prefix_k + "nheads_k, headdim)", fp8)
    _tensor("v", v, ndim, prefix_k + "nheads_k, headdim_v)", fp8)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ArgumentTypeError(f"q, k and v must have one dtype: q is {q.dtype}, {name} is {t.dtype}")
        if t.device != q.device:
            raise ArgumentError(f"q, k and v must be on one device: q is on {q.device}, {name} on {t.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ArgumentError(
            f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    nheads, head_dim = q.shape[-2:]
    nheads_k, head_dim_k = k.shape[-2:]
    if not varlen and k.shape[0] != q.shape[0]:
        raise ArgumentError(f"batch size of k/v ({k.shape[0]}) differs from q's ({q.shape[0]})")
    if head_dim_k != head_dim:
        raise ArgumentError(f"headdim of k ({head_dim_k}) differs from q's ({head_dim})")
    empty = not varlen and not empty_ok and min(q.shape[1], k.shape[1]) < 1
    if head_dim < 1 or v.shape[-1] < 1 or nheads < 1 or nheads_k < 1 or empty:
        raise ArgumentError(
            f"seqlens, nheads and headdims must be >= 1: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_heads(nheads, nheads_k, head_dim, q.device, "k/v", v.shape[-1])
    seq = 0 if varlen else 1
    check_positions("total_q" if varlen else "seqlen_q", q.shape[seq])
    check_positions("total_k" if varlen else "seqlen_k", k.shape[seq])


def check_fp8(q, descale, batch: int, nheads_k: int, dropout_p) -> None:
    """An attention call's FP8 arguments: descale = (q_descale, k_descale, v_descale) only with float8_e4m3fn q, k, v
    (never ignored), each checked by check_descale; no dropout with FP8 inputs (FA3 has none either)."""
    names = ("q_descale", "k_descale", "v_descale")
    if q.dtype != E4M3:
        for name, t in zip(names, descale):
            if t is not None:
                raise ArgumentError(f"{name} is for float8_e4m3fn q, k, v (FA3's FP8 forward); q is {q.dtype}")
        return
    if dropout_p > 0:
        raise NotImplementedError("dropout_p > 0 with float8_e4m3fn inputs: the FP8 forward has no dropout")
    for name, t in zip(names, descale):
        check_descale(name, t, batch, nheads_k, q)


def check_descale(name: str, t, batch: int, nheads_k: int, q) -> None:
    """An FP8 call's q_descale / k_descale / v_descale (FA3's): None (1), or float32 (batch, nheads_k) on q's device,
    any strides (an expanded scalar included); varlen's batch is the number of sequences."""
    _head_floats(name, t, q, {(batch, nheads_k): f"(batch, nheads_k) = ({batch}, {nheads_k})"})


def check_heads(nheads, nheads_k, head_dim, device, kv_name, head_dim_v=None, limit=MAX_HEAD_DIM) -> None:
    """The GQA ratio, the head-dim limits (q/k's up to `limit`, v's up to MAX_HEAD_DIM) and q's device."""
    if nheads % nheads_k:
        raise ArgumentError(f"GQA: nheads of q ({nheads}) must be a multiple of nheads of {kv_name} ({nheads_k})")
    if head_dim > limit:
        raise NotImplementedError(f"headdim {head_dim} > {limit} is not supported")
    if head_dim_v is not None and head_dim_v > MAX_HEAD_DIM:
        raise NotImplementedError(f"headdim of v ({head_dim_v}) > {MAX_HEAD_DIM} is not supported")
    check_device(device, "q")


# Whether the entry points read the values of index tensors (cu_seqlens, cache_seqlens,
# cache_leftpad, cache_batch_idx, block_table) to raise on a bad one; see set_value_checks.
_VALUE_CHECKS = _runtime.env_flag("FLASHATTN2_VALUE_CHECKS") is True


def value_checks() -> bool:
    """Whether eager calls read index tensors' values to check them (set_value_checks)."""
    return _VALUE_CHECKS


def set_value_checks(enabled: bool) -> bool:
    """Whether eager calls check the values of the index tensors -- cu_seqlens_q/k (start at 0,
    non-decreasing, within the rows, no sequence past max_seqlen), cache_seqlens,
    cache_leftpad, cache_batch_idx and block_table (in range) -- and raise ValueError naming
    the bad one. Off by default (FLASHATTN2_VALUE_CHECKS=1 in the environment starts with it
    on): a call then reads nothing back from the GPU, as flash_attn, and values out of range
    are clamped into range where the kernels read them and drop the KV-cache append's writes
    they would misdirect (api.flash_attn_with_kvcache says which), so nothing is read or
    written out of bounds and no sequence writes another's cache, but the result of a bad
    value is silently wrong (flash_attn checks nothing either). On, a call
    reads the values back: the host waits for the GPU once per new cu_seqlens tensor and once
    per KV-cache call -- a debugging mode. Shapes, dtypes and int arguments are checked either
    way; under torch.compile and CUDA-graph capture nothing is read back whatever the setting.
    Returns the previous setting.

    The setting is process-wide (every thread, every device): set it once at start-up."""
    global _VALUE_CHECKS
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _VALUE_CHECKS = _VALUE_CHECKS, enabled
    return previous


def cu_seqlens_for_kernels(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, q, k):
    """A varlen call's cu_seqlens (validated tensors: check_cu_tensors) for the kernels: (cu_seqlens_q, cu_seqlens_k,
    verify), the tensors clamped into [0, rows] on the device (in_range) so that the kernels stay in bounds whatever
    the values, and verify(), to call once the kernels are queued.

    Without value checks (the default), under torch.compile and during CUDA-graph capture, nothing is read back:
    verify does nothing. With value checks (set_value_checks) the values must also start at 0, not decrease, end
    within q / k and keep every sequence within max_seqlen: a copy to pinned host memory is queued and verify() waits
    for that copy only (not for the kernels) and raises ValueError on a bad value; a tensor whose values passed is
    remembered (ops.request.seqlens) and not read again."""
    totals = (q.shape[0], k.shape[0])
    clamped_q = in_range(cu_seqlens_q, totals[0])
    if cu_seqlens_k is cu_seqlens_q and totals[1] == totals[0]:  # self-attention: one clamp serves both
        clamped = (clamped_q, clamped_q)
    else:
        clamped = (clamped_q, in_range(cu_seqlens_k, totals[1]))
    if not _VALUE_CHECKS or not host_reads_allowed(q):
        return *clamped, _nothing
    maxes = (max_seqlen_q, max_seqlen_k)
    cus = (cu_seqlens_q, cu_seqlens_k)
    seen_q, seen_k = known(cu_seqlens_q), known(cu_seqlens_k)
    if (
        seen_q is not None
        and seen_k is not None
        and seen_q[0] <= totals[0]
        and seen_k[0] <= totals[1]
        and seen_q[1] <= maxes[0]
        and seen_k[1] <= maxes[1]
    ):
        return *clamped, _nothing
    if q.device.type != "cuda":
        _check_cu_values(torch.stack(cus), totals, maxes, cus, clamped)
        return *clamped, _nothing
    host = torch.empty((2, cu_seqlens_q.shape[0]), dtype=torch.int32, pin_memory=True)
    host[0].copy_(cu_seqlens_q, non_blocking=True)
    host[1].copy_(cu_seqlens_k, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(cu_seqlens_q.device))

    def verify():
        copied.synchronize()
        _check_cu_values(host, totals, maxes, cus, clamped)

    return *clamped, verify


def check_cu_tensors(cu_seqlens_q, cu_seqlens_k, q) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ArgumentTypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ArgumentError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ArgumentError(f"{name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ArgumentError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must have the same length (batch + 1)"
        )


def max_seqlens(max_seqlen_q, max_seqlen_k) -> list[int]:
    """max_seqlen_q/k as ints (a one-element tensor is read)."""
    maxes = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        m = int(m.item()) if isinstance(m, torch.Tensor) else m
        if not isinstance(m, int) or m < 0:
            raise ArgumentError(f"{name} must be an int >= 0, got {m!r}")
        check_positions(name, m)
        maxes.append(m)
    return maxes


def _nothing():
    pass


def _check_cu_values(both, totals, maxes, tensors=None, copies=()):
    """Check the values (rows of `both`, on the host); remember `tensors` (the given
    cu_seqlens_q/k) and their clamped `copies` (equal values) as checked when they pass."""
    seen, orders = [], []
    for name, cu, total, max_seqlen in (
        ("cu_seqlens_q", both[0], totals[0], maxes[0]),
        ("cu_seqlens_k", both[1], totals[1], maxes[1]),
    ):
        lengths = cu[1:] - cu[:-1]
        orders.append(torch.argsort(lengths, descending=True, stable=True).to(torch.int32))
        if cu[0] != 0 or (lengths < 0).any():
            raise ArgumentError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
        if cu[-1] > total:
            raise ArgumentError(
                f"{name} ends at {int(cu[-1])}, past the {total} rows of {'q' if name.endswith('q') else 'k/v'}"
            )
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > max_seqlen:
            raise ArgumentError(f"a sequence of length {longest} exceeds max_seqlen_{name[-1]}={max_seqlen}")
        seen.append((int(cu[-1]), longest))
    if tensors is not None:
        for i, (cu, values, order) in enumerate(zip(tensors, seen, orders)):
            if cu.device.type == "cuda":  # from pinned memory, without waiting for the kernels
                order = order.pin_memory().to(cu.device, non_blocking=True)
            remember(cu, values, order)
            if copies:
                remember(copies[i], values, order)


# flashattn2.explain's meta tensors (shapes without memory) pass the device check; nothing launches on them
META_OK = contextvars.ContextVar("flashattn2_meta_ok", default=False)


def check_device(device: torch.device, name: str) -> None:
    if device.type == "cuda" or (device.type == "meta" and META_OK.get()):
        return
    if device.type == "cpu":
        if not _runtime.interpreted():
            late = (
                " (it is set now, but was not when triton was imported)"
                if os.environ.get("TRITON_INTERPRET") == "1"
                else ""
            )
            raise ArgumentError(
                f"{name} is a CPU tensor: flashattn2 runs on CUDA GPUs, or on the CPU through Triton's "
                f"interpreter when TRITON_INTERPRET=1 is set before triton is imported (before `from flashattn2 "
                f"import ...`){late}"
            )
        return
    raise ArgumentError(f"{name} is on {device}; flashattn2 supports CUDA devices (and the CPU interpreter)")


def check_options(dropout_p, softmax_scale, window_size, softcap) -> None:
    """Validate the options, and refuse those not implemented yet rather than ignore them."""
    if not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is not None and not softmax_scale >= 0:
        raise NotImplementedError(f"softmax_scale must be >= 0 (got {softmax_scale})")
    window = tuple(window_size)
    if len(window) != 2 or any(int(w) != w or w < -1 for w in window):
        raise ArgumentError(f"window_size must be (left, right) with integers >= -1, got {window_size}")
    if not softcap >= 0:
        raise ArgumentError(f"softcap must be >= 0, got {softcap}")
    if dropout_p > 0 and softcap > 0:
        raise NotImplementedError("dropout_p > 0 with softcap > 0 is not supported (as in flash_attn)")


def _head_floats(name: str, t, q, shapes: dict) -> None:
    """t: a float32 tensor on q's device whose shape is one of `shapes` ({shape: its description}); None passes."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ArgumentTypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise ArgumentError(f"{name} must have shape {' or '.join(shapes.values())}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ArgumentError(f"{name} is on {t.device}, q on {q.device}")


def check_alibi(alibi_slopes, q, batch: int) -> None:
    """alibi_slopes: None, or float32 (nheads,) or (batch, nheads) on q's device."""
    nheads = q.shape[-2]
    shapes = {(nheads,): f"(nheads,) = ({nheads},)", (batch, nheads): f"(batch, nheads) = ({batch}, {nheads})"}
    _head_floats("alibi_slopes", alibi_slopes, q, shapes)


def check_sink(learnable_sink, q) -> None:
    """learnable_sink: None, or float32 (nheads,) on q's device (one logit per query head)."""
    nheads = q.shape[-2]
    _head_floats("learnable_sink", learnable_sink, q, {(nheads,): f"(nheads,) = ({nheads},)"})


def check_packed(name: str, t, count: int, varlen: bool = False) -> None:
    """qkv (batch, seqlen, 3, nheads, headdim) or kv (batch, seqlen_k, 2, nheads_k, headdim);
    in varlen qkv (total, 3, nheads, headdim) or kv (total_k, 2, nheads_k, headdim)."""
    layout = f"({'total' if varlen else 'batch, seqlen'}, {count}, nheads, headdim)"
    _tensor(name, t, 4 if varlen else 5, layout, fp8=True)  # (e4m3: the FP8 forward)
    if t.shape[1 if varlen else 2] != count:
        raise ArgumentError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def _index_tensor(name, t, shape, dtypes=(torch.int32,)):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ArgumentTypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ArgumentError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def compute_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV-cache kernel's dots take, and the output's: q's, bf16 for an e4m3 q (FA3's rule)."""
    return torch.bfloat16 if q_dtype == E4M3 else q_dtype


def check_seqused_k(seqused_k, cu_seqlens_q, dropout_p: float, fn: str) -> None:
    """flash_attn's seqused_k: an int32 tensor of one count per sequence, on the queries' device; the keys it limits
    are read through the paged varlen path, which has no dropout (NotImplementedError)."""
    _index_tensor("seqused_k", seqused_k, (cu_seqlens_q.shape[0] - 1,))
    if seqused_k.device != cu_seqlens_q.device:
        raise ArgumentError(f"seqused_k is on {seqused_k.device}, cu_seqlens_q on {cu_seqlens_q.device}")
    if dropout_p > 0:
        raise NotImplementedError(
            f"{fn}: dropout_p > 0 with seqused_k (flashattn2 reads its keys as pages: no dropout)"
        )


def host_reads_allowed(t: torch.Tensor) -> bool:
    """Whether a check may read device values back (t: a tensor of the call's): not while torch.compile traces, nor
    while a CUDA graph is captured."""
    return not (torch.compiler.is_compiling() or _capturing(t))
