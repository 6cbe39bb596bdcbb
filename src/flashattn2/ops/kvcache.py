"""flash_attn_with_kvcache's launcher: append the new keys/values (rotated) into the cache,
rotate q, then attend over the cache, split over keys when the batch is too small to fill the
GPU, and merge the splits. The caller (ops.registry) makes q's device the current one, as
for the attention launchers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _runtime, checks, invariance, launcher, planning
from .geometry import block_d, column_parts, fill_tails
from .tma import use_tma
from .options import ScoreMods
from . import rotary as _rotary

MAX_SPLITS = 128


@dataclass(frozen=True)
class Cache:
    """The cache as the kernel reads it. Contiguous: k/v (batch_cache, capacity, nheads_k,
    headdim), row cache_batch_idx[b] (or b) for sequence b. Paged: k/v (num_blocks, page_size,
    nheads_k, headdim) and block_table (batch, max_blocks)."""

    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor | None  # int32 (batch,), or None with seqlen_int
    seqlen_int: int
    batch_idx: torch.Tensor | None
    leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    # the most keys a sequence has, when known below the capacity (a varlen pack seen as one cache row: its
    # max_seqlen_k); None: the capacity
    max_keys: int | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        if self.block_table is not None:
            return self.block_table.shape[1] * self.page_size
        return self.k.shape[1]


@dataclass(frozen=True)
class Check:
    """Device-side checking of the cache tensors' values: err (int32 (1,), zero) is set by a
    kernel that finds a value out of range; cache_seqlens may not exceed seqlen_limit (the
    capacity less the new tokens, and the rotary table's end less the positions rotated)."""

    err: torch.Tensor
    seqlen_limit: int
    key: object = None  # where the caller keeps err between calls


def append_(cache: Cache, k_new: torch.Tensor, v_new: torch.Tensor, rotary, check: Check | None = None) -> None:
    """Write k_new/v_new (batch, seqlen_new, nheads_k, headdim) at positions cache_seqlens[b] + i;
    k rotated there first when rotary = (cos, sin, interleaved) is given. One kernel; with check
    every program first checks every sequence's values (cache_seqlens, cache_leftpad,
    cache_batch_idx, the pages written) and none writes if one is out of range."""
    batch, seqlen_new, nheads_k, head_dim = k_new.shape
    head_dim_v = v_new.shape[-1]
    if batch == 0 or seqlen_new == 0:
        return
    # the kernel reads rows of k/v with unit stride
    k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    if check is not None and cache.block_table is not None:
        _check_pages_read(cache, seqlen_new, check)
    interp = _runtime.interpreted()
    if not interp:
        planning.arch_of(k_new.device)  # an unsupported GPU raises before the cache is written
    if rotary is not None:
        cos, sin, interleaved = rotary
        if interp and k_new.dtype != torch.float32:
            # the interpreter's fp32 -> 16-bit store truncates: rotate in fp32, let torch round
            offsets = cache.seqlens if cache.seqlens is not None else cache.seqlen_int
            k_new = _rotary.rotate_(k_new.float(), cos, sin, interleaved, offsets).to(k_new.dtype)
            rotary = None
    else:
        cos = sin = k_new
        interleaved = False
    bt = cache.block_table
    dummy = k_new
    block_t = min(16, 1 << (seqlen_new - 1).bit_length())
    kernels = _runtime.kernels()
    launcher.launch(
        kernels.append.kvcache_append_kernel,
        (batch, -(-seqlen_new // block_t)),
        k_new,
        v_new,
        cache.k,
        cache.v,
        cos,
        sin,
        cache.seqlens if cache.seqlens is not None else dummy,
        cache.batch_idx if cache.batch_idx is not None else dummy,
        cache.leftpad if cache.leftpad is not None else dummy,
        bt if bt is not None else dummy,
        check.err if check is not None else dummy,
        k_new.stride()[:3],
        v_new.stride()[:3],
        cache.k.stride()[:3],
        cache.v.stride()[:3],
        bt.stride(0) if bt is not None else 0,
        cos.stride(0),
        (
            batch,
            nheads_k,
            seqlen_new,
            cache.seqlen_int,
            cache.capacity,
            cache.k.shape[0],
            check.seqlen_limit if check is not None else cache.capacity - seqlen_new,
        ),
        (cos.shape[0], cos.shape[1]) if rotary is not None else (0, 0),
        CHECK=check is not None,
        CACHE=kernels.decode.CacheLayout(
            PAGED=bt is not None,
            BATCH_IDX=cache.batch_idx is not None,
            LEFTPAD=cache.leftpad is not None,
            SEQLENS_TENSOR=cache.seqlens is not None,
            PAGE_SIZE=cache.page_size if bt is not None else 1,
        ),
        ROTARY=rotary is not None,
        INTERLEAVED=interleaved,
        TILE=kernels.append.AppendTile(
            HEAD_DIM=head_dim,
            BLOCK_B=min(256, max(2, 1 << (batch - 1).bit_length())),
            BLOCK_T=block_t,
            BLOCK_D=block_d(head_dim),
            HEAD_DIM_V=head_dim_v,
            BLOCK_DV=block_d(head_dim_v),
        ),
        num_warps=4 if head_dim * block_t >= 1024 else 2,
    )


def _check_pages_read(cache: Cache, seqlen_new: int, check: Check) -> None:
    """Flag, on the device and before the append, block-table entries out of range among the
    pages each sequence uses (not only those the append writes): the append kernel reads the
    flag and writes nothing, so a bad page raises before any memory is touched."""
    table = cache.block_table
    if cache.seqlens is not None:
        ends = cache.seqlens.clamp(0, cache.capacity - seqlen_new) + seqlen_new
    else:
        ends = torch.full((table.shape[0],), cache.seqlen_int + seqlen_new, device=table.device)
    used = (ends + cache.page_size - 1) // cache.page_size
    cols = torch.arange(table.shape[1], device=table.device)
    bad = ((table < 0) | (table >= cache.k.shape[0])) & (cols[None, :] < used[:, None])
    check.err.copy_(bad.any().view(1))


def rotate_q(q: torch.Tensor, cache: Cache, rotary, per_token: bool) -> torch.Tensor:
    """q rotated (a copy) at positions cache_seqlens[b] + i (per_token: causal or local), else
    every query of sequence b at position cache_seqlens[b]."""
    cos, sin, interleaved = rotary
    batch, seqlen_q, nheads, head_dim = q.shape
    offsets = cache.seqlens if cache.seqlens is not None else cache.seqlen_int
    q = q.clone(memory_format=torch.contiguous_format)
    if per_token or seqlen_q == 1:
        return _rotary.rotate_(q, cos, sin, interleaved, offsets)
    # one position per sequence: its queries become heads of a single token
    _rotary.rotate_(q.view(batch, 1, seqlen_q * nheads, head_dim), cos, sin, interleaved, offsets)
    return q


# (path, split) -> (BLOCK_N, num_warps, num_stages) at headdim 128 in 16-bit types. Paths:
# "contiguous" (a cache row per sequence), "page-block" (pages a multiple of BLOCK_N, no left
# padding: a key block lies in one page), "page-row" (a page per key row: small pages). Chosen
# by a sweep of 12 tiles on the H200 (CUDA-graph GB/s of K/V read at
# bf16, 32 query heads, MHA and GQA-8, batch 1/8/64, cache 1k-128k); the numbers name points
# where the entry won or came within 2%:
DECODE_TILES = {
    ("contiguous", True): (128, 4, 2),  # MHA 1x32k 3626 GB/s, 1x128k 4017; GQA 8x32k 3996
    ("contiguous", False): (128, 4, 3),  # GQA 64x8k 4462 (stages 2: 3995), 64x128k 4659; MHA 64x32k 4580
    ("page-block", True): (128, 8, 2),  # page 256: MHA 1x32k 3662, 1x128k 4118; GQA 1x32k 2195
    ("page-block", False): (128, 8, 3),  # page 256: MHA 8x8k 4247, 64x32k 4550; GQA 64x8k 4403
    ("page-row", True): (128, 4, 2),  # page 16: MHA 1x128k 4000; GQA 8x32k 4000
    ("page-row", False): (128, 8, 2),  # page 16: MHA 8x8k 4043, 8x128k 4313, 64x32k 4309; GQA 64x128k 4317
    #                                      (64/4/3 wins at batch 64, 4513 and 4509, but loses 20% at batch 8)
    # Contiguous refinements, H200 sweep of 9 and 5 tiles (CUDA-graph GB/s,
    # median of 3 interleaved rounds, two runs for the non-split points):
    ("contiguous-short", True): (64, 4, 3),  # splits of <= SHORT_SPLIT keys: GQA 1x32k 2670 (128/4/2:
    #   2610), 1x8k 1444 (1389); MHA 1x8k 2769 (2685). Longer splits keep 128/4/2: GQA 8x32k (8k keys a
    #   split) 4249 vs 4225, MHA 1x128k (16k) 4431 vs 4399
    ("contiguous-many", False): (128, 4, 2),  # >= MANY_PROGRAMS programs (3 resident per SM, not 1):
    #   MHA 64x1k 4318 and 4320 (128/4/3: 4224, 4225), 64x8k 4629 (4545). With fewer, 128/4/3 stays:
    #   GQA 64x8k 4455 vs 3995, GQA 64x1k 3355 vs 3268, MHA 8x8k 4288 vs 4294
}
SHORT_SPLIT = 1024
MANY_PROGRAMS = 1024
# Batch-invariant mode (ops.invariance): one tile per (head dims, dtype) -- invariant_tiles -- and splits of a fixed
# number of keys, counted from each sequence's first key, every row through the combine, whose reduction over the
# splits has one fixed width (INVARIANT_MAX_SPLITS lanes: empty splits are exact zeros in fixed places). The
# interpreter splits every 32 keys, so that the CPU tests cross split boundaries. Not yet tuned on the GPU.
INVARIANT_SPLIT_KEYS = 4096
INVARIANT_SPLIT_KEYS_INTERP = 32
INVARIANT_MAX_SPLITS = 256
# A latent cache (MLA: v_cache the K cache's first column block, v_from_k; q/k wider than v by a second column
# block, 576 = 512 + 64; together past 512 columns) on sm90 in 16-bit types: (BLOCK_M, BLOCK_N, num_warps,
# num_stages) by BLOCK_M, the packed rows' power of two up to 64 (16, 32, 64); whole key blocks by TMA (kv_tma). H200
# sweeps, bf16, paged 64, CUDA graphs, 3 alternated rounds (bench/results/provenance-nvidia-h200.md, "latent cache");
# TFLOP/s count 2 * (576 + 512) per query head and key. The 64-row tile is the one whose wgmma spans the heads
# (ptxas: 255 registers and ~1 KB of spills beside the 64 x 512 fp32 accumulator, with TMA too):
LATENT_TILES = {
    64: (64, 64, 8, 2),  # TMA: h128 64x16k 221, 128x8k 221, 8x8k 146-148; h64 209-221 (s1 175-186; 64x32w8 s2 195,
    #                      s3 188; without TMA 64x64w8s1 169-172; the generic 16x32w8: 66, 66, 72, 64; 32x32w4 124-127)
    32: (32, 64, 8, 2),  # TMA: h32 64x16k 129 = 0.77x a device copy's GB/s (32x32w4 s2 122, s1 110; 16x32w4s2 106;
    #                      64x64w8s2 110)
    16: (16, 32, 4, 2),  # TMA: h16 64x16k 97 = 1.16x the copy's (s1 76-77; 16x64w8s2 84; without TMA 66; 16x32w8 57)
}


def v_from_k(cache: Cache, head_dim: int) -> bool:
    """Whether the V cache is the K cache's first column block (MLA: v_cache = k_cache[..., :512] of a 576-wide
    cache): the same memory and strides, v as wide as the block the kernel loads k's first columns in. The decode
    kernel then takes each key block's values from its keys' tile (V_FROM_K) instead of reading them again."""
    k, v = cache.k, cache.v
    first = column_parts(head_dim)[0]
    return (
        v.data_ptr() == k.data_ptr()
        and v.stride()[:3] == k.stride()[:3]
        and v.shape[-1] == min(head_dim, first)
        and block_d(v.shape[-1]) == first
    )


def _latent(cache: Cache, head_dim: int, head_dim_v: int) -> bool:
    """MLA's latent cache (LATENT_TILES): v the K cache's first 512 columns, q/k one more (rotary) block: 512 + 64
    as DeepSeek's (or 512 + 16, 512 + 32; the tiles were measured at 576/512)."""
    return _latent_dims(head_dim, head_dim_v) and v_from_k(cache, head_dim)


def _latent_dims(head_dim: int, head_dim_v: int) -> bool:
    """_latent's head dims: v 512 wide, q/k 512 and a second power-of-two block."""
    hi, lo = column_parts(head_dim)
    return head_dim_v == 512 and hi == 512 and lo > 0


def kv_tma(cache: Cache, latent: bool, block_n: int, elem_bytes: int, arch: str) -> bool:
    """Whether the decode kernel reads the whole key blocks of a latent cache (latent: _latent's answer) by TMA
    (KV_TMA): the LATENT_TILES calls (or the interpreter, with force(tma=True)), paged with pages of contiguous rows,
    a key block in one page, no left padding, TMA's alignment; force(tma=False) turns it off."""
    if not latent or not (arch == "interp" or (arch == "sm90" and elem_bytes == 2)):
        return False
    k = cache.k
    return (
        cache.block_table is not None
        and cache.leftpad is None
        and cache.page_size % block_n == 0
        and k.stride(0) == cache.page_size * k.stride(1)
        and use_tma(arch, k)
    )


def _path(cache: Cache, block_n: int) -> str:
    if cache.block_table is None:
        return "contiguous"
    if cache.leftpad is None and cache.page_size % block_n == 0:
        return "page-block"
    return "page-row"


def _width(head_dim: int) -> int:
    """The columns the decode kernel holds of q and k: their column blocks' (ops.geometry.column_parts: 576 as
    512 + 64, not 1024)."""
    return sum(column_parts(head_dim))


def _rows_block(rows: int) -> int:
    """The packed rows' power of two, 16 to 64: the rows a program takes before any register bound."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _chunked(capacity: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk) for about `splits` splits of the capacity: each split's keys a multiple of block_n, the count
    recomputed from that chunk (rounding can leave fewer)."""
    chunk = -(-capacity // (splits * block_n)) * block_n
    return -(-capacity // chunk), chunk


def _block_m(rows: int, head_dim: int = 128, head_dim_v: int = 128) -> int:
    """Rows per program: the packed rows, at most what keeps q and the fp32 accumulator of one program within 96 KB
    of registers (head dims past 256: 32 rows at 512/512, 16 for the MLA shape 576/512)."""
    block_m = _rows_block(rows)
    while block_m > 16 and block_m * (2 * _width(head_dim) + 4 * block_d(head_dim_v)) > 96 * 1024:
        block_m //= 2
    return block_m


def _tiles(
    rows: int,
    head_dim: int,
    interp: bool,
    elem_bytes: int = 2,
    path: str = "contiguous",
    split: bool = True,
    head_dim_v: int | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Decoding reads K/V once per group: the rows are
    few (group x seqlen_q), the keys many. Other head dims keep the bytes of a key block (K and V) of the
    headdim-128 entry; fp32 halves it and drops the pipeline so that headdim 256 fits the 99 KB
    of shared memory of sm86/89 (compile_check). head_dim_v: v's, when it differs from q's and k's."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    block_m = _block_m(rows, head_dim, head_dim_v)
    if interp:
        return block_m, 16, 1, 1
    block_n, warps, stages = DECODE_TILES[(path, split)]
    widths = max(64, _width(head_dim)) + max(64, block_d(head_dim_v))
    block_n = max(32, min(256, 1 << (block_n * 256 // widths).bit_length() - 1))  # a power of two, rounded down
    if elem_bytes == 4:
        return block_m, max(16, block_n // (4 if max(head_dim, head_dim_v) > 128 else 2)), 4, 1
    if widths > 512:  # past 256/256: one stage (a 32-key block of K and V is 64 KB at 512/512, 96 KB at 576/512)
        stages = 1
    return block_m, block_n, warps, stages


def num_splits_for(num_splits: int, programs: int, capacity: int, block_n: int, sm_count: int) -> int:
    """num_splits > 0: that many (at most MAX_SPLITS and one per key block). 0: when the batch
    alone does not fill the GPU, as many splits as keep the programs at or below two per SM, and
    at least one key block per split. Rounding up instead cost 5-12% wherever it pushed the
    programs past 2 x SMs (H200, CUDA-graph GB/s, median of 3: MHA 1 x 128k 9
    splits 4159 vs 8 splits 4423; GQA-8 batch 8 x 128k 5 splits 4279 vs 4 splits 4529); it tied
    or won at all 11 points swept (batch 1-8, cache 8k-128k, MHA and GQA-8). Short caches gain
    from splits of a single block: at 1k keys 8 splits against the former floor of four blocks
    per split (2): GQA-8 batch 1 345 vs 243 GB/s, MHA batch 1 997 vs 836; GQA-8 1 x 4k, 16
    splits 952 vs 8 splits 839."""
    n_blocks = max(1, -(-capacity // block_n))
    if num_splits > 0:
        return max(1, min(num_splits, n_blocks, MAX_SPLITS))
    if programs >= sm_count:
        return 1
    return max(1, min(MAX_SPLITS, 2 * sm_count // programs, n_blocks))


def invariant_tiles(head_dim: int, head_dim_v: int, elem_bytes: int, interp: bool) -> tuple[int, int, int, int]:
    """The batch-invariant mode's (BLOCK_M, BLOCK_N, num_warps, num_stages): a function of the head dims and the
    element size only (the contiguous split entry's, at 16 rows: the widest head dims' row count), so that every
    call of a model's attention -- prefill, decode, any batch, any cache layout -- runs the same tile."""
    return _tiles(16, head_dim, interp, elem_bytes, "contiguous", True, head_dim_v)


def _invariant_plan(cache: Cache, head_dim: int, head_dim_v: int, elem_bytes: int, interp: bool):
    block_m, block_n, warps, stages = invariant_tiles(head_dim, head_dim_v, elem_bytes, interp)
    chunk = INVARIANT_SPLIT_KEYS_INTERP if interp else INVARIANT_SPLIT_KEYS
    keys = cache.capacity if cache.max_keys is None else min(cache.max_keys, cache.capacity)
    splits = max(1, -(-keys // chunk))
    if splits > INVARIANT_MAX_SPLITS:
        raise NotImplementedError(
            f"batch-invariant mode: a sequence of up to {keys} keys (a cache's capacity, or the longest sequence) is "
            f"more than {INVARIANT_MAX_SPLITS} splits of {chunk} keys ({INVARIANT_MAX_SPLITS * chunk}); the mode's "
            "split-merging reduction has that fixed width"
        )
    return block_m, block_n, warps, stages, splits, chunk


def plan(
    cache: Cache,
    rows: int,
    batch: int,
    head_dim: int,
    elem_bytes: int,
    num_splits: int,
    sm_count: int,
    interp: bool,
    head_dim_v: int | None = None,
    arch: str | None = None,
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, splits, chunk) of a decode call: rows = group x
    seqlen_q rows per program; each split reads chunk keys (a multiple of BLOCK_N). head_dim_v: v's, when it
    differs from q's and k's; arch: the table's (planning.ARCHS), for the tiles measured on one."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if arch == "sm90" and elem_bytes == 2 and _latent(cache, head_dim, head_dim_v):
        block_m, block_n, warps, stages = LATENT_TILES[_rows_block(rows)]
        programs = -(-rows // block_m) * batch * cache.k.shape[2]
        splits = num_splits_for(num_splits, programs, cache.capacity, block_n, sm_count)
        return block_m, block_n, warps, stages, *_chunked(cache.capacity, splits, block_n)
    programs = -(-rows // _block_m(rows, head_dim, head_dim_v)) * batch * cache.k.shape[2]
    split = num_splits > 1 or (num_splits == 0 and programs < sm_count)
    # the tile's path; the kernel itself takes the one-page-per-block addressing when its
    # PAGE_SIZE and BLOCK_N allow it
    path = _path(cache, DECODE_TILES[("page-block", split)][0])
    if path == "contiguous" and not split and programs >= MANY_PROGRAMS:
        path = "contiguous-many"
    block_m, block_n, warps, stages = _tiles(rows, head_dim, interp, elem_bytes, path, split, head_dim_v)
    splits, chunk = _chunked(
        cache.capacity, num_splits_for(num_splits, programs, cache.capacity, block_n, sm_count), block_n
    )
    if path == "contiguous" and splits > 1 and chunk <= SHORT_SPLIT:
        # a smaller key block (it divides the chunk: both are powers of two, this one smaller)
        block_m, block_n, warps, stages = _tiles(
            rows, head_dim, interp, elem_bytes, "contiguous-short", True, head_dim_v
        )
    return block_m, block_n, warps, stages, splits, chunk


def forward(
    q: torch.Tensor,
    cache: Cache,
    seqlen_new: int,
    softmax_scale: float,
    mods: ScoreMods,
    num_splits: int,
    varlen_q: tuple[torch.Tensor, int] | None = None,
    check: Check | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, nheads, headdim) over the cache (after the append).
    Returns out like q and lse fp32 (batch, nheads, seqlen_q). With varlen_q = (cu_seqlens_q,
    max_seqlen_q), q is (total_q, nheads, headdim) and lse (nheads, total_q) (paged prefill).
    Values read from the cache tensors are clamped into range; with check, a value out of range
    also sets check.err."""
    nheads, head_dim = q.shape[-2:]
    head_dim_v = cache.v.shape[-1]
    if varlen_q is not None:
        cu_q, seqlen_q = varlen_q
        batch, total_q = cu_q.shape[0] - 1, q.shape[0]
        lse_shape = (nheads, total_q)
    else:
        batch, seqlen_q = q.shape[:2]
        lse_shape = (batch, nheads, seqlen_q)
    nheads_k = cache.k.shape[2]
    group = nheads // nheads_k
    interp = _runtime.interpreted()
    out_dtype = torch.float32 if interp else q.dtype
    out = _runtime.empty((*q.shape[:-1], head_dim_v), out_dtype, q.device)
    lse = _runtime.empty(lse_shape, torch.float32, q.device)
    if out.numel() == 0 or batch == 0 or seqlen_q == 0 or cache.capacity == 0:
        out.zero_(), lse.fill_(float("inf"))
        if mods.sinks is not None and cache.capacity == 0 and lse.numel():  # the rows see only the sink
            lse.copy_(mods.sinks[:, None].expand_as(lse))
        return out.to(q.dtype), lse
    sm_count = 64 if interp else _runtime.sm_count(q.device)
    arch = "interp" if interp else planning.arch_of(q.device)  # an unsupported GPU raises here
    rows = group * seqlen_q
    invariant = invariance.enabled()
    if invariant:  # num_splits (a speed knob) yields to the mode's fixed splits
        block_m, block_n, warps, stages, splits, chunk = _invariant_plan(
            cache, head_dim, head_dim_v, q.element_size(), interp
        )
    else:
        block_m, block_n, warps, stages, splits, chunk = plan(
            cache, rows, batch, head_dim, q.element_size(), num_splits, sm_count, interp, head_dim_v, arch
        )
    split = splits > 1 or invariant  # the mode merges even one split: every row's last steps are the combine's
    # strides (split, batch, query, head) of the output and (split, batch, head) of the lse; in
    # varlen the query index is the row of the packed tensor and the batch stride is 0
    if split:  # one allocation for both (host time: ~5 us per torch.empty on the H200's host)
        n_out = -(-splits * out.numel() // 4) * 4  # the lse part 16-byte aligned, as a fresh tensor is
        work = _runtime.empty((n_out + splits * lse.numel(),), torch.float32, q.device)
        dst = work[: splits * out.numel()].view(splits, *out.shape)
        dst_lse = work[n_out:].view(splits, *lse_shape)
    else:
        dst, dst_lse = out.unsqueeze(0), lse.unsqueeze(0)
    if varlen_q is not None:
        q_strides = (0, *q.stride()[:2])
        dst_strides = (dst.stride(0), 0, *dst.stride()[1:3])
        lse_strides = (dst_lse.stride(0), 0, dst_lse.stride(1))
    else:
        q_strides = q.stride()[:3]
        dst_strides = dst.stride()[:4]
        lse_strides = dst_lse.stride()[:3]
    runtime, flags = mods.kernel_args(seqlen_q, cache.capacity, lse)
    flags.pop("DROPOUT")
    upcast = interp or q.dtype == torch.float32
    if arch == "sm86" and upcast and _width(head_dim) + block_d(head_dim_v) > 1024:
        raise NotImplementedError(
            f"flash_attn_with_kvcache in fp32 with head dims {head_dim}/{head_dim_v} on {arch}: its smallest tile needs "
            "128 KB of shared memory, this GPU has 99 KB per block (fp16 and bf16 run)"
        )
    pdl = split and _runtime.PDL and arch == "sm90"
    values_from_keys = v_from_k(cache, head_dim)
    latent = values_from_keys and _latent_dims(head_dim, head_dim_v)
    tma = not invariant and kv_tma(cache, latent, block_n, q.element_size(), arch)
    row_blocks = -(-rows // block_m)
    if tma and not interp:
        _runtime.ensure_tma_allocator()
    kernels = _runtime.kernels().decode
    bt = cache.block_table
    k, v = cache.k, cache.v
    launcher.launch(
        kernels.attn_kvcache_kernel,
        (batch * nheads_k * row_blocks, 1, splits) if row_blocks > 1 else (batch * nheads_k, 1, splits),
        q,
        k,
        v,
        dst,
        dst_lse,
        cache.seqlens if cache.seqlens is not None else lse,
        cache.batch_idx if cache.batch_idx is not None else lse,
        cache.leftpad if cache.leftpad is not None else lse,
        bt if bt is not None else lse,
        runtime["Alibi"],
        runtime["Sinks"],
        varlen_q[0] if varlen_q is not None else lse,
        check.err if check is not None else lse,
        q_strides,
        k.stride()[:3],
        v.stride()[:3],
        dst_strides,
        lse_strides,
        bt.stride(0) if bt is not None else 0,
        runtime["stride_alibi_b"],
        (
            nheads,
            nheads_k,
            seqlen_q,
            seqlen_new,
            cache.seqlen_int,
            chunk,
            cache.capacity,
            k.shape[0],
            row_blocks,
            check.seqlen_limit if check is not None else cache.capacity,
        ),
        (runtime["window_left"], runtime["window_right"], softmax_scale, runtime["softcap"]),
        MODS=kernels.DecodeMods(**flags),
        CACHE=kernels.CacheLayout(
            PAGED=bt is not None,
            BATCH_IDX=cache.batch_idx is not None,
            LEFTPAD=cache.leftpad is not None,
            SEQLENS_TENSOR=cache.seqlens is not None,
            PAGE_SIZE=cache.page_size if bt is not None else 1,
        ),
        PATH=kernels.DecodePath(
            SPLIT=split,
            VARLEN_Q=varlen_q is not None,
            CHECK=check is not None,
            PDL=pdl,
            V_FROM_K=values_from_keys,
            ROW_BLOCKS_ADJACENT=row_blocks > 1,
            KV_TMA=tma,
        ),
        DOTS=kernels.DecodeDots(
            UPCAST=upcast,
            DOT_PRECISION="ieee" if upcast else "tf32",
            ROW_EXACT=invariant and interp,  # the interpreter's GEMM is not row-exact (kernels/decode.py)
        ),
        TILE=kernels.DecodeTile(
            HEAD_DIM=head_dim,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=column_parts(head_dim)[0],
            HEAD_DIM_V=head_dim_v,
            BLOCK_DV=block_d(head_dim_v),
            BLOCK_D_LO=column_parts(head_dim)[1],
        ),
        num_warps=warps,
        num_stages=stages,
    )
    if split:
        # rows (batch, query, head) of a contiguous out; varlen is one "batch" of total_q queries
        b_, sq_ = (1, total_q) if varlen_q is not None else (batch, seqlen_q)
        lse_b = 0 if varlen_q is not None else lse.stride(0)
        lse_h = lse.stride(0) if varlen_q is not None else lse.stride(1)
        launcher.launch(
            kernels.attn_combine_kernel,
            (b_ * sq_ * nheads,),
            dst,
            dst_lse,
            out,
            lse,
            runtime["Sinks"],
            dst.stride(0),
            (dst_lse.stride(0), lse_b, lse_h),
            (sq_, nheads, splits),
            SINK=flags["SINK"],
            HEAD_DIM=head_dim_v,
            BLOCK_S=INVARIANT_MAX_SPLITS if invariant else max(2, 1 << (splits - 1).bit_length()),
            CHUNK_S=16,
            BLOCK_D=block_d(head_dim_v),
            PDL=pdl,
            num_warps=2,
            launch_pdl=pdl,
        )
    if varlen_q is not None:
        known = checks.known(varlen_q[0])
        fill_tails((out, varlen_q[0], 0.0, 0, known), (lse, varlen_q[0], float("inf"), 1, known))
    return out.to(q.dtype), lse
