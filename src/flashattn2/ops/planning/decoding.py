"""The KV-cache kernel's plan (flash_attn_with_kvcache, the paged prefill, the batch-invariant mode): DECODE_ROWS in
order, the first whose facts the call has (decode_facts), its tile for the call's head dims and rows, the key splits,
the combine and the load path."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from .. import _runtime
from ..request import spec as specs
from ..request.checks import E4M3, compute_dtype
from .geometry import block_d, column_parts
from ..request.modes import Forced, TileConfig
from .tables import (
    DECODE_LOADS,
    DECODE_ROWS,
    DECODE_STAGE_CAP,
    INVARIANT_MAX_SPLITS,
    INVARIANT_SPLIT_KEYS,
    INVARIANT_SPLIT_KEYS_INTERP,
    MANY_PROGRAMS,
    MAX_SPLITS,
    SHORT_SPLIT,
    DecodeRow,
)
from . import common
from .common import DecodePlan, tma_ok


class Cache(NamedTuple):
    """What the KV-cache kernel's plan reads of a call: the cache's geometry and the rows a program packs."""

    capacity: int  # key positions per sequence: the cache's seqlen, or the block table's pages x page size
    page_size: int  # 0: contiguous
    leftpad: bool
    batch: int
    nheads_k: int
    rows: int  # a program's packed rows: query heads per kv head x queries per sequence
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype  # the dots' (an FP8 call's: checks.compute_dtype)
    v_from_k: bool  # the V cache is the K cache's first column block (v_from_k)
    pages_contiguous: bool  # a page's rows one matrix (kv_tma)
    max_keys: int | None  # the most keys a sequence has when below the capacity (a varlen pack as one cache row)
    k: specs.TensorSpec
    aligned: bool  # q's and the caches' bases 16-byte aligned (TMA)
    fp8: bool = False  # the K/V cache is float8_e4m3fn codes (decoded in registers: kernels/decode.py, DecodeFp8)


def v_from_k(k: specs.TensorSpec, v: specs.TensorSpec, same_memory: bool) -> bool:
    """Whether the V cache is the K cache's first column block (MLA: v_cache = k_cache[..., :512] of a 576-wide cache):
    the same memory and strides, v as wide as the block the kernel loads k's first columns in. The decode kernel then
    takes each key block's values from its keys' tile (V_FROM_K) instead of reading them again."""
    head_dim, first = k.shape[-1], column_parts(k.shape[-1])[0]
    return (
        same_memory
        and v.stride[:3] == k.stride[:3]
        and v.shape[-1] == min(head_dim, first)
        and block_d(v.shape[-1]) == first
    )


def latent_dims(head_dim: int, head_dim_v: int) -> bool:
    """MLA's latent cache's head dims: v 512 wide, q/k 512 and a second power-of-two block (576 = 512 + 64 as
    DeepSeek's; 512 + 16 and 512 + 32 too: the latent rows were measured at 576/512)."""
    hi, lo = column_parts(head_dim)
    return head_dim_v == 512 and hi == 512 and lo > 0


def width(head_dim: int) -> int:
    """The columns the decode kernel holds of q and k: their column blocks' (576 as 512 + 64, not 1024)."""
    return sum(column_parts(head_dim))


def rows_block(rows: int) -> int:
    """The packed rows' power of two, 16 to 64: the rows a program takes before any register bound."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def block_m(rows: int, head_dim: int, head_dim_v: int) -> int:
    """Rows per program: the packed rows, at most what keeps q and the fp32 accumulator of one program within 96 KB
    of registers (head dims past 256: 32 rows at 512/512, 16 for the MLA shape 576/512)."""
    bm = rows_block(rows)
    while bm > 16 and bm * (2 * width(head_dim) + 4 * block_d(head_dim_v)) > 96 * 1024:
        bm //= 2
    return bm


def scaled_tile(tile: TileConfig, head_dim: int, head_dim_v: int, elem_bytes: int) -> TileConfig:
    """A row's (BLOCK_N, warps, stages), measured at head dims 128/128 in 16-bit types, for other head dims: the bytes
    of a key block (K and V) kept; fp32 halves it and drops the pipeline so that head dim 256 fits the 99 KB of shared
    memory of sm86/89 (compile_check); past 256/256 one stage (a 32-key block of K and V is 64 KB at 512/512, 96 KB at
    576/512)."""
    widths = max(64, width(head_dim)) + max(64, block_d(head_dim_v))
    bn = max(32, min(256, 1 << (tile.block_n * 256 // widths).bit_length() - 1))  # a power of two, rounded down
    if elem_bytes == 4:
        return TileConfig(tile.block_m, max(16, bn // (4 if max(head_dim, head_dim_v) > 128 else 2)), 4, 1)
    return TileConfig(tile.block_m, bn, tile.num_warps, 1 if widths > 512 else tile.num_stages)


def num_splits_for(num_splits: int, programs: int, capacity: int, block_n: int, sm_count: int) -> int:
    """num_splits > 0: that many (at most MAX_SPLITS and one per key block). 0: when the batch alone does not fill
    the GPU, as many splits as keep the programs at or below two per SM, and at least one key block per split.
    Rounding up instead cost 5-12% wherever it pushed the programs past 2 x SMs (H200, CUDA-graph GB/s, median of 3:
    MHA 1 x 128k 9 splits 4159 vs 8 splits 4423; GQA-8 batch 8 x 128k 5 splits 4279 vs 4 splits 4529); it tied or won
    at all 11 points swept (batch 1-8, cache 8k-128k, MHA and GQA-8). Short caches gain from splits of a single block:
    at 1k keys 8 splits against the former floor of four blocks per split (2): GQA-8 batch 1 345 vs 243 GB/s, MHA
    batch 1 997 vs 836; GQA-8 1 x 4k, 16 splits 952 vs 8 splits 839."""
    n_blocks = max(1, -(-capacity // block_n))
    if num_splits > 0:
        return max(1, min(num_splits, n_blocks, MAX_SPLITS))
    if programs >= sm_count or programs == 0:  # (no programs: a call with no query rows runs no kernel)
        return 1
    return max(1, min(MAX_SPLITS, 2 * sm_count // programs, n_blocks))


def chunked(capacity: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk) for about `splits` splits of the capacity: each split's keys a multiple of block_n, the count
    recomputed from that chunk (rounding can leave fewer); a cache of no positions is one split of one block."""
    chunk = max(1, -(-capacity // (splits * block_n))) * block_n
    return max(1, -(-capacity // chunk)), chunk


def _path(c: Cache) -> str:
    if not c.page_size:
        return "contiguous"
    if not c.leftpad and c.page_size % 128 == 0:  # the page-block rows' key block lies in one page
        return "page-block"
    return "page-row"


def _row(when: dict) -> DecodeRow:
    return next(row for row in DECODE_ROWS if dict(row.when) == when)


# the generic rows by their path's name (the compile check builds each; "-short" and "-many": the contiguous
# refinements)
_DECODE_PATHS = {
    "contiguous-short": {"path": "contiguous", "short": True},
    "contiguous-many": {"path": "contiguous", "many": True},
}


def decode_row(path: str, split: bool) -> DecodeRow:
    """The generic DECODE_ROWS row of a path ("contiguous", "contiguous-short", "contiguous-many", "page-block",
    "page-row") with or without splits."""
    return _row({**_DECODE_PATHS.get(path, {"path": path}), "split": split})


def decode_tile(row: DecodeRow, rows: int, head_dim: int, head_dim_v: int, elem_bytes: int, arch: str) -> TileConfig:
    """A row's tile for a call's packed rows, head dims and element size on arch (what decode() runs outside the
    mode): its stages capped where shared memory is small (DECODE_STAGE_CAP)."""
    tile = scaled_tile(row.tile, head_dim, head_dim_v, elem_bytes) if row.scaled else row.tile
    if not tile.block_m:
        tile = replace(tile, block_m=block_m(rows, head_dim, head_dim_v))
    cap = DECODE_STAGE_CAP.get(arch)
    if cap is not None and tile.num_stages > 1:
        one_from, most = cap
        widths = max(64, width(head_dim)) + max(64, block_d(head_dim_v))
        tile = replace(tile, num_stages=1 if widths >= one_from else min(tile.num_stages, most))
    return tile


def decode_facts(c: Cache, arch: str, invariant: bool, num_splits: int, sm_count: int) -> dict:
    """The facts DECODE_ROWS' conditions name: interp, invariant, fp8 (an FP8 cache), latent (MLA's latent cache on
    sm90 in 16-bit types), rows (the packed rows' power of two), path, split (num_splits > 1, or 0 with the batch's programs fewer than the
    SMs), many (at least MANY_PROGRAMS programs), short (splits of at most SHORT_SPLIT keys with the contiguous split
    row's key block)."""
    elem_bytes = c.dtype.itemsize
    num_splits = _asked(num_splits, arch)
    programs = -(-c.rows // block_m(c.rows, c.head_dim, c.head_dim_v)) * c.batch * c.nheads_k
    split = num_splits > 1 or (num_splits == 0 and programs < sm_count)
    split_tile = scaled_tile(_row({"path": "contiguous", "split": True}).tile, c.head_dim, c.head_dim_v, elem_bytes)
    splits, chunk = chunked(
        c.capacity, num_splits_for(num_splits, programs, c.capacity, split_tile.block_n, sm_count), split_tile.block_n
    )
    return {
        "interp": arch == "interp",
        "invariant": invariant,
        "fp8": c.fp8,
        "latent": arch == "sm90"
        and elem_bytes == 2
        and not c.fp8
        and c.v_from_k
        and latent_dims(c.head_dim, c.head_dim_v),
        "rows": rows_block(c.rows),
        "path": _path(c),
        "split": split,
        "many": programs >= MANY_PROGRAMS,
        "short": split and splits > 1 and chunk <= SHORT_SPLIT,
        "programs": programs,
    }


def walk(facts: dict):
    """DECODE_ROWS in order, each with why it is passed over (None: it runs)."""
    return common.walk(DECODE_ROWS, facts)


def load_facts(c: Cache, arch: str, forced_: Forced, invariant: bool, tile: TileConfig) -> dict:
    """The facts DECODE_LOADS' rows name, for the row's tile: invariant, latent_cache (v the K cache's first 512
    columns, q/k 576-like), fp8, tma_arch (sm90 in 16-bit types; the interpreter), paged, leftpad, page_holds_blocks
    (pages a multiple of the key block), pages_contiguous (a page's rows one matrix), cache_rows_int32 (the
    descriptor's int32 row coordinate), tma (tma_ok's alignment and stride rule)."""
    return {
        "invariant": invariant,
        "latent_cache": c.v_from_k and latent_dims(c.head_dim, c.head_dim_v),
        "fp8": c.fp8,
        "tma_arch": arch == "interp" or (arch == "sm90" and c.dtype.itemsize == 2),
        "paged": bool(c.page_size),
        "leftpad": c.leftpad,
        "page_holds_blocks": bool(c.page_size) and c.page_size % tile.block_n == 0,
        "pages_contiguous": c.pages_contiguous,
        "cache_rows_int32": c.k.shape[0] * c.page_size < 2**31,
        "tma": tma_ok(arch, forced_, c.aligned, c.k),
    }


def _asked(num_splits: int, arch: str) -> int:
    """The splits a call asks for: num_splits, but for 0 (the heuristic's) in the interpreter 1: it runs the programs
    one after another, so splitting a sequence's keys over programs only adds the combine (num_splits > 1 splits
    there too: the tests' split paths)."""
    return 1 if num_splits == 0 and arch == "interp" else num_splits


def decode(c: Cache, arch: str, forced_: Forced, invariant: bool, num_splits: int, sm_count: int) -> DecodePlan:
    """The KV-cache kernel's plan (DecodePlan): the first of DECODE_ROWS whose facts the call has, its tile for the
    call's head dims and rows, its splits; the batch-invariant mode's fixed splits."""
    elem_bytes = c.dtype.itemsize
    num_splits = _asked(num_splits, arch)
    if arch == "sm86" and elem_bytes == 4 and width(c.head_dim) + block_d(c.head_dim_v) > 1024:
        raise NotImplementedError(
            f"flash_attn_with_kvcache in fp32 with head dims {c.head_dim}/{c.head_dim_v} on {arch}: its smallest tile "
            "needs 128 KB of shared memory, this GPU has 99 KB per block (fp16 and bf16 run)"
        )
    facts = decode_facts(c, arch, invariant, num_splits, sm_count)
    row = common.first(DECODE_ROWS, facts)
    # the packed rows' block; the mode's is 16 rows' whatever the call (a function of head dims and element size)
    tile = decode_tile(row, 16 if invariant else c.rows, c.head_dim, c.head_dim_v, elem_bytes, arch)
    if invariant:  # num_splits (a speed knob) yields to the mode's fixed splits
        chunk = INVARIANT_SPLIT_KEYS_INTERP if arch == "interp" else INVARIANT_SPLIT_KEYS
        keys = c.capacity if c.max_keys is None else min(c.max_keys, c.capacity)
        splits = max(1, -(-keys // chunk))
        if splits > INVARIANT_MAX_SPLITS:
            raise NotImplementedError(
                f"batch-invariant mode: a sequence of up to {keys} keys (a cache's capacity, or the longest sequence) "
                f"is more than {INVARIANT_MAX_SPLITS} splits of {chunk} keys ({INVARIANT_MAX_SPLITS * chunk}); the "
                "mode's split-merging reduction has that fixed width"
            )
    else:  # the programs the row's tile makes (a latent tile packs up to 64 rows)
        programs = -(-c.rows // tile.block_m) * c.batch * c.nheads_k
        splits, chunk = chunked(
            c.capacity, num_splits_for(num_splits, programs, c.capacity, tile.block_n, sm_count), tile.block_n
        )
    combine = splits > 1 or invariant  # the mode merges even one split: every row's last steps are the combine's
    kv_tma = common.first(DECODE_LOADS, load_facts(c, arch, forced_, invariant, tile)).path == "kv_tma"
    return DecodePlan(
        tile=tile,
        why=row.why,
        splits=splits,
        chunk=chunk,
        combine=combine,
        pdl=combine and _runtime.PDL and arch == "sm90",
        kv_tma=kv_tma,
        v_from_k=c.v_from_k,
        invariant=invariant,
    )


# explain's meta device of an arch: an H100/H200's, an A100's and an RTX 3090's SMs
_META_SMS = {"sm90": 132, "sm80": 108, "sm86": 82, "interp": 64}


def sm_count(device: torch.device, arch: str) -> int:
    if arch == "interp" or device.type == "meta":
        return _META_SMS[arch]
    return _runtime.sm_count(device)


def kvcache_cache(s: specs.KVCacheSpec) -> Cache:
    """flash_attn_with_kvcache's (an FP8 cache: `fp8`, the dots in checks.compute_dtype)."""
    batch, seqlen_q, nheads, head_dim = s.q.shape
    nheads_k = s.k_cache.shape[2]
    page = s.k_cache.shape[1] if s.block_table is not None else 0
    capacity = s.block_table.shape[1] * page if page else s.k_cache.shape[1]
    k, v = s.k_cache, s.v_cache
    return Cache(
        capacity=capacity,
        page_size=page,
        leftpad=s.cache_leftpad is not None,
        batch=batch,
        nheads_k=nheads_k,
        rows=nheads // nheads_k * seqlen_q,
        head_dim=head_dim,
        head_dim_v=v.shape[-1],
        dtype=compute_dtype(s.q.dtype),
        v_from_k=v_from_k(k, v, s.v_from_k),
        pages_contiguous=k.stride[0] == k.shape[1] * k.stride[1],
        max_keys=None,
        k=k,
        aligned=specs.all_aligned(s.aligned, 3),
        fp8=k.dtype == E4M3,
    )


def _varlen_rows(group: int, max_seqlen_q: int) -> int:
    """A varlen q's packed rows (the paged prefill's, the batch-invariant mode's varlen call): the kernel (VARLEN_Q)
    compares a program's first row with seqlen_q * group in int32."""
    rows = group * max_seqlen_q
    if rows >= 2**31:
        raise NotImplementedError(
            f"{group} query heads per K/V head x max_seqlen_q={max_seqlen_q} is {rows} packed rows of a sequence: "
            "flashattn2's KV-cache kernel counts them in int32 (at most 2**31 - 1)"
        )
    return rows


def paged_cache(s: specs.PagedSpec) -> Cache:
    nheads, head_dim = s.q.shape[1:]
    page = s.k_cache.shape[1]
    nheads_k = s.k_cache.shape[2]
    k, v = s.k_cache, s.v_cache
    return Cache(
        capacity=s.block_table.shape[1] * page,
        page_size=page,
        leftpad=False,
        batch=s.cu_seqlens_q.shape[0] - 1,
        nheads_k=nheads_k,
        rows=_varlen_rows(nheads // nheads_k, s.max_seqlen_q),
        head_dim=head_dim,
        head_dim_v=v.shape[-1],
        dtype=s.q.dtype,
        v_from_k=False,  # its own memory (a latent cache is flash_attn_with_kvcache's)
        pages_contiguous=k.stride[0] == page * k.stride[1],
        max_keys=None,
        k=k,
        aligned=specs.all_aligned(s.aligned, 3),
    )


def invariant_cache(s: specs.AttentionSpec) -> Cache:
    """The batch-invariant mode's view of an attention call's k and v as a cache: dense, a cache row per sequence;
    varlen, one row holding every sequence, each from its cu_seqlens_k start (left padding) to its end."""
    nheads, head_dim = s.q.shape[-2:]
    nheads_k = s.k.shape[-2]
    if s.varlen:
        capacity, batch, seqlen_q, max_keys = s.k.shape[0], s.cu_seqlens_q.shape[0] - 1, s.max_seqlen_q, s.max_seqlen_k
    else:
        capacity, batch, seqlen_q, max_keys = s.k.shape[1], s.q.shape[0], s.q.shape[1], None
    group = nheads // nheads_k
    rows = _varlen_rows(group, seqlen_q) if s.varlen else group * seqlen_q
    return Cache(
        capacity=capacity, page_size=0, leftpad=s.varlen, batch=batch, nheads_k=nheads_k, rows=rows,
        head_dim=head_dim, head_dim_v=s.v.shape[-1], dtype=compute_dtype(s.q.dtype), v_from_k=False,
        pages_contiguous=True, max_keys=max_keys, k=s.k, aligned=specs.all_aligned(s.aligned, 3),
        fp8=s.k.dtype == E4M3,
    )  # fmt: skip
