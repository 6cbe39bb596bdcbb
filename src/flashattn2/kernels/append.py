"""Appending the new keys and values to a KV cache (flash_attn_with_kvcache's k and v; ops.launch.kvcache.append_): one
kernel for every cache layout (kernels/decode.py's CacheLayout), k rotated on the way. An FP8 cache (AppendFp8) takes
e4m3 codes as uint8: new k/v in e4m3 are copied as they are; in 16-bit types they are quantized here, k after its
rotation (in fp32): e4m3(x / descale), kernels.fp8.e4m3_encode's exact rounding (torch's and FA3's)."""

from typing import NamedTuple

import triton
import triton.language as tl

from .fp8 import e4m3_encode


class AppendTile(NamedTuple):
    """kvcache_append_kernel's head dims and tile (ops.launch.kvcache.append_)."""

    HEAD_DIM: int  # k's head dim
    BLOCK_B: int  # sequences _values_out_of_range checks at a time
    BLOCK_T: int  # new tokens per program
    BLOCK_D: int  # k's columns, a power of two
    HEAD_DIM_V: int  # v's head dim
    BLOCK_DV: int  # v's columns, a power of two


class AppendFp8(NamedTuple):
    """kvcache_append_kernel over an FP8 cache (ops.launch.kvcache.Append)."""

    ENCODE: bool  # the new k/v are 16-bit, the cache e4m3 codes: quantized on the way
    K_DESCALE: bool  # KDescale[b, h] divides the new k before it is rounded (else 1)
    V_DESCALE: bool


# The run-time bundles: each flattens into one scalar parameter per field, in field order; the launcher
# (ops.launch.kvcache.Append) builds them by keyword, the kernel reads them by name.
class AppendShape(NamedTuple):
    """kvcache_append_kernel's sizes (`shape`)."""

    batch: int  # sequences
    nheads_k: int  # K/V heads
    seqlen_new: int  # new tokens per sequence
    cache_seqlen: int  # keys in the cache before them (CACHE.SEQLENS_TENSOR: each sequence's from CacheSeqlens)
    capacity: int  # positions of a cache row (paged: of a sequence's pages)
    n_rows: int  # cache rows (paged: pages)
    seqlen_limit: int  # the largest cache_seqlen in range (CHECK)


class CosShape(NamedTuple):
    """kvcache_append_kernel's rotary table (`cos_shape`; ROTARY)."""

    seqlen_ro: int  # the table's rows (positions)
    half: int  # the rotated feature pairs (the table's columns)


@triton.jit
def _quantized(x, descale_ptr, DESCALE: tl.constexpr):
    """x (any float type) as e4m3 codes of x / descale (descale_ptr's value, or 1): fp32's division, then e4m3's
    rounding (reference.fp8.quantize's two roundings, in that order)."""
    x = x.to(tl.float32)
    if DESCALE:
        x = x / tl.load(descale_ptr)
    return e4m3_encode(x)


@triton.jit
def _values_out_of_range(
    CacheSeqlens, CacheBatchIdx, LeftPad, block_table, shape, CACHE: tl.constexpr, BLOCK_B: tl.constexpr
):
    """Whether any sequence has cache_seqlens outside [0, seqlen_limit], left padding outside
    [0, cache_seqlens], a cache row that does not exist, or a page it writes to (positions
    cache_seqlens .. + seqlen_new) that does not exist. block_table: (BlockTable, stride_bt); shape: an AppendShape."""
    BlockTable, stride_bt = block_table
    batch, seqlen_new, n_rows = shape.batch, shape.seqlen_new, shape.n_rows
    PAGE_SIZE: tl.constexpr = CACHE.PAGE_SIZE
    bad = tl.zeros([BLOCK_B], dtype=tl.int1)
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        b_ok = bs < batch
        if CACHE.SEQLENS_TENSOR:
            sl = tl.load(CacheSeqlens + bs, mask=b_ok, other=0)
        else:
            sl = tl.zeros([BLOCK_B], dtype=tl.int32) + shape.cache_seqlen
        sl_bad = (sl < 0) | (sl > shape.seqlen_limit)
        bad |= b_ok & sl_bad
        if CACHE.LEFTPAD:
            pad = tl.load(LeftPad + bs, mask=b_ok, other=0)
            bad |= b_ok & ((pad < 0) | (pad > sl))
        if CACHE.BATCH_IDX:
            row = tl.load(CacheBatchIdx + bs, mask=b_ok, other=0)
            bad |= b_ok & ((row < 0) | (row >= n_rows))
        if CACHE.PAGED:
            live_b = b_ok & ~sl_bad
            first = tl.where(live_b, sl, 0) // PAGE_SIZE
            last = (tl.where(live_b, sl, 0) + seqlen_new - 1) // PAGE_SIZE
            for p in range(0, (seqlen_new - 1) // PAGE_SIZE + 2):
                live = live_b & (first + p <= last)
                page = tl.load(BlockTable + bs.to(tl.int64) * stride_bt + first + p, mask=live, other=0)
                bad |= live & ((page < 0) | (page >= n_rows))
    return tl.max(bad.to(tl.int32), 0) > 0


@triton.jit
def kvcache_append_kernel(
    KNew,
    VNew,
    K,
    V,
    Cos,
    Sin,
    CacheSeqlens,
    CacheBatchIdx,
    LeftPad,
    BlockTable,
    Err,
    KDescale,
    VDescale,
    knew_strides,  # (batch, token, head)
    vnew_strides,
    k_strides,  # (batch or page, position, head)
    v_strides,
    stride_bt,
    stride_cs,
    shape,  # AppendShape
    cos_shape,  # CosShape
    descale_strides,  # (batch, kv head) of KDescale and VDescale: four strides
    CHECK: tl.constexpr,
    CACHE: tl.constexpr,
    ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Write the new keys/values of sequence program_id(0), tokens [program_id(1) * BLOCK_T, ...),
    into the cache at positions cache_seqlens[b] + t; ROTARY rotates k first (GPT-NeoX halves or
    GPT-J pairs of the first 2 * half features, by the angle of its position, in fp32, rounded
    once). CHECK: every program first checks every sequence's values (and Err, set by the
    page check that runs before it) and none writes when one is out of range (Err is set
    instead), so a bad call leaves the cache untouched. Without CHECK a write whose target is
    out of range is dropped, never clamped onto memory another index names: a sequence whose
    cache row does not exist writes nothing, a token whose position falls outside [0, capacity)
    or on a page that does not exist is not written (the other tokens are). Left padding never
    steers a write. FP8.ENCODE: k (rotated) and v quantized to the cache's e4m3 codes with sequence b's descale of
    each head."""
    stride_nb, stride_ns, stride_nh = knew_strides
    stride_wb, stride_ws, stride_wh = vnew_strides
    stride_kb, stride_ks, stride_kh = k_strides
    stride_vb, stride_vs, stride_vh = v_strides
    seqlen_new, capacity, n_rows = shape.seqlen_new, shape.capacity, shape.n_rows
    cache_seqlen = shape.cache_seqlen  # (CACHE.SEQLENS_TENSOR: the sequence's)
    seqlen_ro, half = cos_shape.seqlen_ro, cos_shape.half
    sk_b, sk_h, sv_b, sv_h = descale_strides
    PAGE_SIZE: tl.constexpr = CACHE.PAGE_SIZE
    HEAD_DIM: tl.constexpr = TILE.HEAD_DIM
    BLOCK_T: tl.constexpr = TILE.BLOCK_T
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM_V: tl.constexpr = TILE.HEAD_DIM_V
    BLOCK_DV: tl.constexpr = TILE.BLOCK_DV
    off_b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    if CHECK:  # Err may already be set by the host's page check (ops.launch.kvcache._check_pages_read)
        if _values_out_of_range(
            CacheSeqlens, CacheBatchIdx, LeftPad, (BlockTable, stride_bt), shape, CACHE, TILE.BLOCK_B
        ) | (tl.load(Err) != 0):
            tl.store(Err, 1)
            return
    if CACHE.SEQLENS_TENSOR:
        cache_seqlen = tl.load(CacheSeqlens + off_b)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    # token t goes to position cache_seqlen + t when that is in [0, capacity), else nowhere; a cache_seqlen outside
    # [-seqlen_new, capacity] places no token there, so it is clamped into that range first (the sums stay in int32)
    pos = tl.minimum(tl.maximum(cache_seqlen, -seqlen_new), capacity) + t
    t_ok = (t < seqlen_new) & (pos >= 0) & (pos < capacity)
    if CACHE.PAGED:
        page = tl.load(BlockTable + off_b * stride_bt + pos // PAGE_SIZE, mask=t_ok, other=0)
        t_ok &= (page >= 0) & (page < n_rows)  # (a dropped token's address is never followed)
        page = page.to(tl.int64)
        k_rows = K + page * stride_kb + (pos % PAGE_SIZE).to(tl.int64) * stride_ks
        v_rows = V + page * stride_vb + (pos % PAGE_SIZE).to(tl.int64) * stride_vs
    else:
        row = off_b
        if CACHE.BATCH_IDX:
            row = tl.load(CacheBatchIdx + off_b)
            if (row < 0) | (row >= n_rows):  # a sequence without a cache row appends nothing
                return
            row = row.to(tl.int64)
        k_rows = K + row * stride_kb + pos.to(tl.int64) * stride_ks
        v_rows = V + row * stride_vb + pos.to(tl.int64) * stride_vs
    cols = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (cols < HEAD_DIM)[None, :]
    cols_v = tl.arange(0, BLOCK_DV)
    mask_v = t_ok[:, None] & (cols_v < HEAD_DIM_V)[None, :]
    t64 = t.to(tl.int64)
    if ROTARY:
        rot = cols < 2 * half
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            partner = cols ^ 1
            angle = cols // 2
            sign = tl.where(cols % 2 == 0, -1.0, 1.0)
        else:  # halves (j, j + half)
            partner = tl.where(cols < half, cols + half, cols - half)
            angle = tl.where(cols < half, cols, cols - half)
            sign = tl.where(cols < half, -1.0, 1.0)
        partner = tl.where(rot, partner, cols)
        cs_mask = mask & rot[None, :] & (pos < seqlen_ro)[:, None]
        cs_off = pos.to(tl.int64)[:, None] * stride_cs + angle[None, :]
        c = tl.load(Cos + cs_off, mask=cs_mask, other=1.0).to(tl.float32)
        s = tl.load(Sin + cs_off, mask=cs_mask, other=0.0).to(tl.float32) * sign[None, :]
    # head h's rows: the pointers move one head stride a head (h * stride in int32 wraps past 2**31 elements)
    src = KNew + off_b * stride_nb + t64[:, None] * stride_ns
    src_v = VNew + off_b * stride_wb + t64[:, None] * stride_ws
    dst = k_rows[:, None]
    dst_v = v_rows[:, None]
    k_descale = KDescale + off_b * sk_b
    v_descale = VDescale + off_b * sv_b
    for _ in range(0, shape.nheads_k):
        x = tl.load(src + cols[None, :], mask=mask, other=0.0)
        if ROTARY:
            x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x.to(tl.float32) * c + x_partner * s
        if FP8.ENCODE:
            x = _quantized(x, k_descale, FP8.K_DESCALE)
        tl.store(dst + cols[None, :], x.to(K.dtype.element_ty), mask=mask)
        val = tl.load(src_v + cols_v[None, :], mask=mask_v, other=0.0)
        if FP8.ENCODE:
            val = _quantized(val, v_descale, FP8.V_DESCALE)
        tl.store(dst_v + cols_v[None, :], val, mask=mask_v)
        src += stride_nh
        src_v += stride_wh
        dst += stride_kh
        dst_v += stride_vh
        k_descale += sk_h
        v_descale += sv_h
