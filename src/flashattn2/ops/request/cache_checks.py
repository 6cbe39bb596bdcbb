"""The KV-cache arguments' checks: flash_attn_with_kvcache's (shapes, dtypes, devices, FP8 rules, the values that
live on the device) and the paged prefill's (flash_attn_varlen_func with block_table). Every error names the argument;
the checks every entry point shares are ops.request.checks'."""

from __future__ import annotations

import torch

from ...errors import ArgumentError, ArgumentTypeError

# the two gates, host_reads_allowed and value_checks, are read through checks: one place switches them for every
# check (set_value_checks, a test's patch)
from . import checks
from .checks import (
    E4M3,
    _check_cu_values,
    _index_tensor,
    _tensor,
    check_alibi,
    check_cu_tensors,
    check_descale,
    check_heads,
    check_positions,
    compute_dtype,
    max_seqlens,
)
from .seqlens import in_range

# flash_attn_with_kvcache: q/k up to the MLA decode shape, a 512-wide latent and its 64 rotary columns (v 512)
MAX_HEAD_DIM_KVCACHE = 576


def check_kvcache(r) -> None:
    """Shapes, dtypes and devices of flash_attn_with_kvcache's arguments (ops.request.request.KVCacheRequest); the
    values that live on the device (cache_seqlens, block_table, ...) are checked by the kernels
    (ops.launch.kvcache.Check). The descales: FP8's (check_kvcache_fp8)."""
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


def check_block_table_capacity(cache_seqlens: torch.Tensor, capacity: int, seqlen_new: int) -> None:
    """flash_attn's check of a paged KV-cache call (its one .max().item(), on the paged path alone): the largest
    cache_seqlens plus the new tokens within block_table's capacity, max_num_blocks_per_seq * page_size. Not made
    where host_reads_allowed() says no (the kernels drop the writes past the pages there). Only the capacity: a
    negative value is the kernels' to clamp, as flash_attn's (and the value checks' to name)."""
    if cache_seqlens.numel() == 0 or not checks.host_reads_allowed(cache_seqlens):
        return
    check_kvcache_seqlen(max(int(cache_seqlens.max()), 0), capacity, seqlen_new, None, 1, True)


def check_kvcache_values(r, q_positions: int = 1) -> None:
    """The checks that read device values of a KV-cache request (ops.request.request.KVCacheRequest), in one host sync:
    appends stay inside the cache, the pages a sequence uses exist, left padding and batch indices are in range,
    rotary tables cover every position (the new keys', and q_positions queries from cache_seqlens on). The KV-cache
    call runs it for its message once the kernels' own check found a bad value. Skipped while torch.compile traces
    and while a CUDA graph is captured (a host read is not allowed there)."""
    k_cache, k, rotary_cos, cache_seqlens, block_table = r.k_cache, r.k, r.rotary_cos, r.cache_seqlens, r.block_table
    cache_batch_idx, cache_leftpad = r.cache_batch_idx, r.cache_leftpad
    if not checks.host_reads_allowed(k_cache):
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
    """flash_attn_varlen_func with block_table (paged K/V, forward only; ops.request.request.AttentionRequest): shapes,
    dtypes and devices; returns (max_seqlen_q, max_seqlen_k) as ints. The values: paged_sequences, per call."""
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
    if not checks.value_checks() or not checks.host_reads_allowed(q):
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
