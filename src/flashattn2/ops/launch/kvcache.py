"""The KV-cache kernels' launches: append the new keys/values (rotated) into the cache (Append), rotate q (rotate_q),
then attend over the cache, split over keys when the batch is too small to fill the GPU, and merge the splits
(Decode); made once per prepared call (ops.run.call), as planned (ops.planning.decode). The caller (ops.run.registry)
makes q's device the current one, as for the attention launchers."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _runtime
from . import launcher
from . import rotary as _rotary
from ..request import spec as specs
from ..planning.geometry import block_d, column_parts
from .launch_triton import TailFill
from ..request import checks
from ..request.checks import E4M3, compute_dtype
from ..request.modes import fp8_cvt
from .layout import contiguous_strides
from ..planning import DecodePlan, window
from ..planning.tables import INVARIANT_MAX_SPLITS

_new = tuple.__new__


class _AtCall:
    """A DecodeShape or AppendShape whose cache_seqlen and seqlen_limit are each call's (an int cache_seqlens, a Check's
    limit): the other fields split around those two once, so that a call makes it as one tuple, for a quarter of
    NamedTuple._replace's 1.5 us (on the path every step of transformers' decoding takes)."""

    __slots__ = ("cls", "head", "middle", "tail")

    def __init__(self, sizes):
        i, j = sizes._fields.index("cache_seqlen"), sizes._fields.index("seqlen_limit")
        assert i < j, "cache_seqlen before seqlen_limit"
        self.cls, self.head, self.middle, self.tail = type(sizes), sizes[:i], sizes[i + 1 : j], sizes[j + 1 :]

    def __call__(self, cache_seqlen: int, seqlen_limit: int):
        return _new(self.cls, (*self.head, cache_seqlen, *self.middle, seqlen_limit, *self.tail))


class Fp8(NamedTuple):
    """An FP8 call's facts for the KV-cache kernels (Shape.fp8): whether q is float8_e4m3fn codes, the dtype of the
    dots and the output (checks.compute_dtype: q's, bf16 for an e4m3 q), the descales' specs (q's, k's, v's: FA3's
    float32 (batch, nheads_k), None = 1). The cache is e4m3 when Shape.k's dtype is."""

    q: bool
    dtype: torch.dtype
    descales: tuple


NO_DESCALES = (None, None, None)


class Cache(NamedTuple):
    """The keys and values one call of Append and Decode reads and writes, and where: k and v (batch or cache rows,
    positions, nheads_k, head dim; pages with a block_table; Decode also takes plain keys, seqlen_int of them per
    sequence), the positions (seqlens int32 (batch,), or None and seqlen_int the one count), cache_batch_idx's rows,
    cache_leftpad, the block table, and the call's descales ((q, k, v), each None for 1: k's and v's quantize the
    16-bit k_new/v_new an FP8 cache takes, all three scale Decode's dots)."""

    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor | None
    seqlen_int: int
    batch_idx: torch.Tensor | None = None
    leftpad: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    descales: tuple = NO_DESCALES


def fp8_of(q_dtype: torch.dtype, cache_dtype: torch.dtype, descales: tuple) -> Fp8 | None:
    """Shape.fp8 of a call whose q and cache have these dtypes, with these descales' specs (None: no FP8 input)."""
    if q_dtype != E4M3 and cache_dtype != E4M3:
        return None
    return Fp8(q_dtype == E4M3, compute_dtype(q_dtype), descales)


def codes(t: torch.Tensor | None) -> torch.Tensor | None:
    """An e4m3 tensor as the kernels take it: its uint8 codes (a view: kernels/fp8.py decodes them on every arch)."""
    return t.view(torch.uint8) if t is not None and t.dtype == E4M3 else t


@dataclass(frozen=True)
class Check:
    """Device-side checking of the cache tensors' values: err (int32 (1,), zero) is set by a
    kernel that finds a value out of range; cache_seqlens may not exceed seqlen_limit (the
    capacity less the new tokens, and the rotary table's end less the positions rotated)."""

    err: torch.Tensor
    seqlen_limit: int
    key: object = None  # where the caller keeps err between calls


def value_check(q, capacity, k, rotary_cos, q_positions) -> Check | None:
    """The device-side check of the cache tensors' values (Check), or None while
    torch.compile traces or a CUDA graph is captured: a host read is not allowed there, and the
    kernels then only clamp the values into range."""
    # is_compiling first (host_reads_allowed's): Dynamo would otherwise guard on the switch and recompile when it flips
    if not checks.host_reads_allowed(q) or not checks.value_checks():
        return None
    seqlen_new = 0 if k is None else k.shape[1]
    limit = capacity - seqlen_new
    if rotary_cos is not None:
        limit = min(limit, rotary_cos.shape[0] - max(seqlen_new, q_positions))
    stream = torch._C._cuda_getCurrentRawStream(q.device.index) if q.device.type == "cuda" else 0
    key = (q.device, stream, threading.get_ident())
    return Check(_error_flag(key), limit, key)


# (device, stream, thread) -> a zero int32 flag for the kernels of a call: a call that finds it
# set zeroes it again before raising, one that fails otherwise drops it, so it is allocated and
# cleared once rather than per call. At most _ERROR_FLAGS_MAX streams and threads are kept.
_ERROR_FLAGS: dict = {}
_ERROR_FLAGS_MAX = 64
_ERROR_FLAGS_LOCK = threading.Lock()


def _error_flag(key) -> torch.Tensor:
    flag = _ERROR_FLAGS.get(key)
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=key[0])
        with _ERROR_FLAGS_LOCK:
            if len(_ERROR_FLAGS) >= _ERROR_FLAGS_MAX:
                _ERROR_FLAGS.clear()  # a call holding a dropped flag still has it through its Check
            _ERROR_FLAGS[key] = flag
    return flag


def drop_flag(key) -> None:
    """Forget key's flag (a call that failed may have left it set: the next call makes a new one)."""
    _ERROR_FLAGS.pop(key, None)


class Append:
    """kvcache_append_kernel as one prepared call launches it: k_new/v_new (batch, seqlen_new, nheads_k, headdim)
    written at positions cache_seqlens[b] + i, k rotated there first when the call has rotary tables. One kernel; with a
    Check every program first checks every sequence's values (cache_seqlens, cache_leftpad, cache_batch_idx, the pages
    written) and none writes if one is out of range; without, a write whose row, page or position is out of range is
    dropped (kvcache_append_kernel), so that a bad value never writes what another index names."""

    __slots__ = ("shape", "launch", "grid", "ints", "rotary", "torch_rotary", "interleaved", "empty", "table_rows",
                 "copy_k", "copy_v", "plain", "encode", "at_call")  # fmt: skip

    def __init__(self, shape: Shape, k_new: specs.TensorSpec, v_new: specs.TensorSpec, rotary, interleaved: bool,
                 arch: str):  # fmt: skip
        """rotary: the rotary tables' spec (rotary_cos's), or None."""
        self.shape = shape
        batch, seqlen_new, nheads_k, head_dim = k_new.shape
        head_dim_v = v_new.shape[-1]
        self.empty = batch == 0 or seqlen_new == 0
        # an FP8 cache from 16-bit k/v: quantized in the kernel (k after its rotation) with the call's descales
        fp8 = shape.fp8
        descales = fp8.descales[1:] if fp8 is not None else NO_DESCALES[1:]
        self.encode = shape.k.dtype == E4M3 and k_new.dtype != E4M3
        # the interpreter's fp32 -> 16-bit store truncates: it rotates in fp32 in torch, and rounds (an FP8 cache's
        # codes are made by integer arithmetic, exact there too: the kernel rotates)
        self.torch_rotary = rotary is not None and arch == "interp" and k_new.dtype != torch.float32 and not self.encode
        self.rotary = rotary is not None and not self.torch_rotary
        self.interleaved = interleaved
        block_t = min(16, 1 << (seqlen_new - 1).bit_length()) if seqlen_new else 1
        self.grid = (batch, -(-seqlen_new // block_t))
        # the kernel reads rows of k/v with unit stride: the new k and v are copied where theirs are not
        strides = [t.stride[:3] if t.stride[-1] == 1 else contiguous_strides(t.shape)[:3] for t in (k_new, v_new)]
        self.copy_k, self.copy_v = k_new.stride[-1] != 1, v_new.stride[-1] != 1
        if self.torch_rotary:
            strides[0] = contiguous_strides(k_new.shape)[:3]
        cos_rows = (rotary.shape[0], rotary.shape[1]) if self.rotary else (0, 0)
        cos_stride = rotary.shape[1] if self.rotary else strides[0][1]  # (the tables are made contiguous)
        self.table_rows = shape.k.shape[0]
        kernels = _runtime.kernels()
        sizes = kernels.append.AppendShape(
            batch=batch,
            nheads_k=nheads_k,
            seqlen_new=seqlen_new,
            cache_seqlen=None,  # the call's
            capacity=shape.capacity,
            n_rows=shape.k.shape[0],
            seqlen_limit=shape.capacity - seqlen_new,  # (a Check's own limit replaces it)
        )
        cos_shape = kernels.append.CosShape(seqlen_ro=cos_rows[0], half=cos_rows[1])
        self.ints = (*strides, shape.k.stride[:3], shape.v.stride[:3], shape.table_stride, cos_stride, sizes,
                     cos_shape, specs.descale_strides(descales))  # fmt: skip
        # the integer arguments of a call with a tensor cache_seqlens and no Check (the usual one), made once
        self.plain = (*self.ints[:6], sizes._replace(cache_seqlen=0), *self.ints[7:])
        self.at_call = _AtCall(sizes)
        kwargs = dict(
            CACHE=kernels.decode.CacheLayout(
                PAGED=bool(shape.page_size),
                BATCH_IDX=shape.batch_idx,
                LEFTPAD=shape.leftpad,
                SEQLENS_TENSOR=shape.seqlens_tensor,
                PAGE_SIZE=shape.page_size or 1,
            ),
            ROTARY=self.rotary,
            INTERLEAVED=self.rotary and interleaved,
            TILE=kernels.append.AppendTile(
                HEAD_DIM=head_dim,
                BLOCK_B=min(256, max(2, 1 << (batch - 1).bit_length())),
                BLOCK_T=block_t,
                BLOCK_D=block_d(head_dim),
                HEAD_DIM_V=head_dim_v,
                BLOCK_DV=block_d(head_dim_v),
            ),
            FP8=kernels.append.AppendFp8(
                ENCODE=self.encode, K_DESCALE=descales[0] is not None, V_DESCALE=descales[1] is not None
            ),
            num_warps=4 if head_dim * block_t >= 1024 else 2,
        )
        kernel = kernels.append.kvcache_append_kernel
        self.launch = {check: launcher.Launch(kernel, CHECK=check, **kwargs) for check in (False, True)}

    def __call__(self, k_new, v_new, cos, sin, cache: Cache, check: Check | None = None) -> None:
        """k_new and v_new written into cache.k and cache.v (cos/sin: the rotary tables, or None)."""
        if self.empty:
            return
        k_cache, v_cache, seqlens, seqlen_int, batch_idx, leftpad, block_table, descales = cache
        if self.copy_k:
            k_new = k_new.contiguous()
        if self.copy_v:
            v_new = v_new.contiguous()
        shape = self.shape
        if check is not None and block_table is not None:
            check_pages(block_table, self.table_rows, shape, seqlens, seqlen_int, check)
        if self.torch_rotary:
            offsets = seqlens if seqlens is not None else seqlen_int
            # a contiguous copy: the kernel was given contiguous strides for it
            rotated = k_new.to(torch.float32, memory_format=torch.contiguous_format)
            k_new = _rotary.rotate_(rotated, cos, sin, self.interleaved, offsets).to(k_new.dtype)
        if not self.rotary:
            cos = sin = k_new
        if check is None and seqlen_int == 0:
            ints = self.plain
        else:
            k_strides, v_strides, kc, vc, table, cos_stride, sizes, cos_shape, descale_strides = self.ints
            limit = sizes.seqlen_limit if check is None else check.seqlen_limit
            sizes = self.at_call(seqlen_int, limit)
            ints = (k_strides, v_strides, kc, vc, table, cos_stride, sizes, cos_shape, descale_strides)
        dummy = k_new
        _, k_descale, v_descale = descales
        self.launch[check is not None](
            self.grid, codes(k_new), codes(v_new), codes(k_cache), codes(v_cache), cos, sin,
            dummy if seqlens is None else seqlens,
            dummy if batch_idx is None else batch_idx,
            dummy if leftpad is None else leftpad,
            dummy if block_table is None else block_table,
            dummy if check is None else check.err,
            dummy if k_descale is None else k_descale,
            dummy if v_descale is None else v_descale,
            *ints,
        )  # fmt: skip


def check_pages(table, blocks: int, shape: Shape, seqlens, seqlen_int: int, check: Check) -> None:
    """Flag, on the device, block-table entries out of range among the pages each sequence uses (not only those the
    append writes or the attention reads: a window or left padding skips some). Before the append: its kernel reads
    the flag and writes nothing, so a bad page raises before any memory is touched; without one, before the
    attention (ops.run.registry.kvcache_forward)."""
    seqlen_new = shape.seqlen_new
    if seqlens is not None:
        ends = seqlens.clamp(0, shape.capacity - seqlen_new) + seqlen_new
    else:
        ends = torch.full((table.shape[0],), seqlen_int + seqlen_new, device=table.device)
    used = (ends + shape.page_size - 1) // shape.page_size
    cols = torch.arange(table.shape[1], device=table.device)
    bad = ((table < 0) | (table >= blocks)) & (cols[None, :] < used[:, None])
    check.err.copy_(bad.any().view(1))


def rotate_q(q: torch.Tensor, seqlens, seqlen_int: int, rotary, per_token: bool) -> torch.Tensor:
    """q rotated (a copy) at positions cache_seqlens[b] + i (per_token: causal or local), else every query of sequence
    b at position cache_seqlens[b]."""
    cos, sin, interleaved = rotary
    batch, seqlen_q, nheads, head_dim = q.shape
    offsets = seqlens if seqlens is not None else seqlen_int
    q = q.clone(memory_format=torch.contiguous_format)
    if per_token or seqlen_q == 1:
        return _rotary.rotate_(q, cos, sin, interleaved, offsets)
    # one position per sequence: its queries become heads of a single token
    _rotary.rotate_(q.view(batch, 1, seqlen_q * nheads, head_dim), cos, sin, interleaved, offsets)
    return q


class Shape(NamedTuple):
    """What a KV-cache call's launches read of its spec: the layouts of q (after rotation or a copy: `q_strides`) and
    the cache, the sizes, which index tensors come with each call, the score arguments. Built once per prepared call
    (ops.run.call) for flash_attn_with_kvcache, the paged prefill and the batch-invariant mode's attention."""

    q_shape: tuple
    q_strides: tuple  # (batch, row, head); varlen (paged prefill): (0, row, head)
    k: specs.TensorSpec
    v: specs.TensorSpec
    varlen: bool  # q packed (total_q, nheads, headdim) with cu_seqlens_q
    batch: int
    seqlen_q: int  # queries per sequence (varlen: the longest)
    capacity: int
    page_size: int  # 0: contiguous
    batch_idx: bool
    leftpad: bool
    seqlens_tensor: bool
    table_stride: int  # the block table's row stride (contiguous: its width)
    seqlen_new: int
    causal: bool
    left: int  # window edges, -1 unbounded
    right: int
    softcap: float
    scale: float
    alibi: specs.TensorSpec | None
    sink: bool
    fp8: Fp8 | None = None  # an e4m3 q or cache (fp8_of); None: q, k and v of one 16- or 32-bit dtype


def _q_strides(q: specs.TensorSpec, copied: bool) -> tuple:
    """q's (batch, row, head) strides as the kernel reads it: a contiguous copy's where the call copies it (rotated,
    or registry.for_kernels: a last dimension not contiguous, a broadcast dimension)."""
    if copied or q.stride[-1] != 1 or 0 in q.stride:
        return contiguous_strides(q.shape)[:3]
    return q.stride[:3]


def kvcache_shape(call) -> Shape:
    """flash_attn_with_kvcache's (ops.run.call.KVCacheCall)."""
    s = call.spec
    paged = s.block_table is not None
    rotated = s.k is not None and s.rotary_cos is not None
    return Shape(
        s.q.shape, _q_strides(s.q, rotated), s.k_cache, s.v_cache, False, s.q.shape[0], s.q.shape[1], call.capacity,
        s.k_cache.shape[1] if paged else 0, s.cache_batch_idx is not None, s.cache_leftpad is not None,
        isinstance(s.cache_seqlens, specs.TensorSpec), s.block_table.shape[1] if paged else 0, call.seqlen_new,
        bool(s.causal), call.left, call.right, float(s.softcap), call.scale, s.alibi, s.sink is not None,
        fp8_of(s.q.dtype, s.k_cache.dtype, s.descales),
    )  # fmt: skip


def paged_shape(call) -> Shape:
    """The paged prefill's (ops.run.call.PagedCall): sequence b's keys are its first cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] positions through block_table[b]."""
    s = call.spec
    q = _q_strides(s.q, False)
    return Shape(
        s.q.shape, (0, q[0], q[1]), s.k_cache, s.v_cache, True, s.cu_seqlens_q.shape[0] - 1, s.max_seqlen_q,
        s.block_table.shape[1] * s.k_cache.shape[1], s.k_cache.shape[1], False, False, True, s.block_table.shape[1],
        0, bool(s.causal), *s.window, float(s.softcap), call.scale, s.alibi, s.sink is not None,
    )  # fmt: skip


def invariant_shape(call, descales: tuple = NO_DESCALES) -> Shape:
    """The batch-invariant mode's attention (ops.run.attention): k and v as a cache -- dense: a contiguous cache of
    seqlen_k keys a sequence; varlen: one cache row holding every sequence, sequence b's keys from cu_seqlens_k[b] (its
    left padding) to cu_seqlens_k[b + 1] (its cache_seqlens). descales: an FP8 call's (q_descale, k_descale, v_descale)
    specs (specs.optional of each; (batch, nheads_k), varlen's batch the sequences), for e4m3 q, k and v: the Decode
    made with this shape then takes the tensors (Decode.__call__'s descales)."""
    s, o = call.spec, call.options
    q = _q_strides(s.q, False)
    if s.varlen:
        k, v = (specs.TensorSpec(torch.Size((1, *t.shape)), (t.shape[0] * t.stride[0], *t.stride), t.dtype, t.device)
                for t in (s.k, s.v))  # fmt: skip
        batch, seqlen_q, capacity, q_strides = s.cu_seqlens_q.shape[0] - 1, s.max_seqlen_q, s.k.shape[0], (0, *q[:2])
    else:
        k, v, batch, seqlen_q, capacity, q_strides = s.k, s.v, s.q.shape[0], s.q.shape[1], s.k.shape[1], q
    return Shape(
        s.q.shape, q_strides, k, v, s.varlen, batch, seqlen_q, capacity, 0, s.varlen, s.varlen, s.varlen, 0, 0,
        bool(s.causal), *s.window, float(s.softcap), o.softmax_scale, s.alibi, s.sink is not None,
        fp8_of(s.q.dtype, s.k.dtype, descales),
    )  # fmt: skip


class Decode:
    """attn_kvcache_kernel -- and attn_combine_kernel where the keys are split, the tail fill for a varlen q -- as one
    prepared call launches it (the plan: ops.planning.decode's tile, splits, combine and load path). Values read from
    the cache's index tensors are clamped into range; with a Check, a value out of range also sets its flag."""

    __slots__ = ("shape", "plan", "out_shape", "lse_shape", "out_dtype", "empty", "grid", "kernel", "combine",
                 "combine_grid", "ints", "plain", "score", "strides", "combine_ints", "tail", "sink_only", "work",
                 "dropped_lse", "result_dtype", "descale_strides", "at_call")  # fmt: skip

    def __init__(self, plan: DecodePlan, shape: Shape, arch: str):
        self.shape, self.plan = shape, plan
        nheads, head_dim = shape.q_shape[-2:]
        nheads_k, head_dim_v = shape.k.shape[2], shape.v.shape[-1]
        batch, seqlen_q = shape.batch, shape.seqlen_q
        self.out_shape = (*shape.q_shape[:-1], head_dim_v)
        self.lse_shape = (nheads, shape.q_shape[0]) if shape.varlen else (batch, nheads, seqlen_q)
        interp = arch == "interp"
        fp8 = shape.fp8
        # the dots' dtype and the output's: k's, or with an FP8 input checks.compute_dtype's (q's; bf16 for an e4m3 q)
        self.result_dtype = shape.k.dtype if fp8 is None else fp8.dtype
        descales = NO_DESCALES if fp8 is None else fp8.descales
        self.descale_strides = specs.descale_strides(descales)
        self.out_dtype = torch.float32 if interp else self.result_dtype
        out_numel = math.prod(self.out_shape)
        self.empty = out_numel == 0 or batch == 0 or seqlen_q == 0 or shape.capacity == 0
        self.sink_only = shape.sink and shape.capacity == 0 and math.prod(self.lse_shape) > 0
        tile, splits, split = plan.tile, plan.splits, plan.combine
        rows = nheads // nheads_k * seqlen_q
        row_blocks = -(-rows // tile.block_m)
        self.grid = (batch * nheads_k * row_blocks, 1, splits) if row_blocks > 1 else (batch * nheads_k, 1, splits)
        # the partial outputs (split, batch, query, head) and logsumexps (split, batch, head) of a split, and the
        # logsumexp, in one fp32 allocation (host time: ~5 us per torch.empty on the H200's host), each part 16-byte
        # aligned as a fresh tensor is; in varlen the query index is the row of the packed tensor, the batch stride 0
        lse_numel = math.prod(self.lse_shape)
        n_out = -(-splits * out_numel // 4) * 4
        n_lse = n_out + -(-splits * lse_numel // 4) * 4
        if split:  # (as_strided views: each costs a host what torch.empty does on the CPU, less on a GPU's host)
            self.work = (
                n_lse + lse_numel,
                ((splits, *self.out_shape), contiguous_strides((splits, *self.out_shape)), 0),
                ((splits, *self.lse_shape), contiguous_strides((splits, *self.lse_shape)), n_out),
                (self.lse_shape, contiguous_strides(self.lse_shape), n_lse),
            )
        else:
            self.work = None
        if split:
            dst = contiguous_strides((splits, *self.out_shape))
            dst_lse = contiguous_strides((splits, *self.lse_shape))
        else:
            dst = (0, *contiguous_strides(self.out_shape))
            dst_lse = (0, *contiguous_strides(self.lse_shape))
        if shape.varlen:
            dst_strides, lse_strides = (dst[0], 0, dst[1], dst[2]), (dst_lse[0], 0, dst_lse[1])
        else:
            dst_strides, lse_strides = dst[:4], dst_lse[:3]
        kernels = _runtime.kernels().decode
        self.ints = kernels.DecodeShape(
            nheads=nheads,
            nheads_k=nheads_k,
            seqlen_q=seqlen_q,
            seqlen_new=shape.seqlen_new,
            cache_seqlen=None,  # the call's
            chunk=plan.chunk,
            capacity=shape.capacity,
            n_rows=shape.k.shape[0],
            row_blocks=row_blocks,
            seqlen_limit=shape.capacity,  # (a Check's own limit replaces it)
        )
        self.plain = self.ints._replace(cache_seqlen=0)  # a tensor cache_seqlens and no Check: the usual call
        self.at_call = _AtCall(self.ints)
        self.strides = (shape.q_strides, shape.k.stride[:3], shape.v.stride[:3], dst_strides, lse_strides,
                        shape.table_stride, shape.alibi.shape[-1] if shape.alibi is not None and
                        len(shape.alibi.shape) == 2 else 0)  # fmt: skip
        w = window(shape.causal, shape.left, shape.right)
        # an unbounded edge: one that cannot bind; an edge past it binds no more (the batch-invariant mode's window is
        # an Options' when literal: any int), and taken as it keeps the kernel's position sums within int32
        far = seqlen_q + shape.capacity
        softcap = shape.softcap
        self.score = kernels.DecodeScore(
            window_left=min(w.left, far) if w.left >= 0 else far,
            window_right=min(w.right, far) if w.right >= 0 else far,
            sm_scale=shape.scale,
            softcap=softcap if softcap > 0 else 1.0,
        )
        upcast = interp or self.result_dtype == torch.float32
        kwargs = dict(
            MODS=kernels.DecodeMods(w.causal, w.local, softcap > 0, shape.alibi is not None, shape.sink),
            CACHE=kernels.CacheLayout(
                PAGED=bool(shape.page_size),
                BATCH_IDX=shape.batch_idx,
                LEFTPAD=shape.leftpad,
                SEQLENS_TENSOR=shape.seqlens_tensor,
                PAGE_SIZE=shape.page_size or 1,
            ),
            DOTS=kernels.DecodeDots(
                UPCAST=upcast,
                DOT_PRECISION="ieee" if upcast else "tf32",
                ROW_EXACT=plan.invariant and interp,  # the interpreter's GEMM is not row-exact (kernels/decode.py)
            ),
            TILE=kernels.DecodeTile(
                HEAD_DIM=head_dim,
                BLOCK_M=tile.block_m,
                BLOCK_N=tile.block_n,
                BLOCK_D=column_parts(head_dim)[0],
                HEAD_DIM_V=head_dim_v,
                BLOCK_DV=block_d(head_dim_v),
                BLOCK_D_LO=column_parts(head_dim)[1],
            ),
            FP8=kernels.DecodeFp8(
                Q_E4M3=fp8 is not None and fp8.q,
                KV_E4M3=shape.k.dtype == E4M3,
                Q_DESCALE=descales[0] is not None,
                K_DESCALE=descales[1] is not None,
                V_DESCALE=descales[2] is not None,
                NATIVE=fp8 is not None and fp8_cvt(shape.k.device, arch),
            ),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
        path = dict(SPLIT=split, VARLEN_Q=shape.varlen, PDL=plan.pdl, V_FROM_K=plan.v_from_k,
                    ROW_BLOCKS_ADJACENT=row_blocks > 1, KV_TMA=plan.kv_tma)  # fmt: skip
        self.kernel = {
            check: launcher.Launch(kernels.attn_kvcache_kernel, PATH=kernels.DecodePath(**path, CHECK=check), **kwargs)
            for check in (False, True)
        }
        self.combine = None
        if split:
            # rows (batch, query, head) of a contiguous out; varlen is one "batch" of total_q queries
            b_, sq_ = (1, shape.q_shape[0]) if shape.varlen else (batch, seqlen_q)
            lse = contiguous_strides(self.lse_shape)
            lse_b, lse_h = (0, lse[0]) if shape.varlen else (lse[0], lse[1])
            self.combine_grid = (b_ * sq_ * nheads,)
            sizes = kernels.CombineShape(seqlen_q=sq_, nheads=nheads, num_splits=splits)
            self.combine_ints = (dst[0], (dst_lse[0], lse_b, lse_h), sizes)
            self.combine = launcher.Launch(
                kernels.attn_combine_kernel,
                SINK=shape.sink,
                HEAD_DIM=head_dim_v,
                BLOCK_S=INVARIANT_MAX_SPLITS if plan.invariant else max(2, 1 << (splits - 1).bit_length()),
                CHUNK_S=16,
                BLOCK_D=block_d(head_dim_v),
                PDL=plan.pdl,
                num_warps=2,
                launch_pdl=plan.pdl,
            )
        self.dropped_lse = None  # the logsumexp of calls that drop it, without splits (_runtime.output_lse)
        self.tail = None
        if shape.varlen:
            self.tail = TailFill(
                batch,
                (self.out_shape, contiguous_strides(self.out_shape), 0.0, 0),
                (self.lse_shape, contiguous_strides(self.lse_shape), float("inf"), 1),
            )

    def __call__(self, q, cache: Cache, cu_q=None, alibi=None, sinks=None, check: Check | None = None,
                 lse_wanted: bool = True):  # fmt: skip
        """(out like q in q's dtype -- bf16 for an e4m3 q --, lse fp32 (batch, nheads, seqlen_q), or (nheads,
        total_q) with a varlen q (cu_q)). lse_wanted False: the caller drops the logsumexp (_runtime.output_lse). q
        and the cache's k and v may be float8_e4m3fn as Shape.fp8 says (passed as they are: the kernel gets their uint8
        codes); cache.descales: float32 (batch, nheads_k) tensors or None, the ones Shape.fp8's specs describe."""
        k, v, seqlens, seqlen_int, batch_idx, leftpad, block_table, descales = cache
        out = _runtime.empty(self.out_shape, self.out_dtype, q.device)
        if self.work is not None:
            total, dst, dst_lse, lse = self.work
            work = _runtime.empty((total,), torch.float32, q.device)
            dst, dst_lse, lse = work.as_strided(*dst), work.as_strided(*dst_lse), work.as_strided(*lse)
        else:
            lse = _runtime.output_lse(self, self.lse_shape, q.device, lse_wanted)
            dst, dst_lse = out, lse
        if self.empty:
            out.zero_(), lse.fill_(float("inf"))
            if self.sink_only:  # the rows see only the sink (a varlen q's rows past its sequences: nothing)
                lse.copy_(sinks[:, None].expand_as(lse))
                if self.tail is not None:
                    self.tail((out, cu_q), (lse, cu_q))
            return out.to(self.result_dtype), lse
        if self.plan.kv_tma and q.device.type == "cuda":
            _runtime.ensure_tma_allocator()
        if check is None and seqlen_int == 0:
            ints = self.plain
        else:
            limit = self.ints.seqlen_limit if check is None else check.seqlen_limit
            ints = self.at_call(seqlen_int, limit)
        q_descale, k_descale, v_descale = descales
        self.kernel[check is not None](
            self.grid, codes(q), codes(k), codes(v), dst, dst_lse,
            lse if seqlens is None else seqlens,
            lse if batch_idx is None else batch_idx,
            lse if leftpad is None else leftpad,
            lse if block_table is None else block_table,
            lse if alibi is None else alibi,
            lse if sinks is None else sinks,
            lse if cu_q is None else cu_q,
            lse if check is None else check.err,
            lse if q_descale is None else q_descale,
            lse if k_descale is None else k_descale,
            lse if v_descale is None else v_descale,
            *self.strides, ints, self.score, self.descale_strides,
        )  # fmt: skip
        if self.combine is not None:
            self.combine(self.combine_grid, dst, dst_lse, out, lse, lse if sinks is None else sinks, *self.combine_ints)
        if self.tail is not None:
            self.tail((out, cu_q), (lse, cu_q))
        return (out if out.dtype is self.result_dtype else out.to(self.result_dtype)), lse
