"""flash_attn_with_kvcache's launcher: append the new keys/values (rotated) into the cache,
rotate q, then attend over the cache, split over keys when the batch is too small to fill the
GPU, and merge the splits. The caller (ops.registry) makes q's device the current one, as
for the attention launchers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _runtime, launcher, planning, seqlens
from .geometry import block_d, column_parts, fill_tails
from .options import ScoreMods
from .planning import Plan
from .tables import INVARIANT_MAX_SPLITS
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


def mods(causal, left: int, right: int, softcap: float, alibi_slopes, sink) -> ScoreMods:
    """The KV-cache kernel's score modifiers (no dropout): alibi_slopes and the sink contiguous, as it reads them."""
    alibi = None if alibi_slopes is None else alibi_slopes.contiguous()
    sink = None if sink is None else sink.contiguous()
    return ScoreMods(bool(causal), left, right, softcap, alibi, 0.0, None, sink)


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


def forward(
    plan: Plan,
    q: torch.Tensor,
    cache: Cache,
    seqlen_new: int,
    softmax_scale: float,
    mods: ScoreMods,
    varlen_q: tuple[torch.Tensor, int] | None = None,
    check: Check | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, nheads, headdim) over the cache (after the append), as planned
    (ops.planning.decode: the tile, the splits, the combine, the load path).
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
    rows = group * seqlen_q
    block_m, block_n, warps, stages = plan.tile.block_m, plan.tile.block_n, plan.tile.num_warps, plan.tile.num_stages
    splits, chunk, split = plan.splits, plan.chunk, plan.combine
    invariant = plan.invariant
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
    pdl, values_from_keys, tma = plan.pdl, plan.v_from_k, plan.kv_tma
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
        known = seqlens.known(varlen_q[0])
        fill_tails((out, varlen_q[0], 0.0, 0, known), (lse, varlen_q[0], float("inf"), 1, known))
    return out.to(q.dtype), lse
