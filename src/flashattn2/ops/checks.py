"""Argument validation shared by the public entry points: every error names the argument."""

from __future__ import annotations

import contextvars
import os

import torch

from . import _runtime
from .seqlens import _capturing, in_range, known, remember
from ..errors import ArgumentError, ArgumentTypeError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
E4M3 = torch.float8_e4m3fn  # FA3's FP8 type: the forward's q, k, v and the KV cache's (with float32 descales)
MAX_HEAD_DIM = 512  # q/k's and v's, each
# flash_attn_with_kvcache: q/k up to the MLA decode shape, a 512-wide latent and its 64 rotary columns (v 512)
MAX_HEAD_DIM_KVCACHE = 576
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
    remembered (ops.seqlens) and not read again."""
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


def check_kvcache(r) -> None:
    """Shapes, dtypes and devices of flash_attn_with_kvcache's arguments (ops.request.KVCacheRequest); the values that
    live on the device (cache_seqlens, block_table, ...) are checked by the kernels (ops.kvcache.Check). The
    descales: FP8's (check_kvcache_fp8)."""
    q, k_cache, v_cache, k, v, cache_seqlens, block_table = (
        r.q, r.k_cache, r.v_cache, r.k, r.v, r.cache_seqlens, r.block_table
    )  # fmt: skip
    rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad = (
        r.rotary_cos,
        r.rotary_sin,
        r.cache_batch_idx,
        r.cache_leftpad,
    )
    num_splits, descales = r.num_splits, r.descales
    _tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)", fp8=True)
    paged = block_table is not None
    layout = "(num_blocks, page_size, nheads_k, " if paged else "(batch_cache, seqlen_cache, nheads_k, "
    _tensor("k_cache", k_cache, 4, layout + "headdim)", fp8=True)
    _tensor("v_cache", v_cache, 4, layout + "headdim_v)", fp8=True)
    batch, seqlen_q, nheads, head_dim = q.shape
    fp8 = k_cache.dtype == E4M3 or v_cache.dtype == E4M3 or q.dtype == E4M3
    if fp8:
        check_kvcache_fp8(q, k_cache, v_cache, k, v, rotary_cos)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and not fp8:
            raise ArgumentTypeError(
                f"{name} has dtype {t.dtype}, q has {q.dtype}: the cache must have q's dtype (or be float8_e4m3fn)"
            )
        if t.device != q.device:
            raise ArgumentError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ArgumentError(f"{name} must be contiguous in its last dimension (it is written in place)")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ArgumentError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape but for the "
            "head dim"
        )
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ArgumentError(f"headdim of k_cache ({k_cache.shape[3]}) differs from q's ({head_dim})")
    check_heads(nheads, nheads_k, head_dim, q.device, "the cache", v_cache.shape[3], MAX_HEAD_DIM_KVCACHE)
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (or neither)")
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            _tensor(name, t, 4, "(batch, seqlen_new, nheads_k, headdim)", fp8=fp8)
            if (t.dtype != q.dtype and not fp8) or t.device != q.device:
                raise ArgumentTypeError(f"{name} must have q's dtype and device, got {t.dtype} on {t.device}")
            if t.shape[0] != batch or t.shape[2:] != cache.shape[2:]:
                raise ArgumentError(
                    f"{name} must be (batch={batch}, seqlen_new, nheads_k={nheads_k}, "
                    f"headdim={cache.shape[3]}), got {tuple(t.shape)}"
                )
        if k.shape[:3] != v.shape[:3]:
            raise ArgumentError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape but for the head dim")
        if cache_seqlens is None:
            raise ArgumentError("appending k/v needs cache_seqlens (where each sequence's new tokens go)")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ArgumentError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ArgumentError("rotary_cos/rotary_sin need the new k/v: the rotary embedding is applied on append")
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape:
            raise ArgumentError(
                f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2), got "
                f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}"
            )
        if 2 * rotary_cos.shape[1] > head_dim:
            raise ArgumentError(f"rotary_dim {2 * rotary_cos.shape[1]} exceeds headdim {head_dim}")
        if rotary_cos.dtype != q.dtype or rotary_sin.dtype != q.dtype:
            raise ArgumentTypeError(f"rotary_cos/rotary_sin must have q's dtype {q.dtype}, got {rotary_cos.dtype}")
        if rotary_cos.device != q.device or rotary_sin.device != q.device:
            raise ArgumentError("rotary_cos/rotary_sin must be on q's device")
    if isinstance(cache_seqlens, torch.Tensor):
        _index_tensor("cache_seqlens", cache_seqlens, (batch,))
    elif cache_seqlens is not None and (not isinstance(cache_seqlens, int) or cache_seqlens < 0):
        raise ArgumentTypeError(
            f"cache_seqlens must be an int >= 0 or an int32 ({batch},) tensor, got {cache_seqlens!r}"
        )
    _index_tensor("cache_batch_idx", cache_batch_idx, (batch,))
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ArgumentError(
            f"k_cache has {k_cache.shape[0]} rows for a batch of {batch}: give cache_batch_idx, or a "
            "cache with a row per sequence"
        )
    _index_tensor("cache_leftpad", cache_leftpad, (batch,))
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ArgumentError(
                f"block_table must be (batch={batch}, max_blocks), got "
                f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}"
            )
        _index_tensor("block_table", block_table, block_table.shape)
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    check_positions("seqlen_q", seqlen_q)
    check_positions("the capacity block_table.shape[1] * k_cache.shape[1]" if paged else "k_cache.shape[1]", capacity)
    if k is not None and k.shape[1] > capacity:
        raise ArgumentError(
            f"seqlen_new={k.shape[1]} new tokens do not fit the cache's "
            f"{'block_table' if paged else 'seqlen'} capacity of {capacity} positions"
        )
    if paged:
        if cache_batch_idx is not None:
            raise NotImplementedError(
                "cache_batch_idx with a paged cache (block_table) is not supported, as in "
                "flash_attn: index the block table instead"
            )
    for name, t in (
        ("cache_seqlens", cache_seqlens),
        ("cache_batch_idx", cache_batch_idx),
        ("cache_leftpad", cache_leftpad),
        ("block_table", block_table),
    ):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ArgumentError(f"{name} is on {t.device}, q on {q.device}")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ArgumentError(f"num_splits must be an int >= 0 (0: chosen by a heuristic), got {num_splits!r}")
    check_alibi(r.alibi_slopes, q, batch)
    q_descale, k_descale, v_descale = descales
    if q_descale is not None and q.dtype != E4M3:
        raise ArgumentError(f"q_descale is given but q is {q.dtype}: a descale goes with a float8_e4m3fn q")
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and k_cache.dtype != E4M3:
            raise ArgumentError(
                f"{name} is given but the cache is {k_cache.dtype}: a descale goes with a float8_e4m3fn cache"
            )
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        check_descale(name, t, batch, nheads_k, q)


def compute_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV-cache kernel's dots take, and the output's: q's, bf16 for an e4m3 q (FA3's rule)."""
    return torch.bfloat16 if q_dtype == E4M3 else q_dtype


def check_kvcache_fp8(q, k_cache, v_cache, k, v, rotary_cos) -> None:
    """flash_attn_with_kvcache's FP8 dtype rules: k_cache and v_cache both float8_e4m3fn; an e4m3 q over an e4m3 cache
    only (the output bf16); the new k and v of one dtype, e4m3 (written as they are) or the dots' (compute_dtype:
    quantized by the append); rotary only for 16-bit q and new k (rotating e4m3 codes would round twice: rotate,
    then quantize)."""
    if k_cache.dtype != E4M3 or v_cache.dtype != E4M3:
        if q.dtype == E4M3 and k_cache.dtype == v_cache.dtype:
            raise ArgumentTypeError(f"q is float8_e4m3fn, k_cache and v_cache are {k_cache.dtype}: an FP8 q needs an "
                                    "FP8 cache")  # fmt: skip
        raise ArgumentTypeError(
            f"k_cache is {k_cache.dtype}, v_cache is {v_cache.dtype}: an FP8 cache is float8_e4m3fn in both"
        )
    compute = compute_dtype(q.dtype)
    if k is not None and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        if k.dtype != v.dtype or k.dtype not in (E4M3, compute):
            raise ArgumentTypeError(
                f"k is {k.dtype}, v is {v.dtype}: the new keys and values over a float8_e4m3fn cache are both "
                f"float8_e4m3fn (written as they are) or both {compute} (quantized with k_descale / v_descale)"
            )
    if rotary_cos is not None:
        if q.dtype == E4M3 or (isinstance(k, torch.Tensor) and k.dtype == E4M3):
            raise NotImplementedError(
                "rotary_cos/rotary_sin with a float8_e4m3fn q or new k is not supported (rotating e4m3 values "
                "rounds them again): pass q and k in 16 bits, the append quantizes k after rotating it"
            )


def check_kvcache_seqlen(
    seqlen: int, capacity: int, seqlen_new: int, rotary_cos, q_positions: int, paged: bool
) -> None:
    """cache_seqlens (an int, or the largest of a tensor's values): the append stays inside the
    cache and the rotary table covers the positions rotated."""
    if seqlen < 0:
        raise ArgumentError(f"cache_seqlens must be >= 0, got {seqlen}")
    if seqlen + seqlen_new > capacity:
        raise ArgumentError(
            f"cache_seqlens + seqlen_new reaches {seqlen + seqlen_new}, past the cache's "
            f"{'block_table' if paged else 'seqlen'} capacity of {capacity} positions"
            + (" (max_num_blocks_per_seq * page_size)" if paged else "")
        )
    rotary_end = seqlen + max(seqlen_new, q_positions)
    if rotary_cos is not None and rotary_end > rotary_cos.shape[0]:
        raise ArgumentError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions, the cache needs {rotary_end}")


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


def check_block_table_capacity(cache_seqlens: torch.Tensor, capacity: int, seqlen_new: int) -> None:
    """flash_attn's check of a paged KV-cache call (its one .max().item(), on the paged path alone): the largest
    cache_seqlens plus the new tokens within block_table's capacity, max_num_blocks_per_seq * page_size. Not made
    where host_reads_allowed() says no (the kernels drop the writes past the pages there). Only the capacity: a
    negative value is the kernels' to clamp, as flash_attn's (and the value checks' to name)."""
    if cache_seqlens.numel() == 0 or not host_reads_allowed(cache_seqlens):
        return
    check_kvcache_seqlen(max(int(cache_seqlens.max()), 0), capacity, seqlen_new, None, 1, True)


def check_kvcache_values(r, q_positions: int = 1) -> None:
    """The checks that read device values of a KV-cache request (ops.request.KVCacheRequest), in one host sync:
    appends stay inside the cache, the pages a sequence uses exist, left padding and batch indices are in range,
    rotary tables cover every position (the new keys', and q_positions queries from cache_seqlens on). The KV-cache
    call runs it for its message once the kernels' own check found a bad value. Skipped while torch.compile traces
    and while a CUDA graph is captured (a host read is not allowed there)."""
    k_cache, k, rotary_cos, cache_seqlens, block_table = r.k_cache, r.k, r.rotary_cos, r.cache_seqlens, r.block_table
    cache_batch_idx, cache_leftpad = r.cache_batch_idx, r.cache_leftpad
    if not host_reads_allowed(k_cache):
        return
    seqlen_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    host = _to_host(cache_seqlens, cache_leftpad, cache_batch_idx, block_table)  # one transfer
    if isinstance(cache_seqlens, int):
        seqlens = torch.tensor([cache_seqlens])
    elif cache_seqlens is None:
        seqlens = torch.tensor([capacity])
    else:
        seqlens = host[0]
    if seqlens.numel() == 0:
        return
    ends = seqlens.long() + seqlen_new
    if int(seqlens.min()) < 0:
        raise ArgumentError(f"cache_seqlens must be >= 0, got {seqlens.tolist()}")
    check_kvcache_seqlen(int(seqlens.max()), capacity, seqlen_new, rotary_cos, q_positions, paged)
    if cache_leftpad is not None:
        pad = host[1]
        if int(pad.min()) < 0 or bool((pad > seqlens.long()).any()):
            raise ArgumentError(f"cache_leftpad must be in [0, cache_seqlens], got {pad.tolist()}")
    if cache_batch_idx is not None:
        idx = host[2]
        if int(idx.min()) < 0 or int(idx.max()) >= k_cache.shape[0]:
            raise ArgumentError(f"cache_batch_idx must index the {k_cache.shape[0]} cache rows, got {idx.tolist()}")
    if paged:
        page = k_cache.shape[1]
        table = host[3]
        used = (ends.expand(table.shape[0]) + page - 1) // page  # pages each sequence touches
        cols = torch.arange(table.shape[1])[None, :]
        live = table[cols < used[:, None]]
        if live.numel() and (int(live.min()) < 0 or int(live.max()) >= k_cache.shape[0]):
            raise ArgumentError(
                f"block_table entries must index the {k_cache.shape[0]} blocks of k_cache, got values "
                f"in [{int(live.min())}, {int(live.max())}]"
            )


def _to_host(*tensors):
    """The given device tensors (None kept) as int64 CPU tensors, through one copy."""
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not present:
        return [None] * len(tensors)
    flat = torch.cat([t.reshape(-1).long() for t in present]).cpu()
    out, at = [], 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.append(flat[at : at + t.numel()].reshape(t.shape))
            at += t.numel()
        else:
            out.append(None)
    return out


def check_varlen_paged(r) -> tuple[int, int]:
    """flash_attn_varlen_func with block_table (paged K/V, forward only; ops.request.AttentionRequest): shapes, dtypes
    and devices; returns (max_seqlen_q, max_seqlen_k) as ints. The values: paged_sequences, per call."""
    q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table = (
        r.q, r.k, r.v, r.cu_seqlens_q, r.cu_seqlens_k, r.block_table
    )  # fmt: skip
    max_seqlen_q, max_seqlen_k, dropout_p, alibi_slopes = r.max_seqlen_q, r.max_seqlen_k, r.dropout_p, r.alibi_slopes
    for name, t in (("q", q), ("k", k_cache), ("v", v_cache)):
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.dtype.itemsize == 1:
            raise NotImplementedError(
                f"flash_attn_varlen_func with block_table: {name} is {t.dtype}; a paged FP8 K/V is "
                "flash_attn_with_kvcache's (block_table, k_descale, v_descale), not the paged prefill's"
            )
    _tensor("q", q, 3, "(total_q, nheads, headdim)")
    _tensor("k", k_cache, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    _tensor("v", v_cache, 4, "(num_blocks, page_size, nheads_k, headdim_v) with block_table")
    for name, t in (("k", k_cache), ("v", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ArgumentTypeError(f"{name} must have q's dtype and device, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:
            raise ArgumentError(f"{name} must be contiguous in its last dimension")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ArgumentError(
            f"k {tuple(k_cache.shape)} and v {tuple(v_cache.shape)} must have one shape but for the head dim"
        )
    nheads, head_dim = q.shape[1:]
    if k_cache.shape[3] != head_dim:
        raise ArgumentError(f"headdim of k ({k_cache.shape[3]}) differs from q's ({head_dim})")
    check_heads(nheads, k_cache.shape[2], head_dim, q.device, "k/v", v_cache.shape[3])
    if dropout_p > 0:
        raise NotImplementedError("dropout_p > 0 with block_table (paged K/V) is not supported: it is forward-only")
    check_cu_tensors(cu_seqlens_q, cu_seqlens_k, q)
    batch = cu_seqlens_q.shape[0] - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ArgumentError(f"block_table must be (batch={batch}, max_blocks) int32")
    _index_tensor("block_table", block_table, block_table.shape)
    if block_table.device != q.device:
        raise ArgumentError(f"block_table is on {block_table.device}, q on {q.device}")
    maxes = max_seqlens(max_seqlen_q, max_seqlen_k)
    check_positions("total_q", q.shape[0])
    check_positions("the capacity block_table.shape[1] * k.shape[1]", block_table.shape[1] * k_cache.shape[1])
    check_alibi(alibi_slopes, q, batch)
    return maxes


def paged_sequences(q, k_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, block_table):
    """A paged prefill's per-call part (its tensors validated by check_varlen_paged): cu_seqlens_q clamped into q's
    rows on the device (the kernels clamp the keys' lengths and the table's entries themselves); with value checks
    on (set_value_checks) and outside torch.compile, the values of cu_seqlens and block_table, in one host read."""
    clamped = in_range(cu_seqlens_q, q.shape[0])
    if not _VALUE_CHECKS or not host_reads_allowed(q):
        return clamped
    maxes = (max_seqlen_q, max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1
    cu_q, cu_k, table = _to_host(cu_seqlens_q, cu_seqlens_k, block_table)
    capacity = block_table.shape[1] * k_cache.shape[1]
    _check_cu_values(torch.stack((cu_q, cu_k)), (q.shape[0], batch * capacity), maxes)
    lengths = cu_k[1:] - cu_k[:-1]
    if lengths.numel() and int(lengths.max()) > capacity:
        raise ArgumentError(f"a sequence of {int(lengths.max())} keys exceeds the block_table capacity of {capacity}")
    page = k_cache.shape[1]
    used = (lengths + page - 1) // page
    live = table[torch.arange(table.shape[1])[None, :] < used[:, None]]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= k_cache.shape[0]):
        raise ArgumentError(
            f"block_table entries must index the {k_cache.shape[0]} blocks of k, got values in "
            f"[{int(live.min())}, {int(live.max())}]"
        )
    return clamped
