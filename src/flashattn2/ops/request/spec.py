"""A call described once: the spec every cache keys on.

A spec is built at the API boundary from a call's arguments, before anything is validated, and holds everything a
call's validation, plan and launch arguments depend on: each tensor's shape, strides, dtype and device, the options'
values, whether every input is 16-byte aligned (Triton and TMA specialize on it), the device's arch and the modes in
force (planning.force(), the batch-invariant mode). Two calls with equal specs are validated, planned and launched
alike, so a call whose spec was seen before goes straight to its launches (ops.run.call); a new option enters every key
by being a field here. What changes from call to call without changing any of that -- the tensors' data, a dropout
seed, an int cache_seqlens -- is not in the spec (an int cache_seqlens enters as Triton's class of it: see
int_class).

Specs are NamedTuples: frozen, hashable and cheap to build (a call builds one on every call). A builder raises
NotCanonical where an argument is not of the plain type a spec holds (a window given as a list, a max_seqlen given as
a tensor, a non-tensor where a tensor belongs): the caller then validates the arguments, which names the bad one or
normalizes them, and builds the spec from the normalized values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import invariance
from . import modes as modes_


class NotCanonical(Exception):
    """An argument is not of the type a spec holds: validate and normalize first."""


class TensorSpec(NamedTuple):
    """What a call's validation and launches read of a tensor: everything but its data."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def heads_adjacent(self) -> bool:
        """Whether a (..., heads, headdim) tensor's heads are adjacent rows of one matrix (TMA's 3-D boxes)."""
        return self.stride[-2] == self.shape[-1]


_new = tuple.__new__


def tensor(t) -> TensorSpec:
    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):  # (a Parameter is a tensor)
        raise NotCanonical
    return _new(TensorSpec, (t.shape, t.stride(), t.dtype, t.device))


def optional(t) -> TensorSpec | None:
    if t is None:
        return None
    if type(t) is torch.Tensor:
        return _new(TensorSpec, (t.shape, t.stride(), t.dtype, t.device))
    return tensor(t)


def aligned(*tensors) -> bool | tuple[bool, ...]:
    """True when every given tensor (None skipped) starts at a 16-byte boundary (Triton specializes a pointer on it,
    TMA needs it); else which of them do (a kernel compiled for one pattern is not another's)."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    if bits & 15 == 0:
        return True
    return tuple(t is None or t.data_ptr() & 15 == 0 for t in tensors)


def all_aligned(found: bool | tuple[bool, ...], first: int | None = None) -> bool:
    """Whether aligned() found every tensor (or the first `first` of them) aligned."""
    return found is True or all(found[:first])


def int_class(n: int) -> int:
    """What Triton specializes a runtime integer on: 1 (a constant), a multiple of 16, or neither (0, 16, 2)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 2


_NUMBERS = frozenset((int, float, bool))


def _number(x):
    if type(x) not in _NUMBERS:
        raise NotCanonical
    return x


def _window(window_size) -> tuple:
    if type(window_size) is not tuple or len(window_size) != 2:
        raise NotCanonical
    left, right = window_size
    if type(left) is not int or type(right) is not int:
        raise NotCanonical
    return window_size


class Modes(NamedTuple):
    """The modes a call runs under (each thread's or task's own): planning.force()'s state and the batch-invariant
    mode; and the device's arch the plan table is read for."""

    arch: str
    forced: modes_.Forced
    invariant: bool


def modes(t: torch.Tensor) -> Modes:
    """The modes of a call on t's device (is_cuda: torch.device.type costs more than the rest)."""
    arch = modes_.arch_of(t.device) if t.is_cuda else "interp"
    state = _INVARIANT.get()
    return _new(Modes, (arch, FORCED.get(), invariance._DEFAULT[0] if state is None else state))


FORCED, _INVARIANT = modes_.FORCED, invariance.STATE


class AttentionSpec(NamedTuple):
    """flash_attn_func, flash_attn_varlen_func and their packed forms (and the ops they run, ring blocks
    included): q, k, v dense (batch, seqlen, heads, headdim) or varlen (total, heads, headdim) with cu_seqlens."""

    varlen: bool
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    cu_seqlens_q: TensorSpec | None
    cu_seqlens_k: TensorSpec | None
    max_seqlen_q: int
    max_seqlen_k: int
    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: TensorSpec | None
    sink: TensorSpec | None
    deterministic: bool
    aligned: bool | tuple[bool, ...]  # aligned()'s answer for q, k, v, alibi_slopes, learnable_sink
    modes: Modes
    # an FP8 call's q_descale, k_descale, v_descale (each None: 1) and aligned()'s answer for them; None: none given
    descales: tuple | None = None


def descales(q_descale, k_descale, v_descale) -> tuple | None:
    """AttentionSpec.descales of FA3's three descale arguments."""
    if q_descale is None and k_descale is None and v_descale is None:
        return None
    return (
        optional(q_descale),
        optional(k_descale),
        optional(v_descale),
        aligned(q_descale, k_descale, v_descale),
    )


def descale_strides(descales: tuple) -> tuple:
    """The (batch, kv head) strides of each descale's spec, (0, 0) for one not given: the kernels' flat tuple."""
    return tuple(x for d in descales for x in (d.stride if d is not None else (0, 0)))


def attention(r) -> AttentionSpec:
    """The spec of an attention call from its request (ops.request.request.AttentionRequest; raises NotCanonical, see
    the module docstring)."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sink = (
        r.q, r.k, r.v, r.cu_seqlens_q, r.cu_seqlens_k, r.alibi_slopes, r.learnable_sink
    )  # fmt: skip
    qs = tensor(q)
    varlen = cu_seqlens_q is not None
    max_q, max_k = (r.max_seqlen_q, r.max_seqlen_k) if varlen else (0, 0)
    if varlen and (type(max_q) is not int or type(max_k) is not int):
        raise NotCanonical
    if varlen:
        cu_q = optional(cu_seqlens_q)
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else optional(cu_seqlens_k)  # self-attention's one tensor
    else:
        cu_q, cu_k = None, optional(cu_seqlens_k)
    q_descale, k_descale, v_descale = r.q_descale, r.k_descale, r.v_descale
    fp8 = q_descale is not None or k_descale is not None or v_descale is not None
    dropout_p, scale, causal, softcap, deterministic = (
        r.dropout_p, r.softmax_scale, r.causal, r.softcap, r.deterministic
    )  # fmt: skip
    if (
        type(dropout_p) not in _NUMBERS
        or (scale is not None and type(scale) not in _NUMBERS)
        or type(causal) not in _NUMBERS
        or type(softcap) not in _NUMBERS
        or type(deterministic) not in _NUMBERS
    ):
        raise NotCanonical
    return _new(
        AttentionSpec,
        (
            varlen,
            qs,
            tensor(k),
            tensor(v),
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p,
            scale,
            causal,
            _window(r.window_size),
            softcap,
            None if alibi is None else optional(alibi),
            None if sink is None else optional(sink),
            deterministic,
            aligned(q, k, v, alibi, sink),
            modes(q),
            descales(q_descale, k_descale, v_descale) if fp8 else None,
        ),
    )


class BackwardSpec(NamedTuple):
    """An attention call's backward: its forward's spec, the output's and its gradient's layouts, whether the logsumexp has a
    gradient, whether it must be deterministic, and where the gradients go (a packed tensor's views or their own)."""

    forward: AttentionSpec
    out: TensorSpec
    dout: TensorSpec
    dlse: bool
    deterministic: bool
    grads: tuple[TensorSpec, TensorSpec, TensorSpec]
    aligned: bool


class KVCacheSpec(NamedTuple):
    """flash_attn_with_kvcache: q over a contiguous or paged cache, with or without new keys to append first.
    cache_seqlens is a TensorSpec, or for an int its Triton class (int_class), or None."""

    q: TensorSpec
    k_cache: TensorSpec
    v_cache: TensorSpec
    v_from_k: bool  # v_cache starts where k_cache does (MLA's latent cache: a view of its first columns)
    k: TensorSpec | None
    v: TensorSpec | None
    rotary_cos: TensorSpec | None
    rotary_sin: TensorSpec | None
    cache_seqlens: TensorSpec | int | None
    cache_batch_idx: TensorSpec | None
    cache_leftpad: TensorSpec | None
    block_table: TensorSpec | None
    softmax_scale: float | None
    causal: bool
    window: tuple[int, int]
    softcap: float
    rotary_interleaved: bool
    alibi: TensorSpec | None
    num_splits: int
    sink: TensorSpec | None
    descales: tuple[TensorSpec | None, TensorSpec | None, TensorSpec | None]  # q's, k's, v's (FP8: FA3's descales)
    aligned: bool
    modes: Modes


def kvcache(r) -> KVCacheSpec:
    """The spec of a flash_attn_with_kvcache call from its request (ops.request.request.KVCacheRequest; raises
    NotCanonical)."""
    q, k_cache, v_cache, cache_seqlens = r.q, r.k_cache, r.v_cache, r.cache_seqlens
    qs = tensor(q)
    if type(cache_seqlens) is int:
        seqlens, cache_seqlens = int_class(cache_seqlens), None
    else:
        seqlens = optional(cache_seqlens)
    scale, causal, softcap, interleaved = r.softmax_scale, r.causal, r.softcap, r.rotary_interleaved
    if (
        type(r.num_splits) is not int
        or (scale is not None and type(scale) not in _NUMBERS)
        or type(causal) not in _NUMBERS
        or type(softcap) not in _NUMBERS
        or type(interleaved) not in _NUMBERS
    ):
        raise NotCanonical
    k, v, cos, sin, batch_idx, leftpad, table, alibi, sink = (
        r.k, r.v, r.rotary_cos, r.rotary_sin, r.cache_batch_idx, r.cache_leftpad, r.block_table, r.alibi_slopes,
        r.learnable_sink,
    )  # fmt: skip
    q_descale, k_descale, v_descale = r.q_descale, r.k_descale, r.v_descale
    return _new(
        KVCacheSpec,
        (
            qs,
            tensor(k_cache),
            tensor(v_cache),
            v_cache.data_ptr() == k_cache.data_ptr(),
            None if k is None else optional(k),
            None if v is None else optional(v),
            None if cos is None else optional(cos),
            None if sin is None else optional(sin),
            seqlens,
            None if batch_idx is None else optional(batch_idx),
            None if leftpad is None else optional(leftpad),
            None if table is None else optional(table),
            scale,
            causal,
            _window(r.window_size),
            softcap,
            interleaved,
            None if alibi is None else optional(alibi),
            r.num_splits,
            None if sink is None else optional(sink),
            (
                None if q_descale is None else optional(q_descale),
                None if k_descale is None else optional(k_descale),
                None if v_descale is None else optional(v_descale),
            ),
            aligned(
                q,
                k_cache,
                v_cache,
                k,
                v,
                cos,
                sin,
                cache_seqlens,
                batch_idx,
                leftpad,
                table,
                alibi,
                sink,
                q_descale,
                k_descale,
                v_descale,
            ),  # fmt: skip
            modes(q),
        ),
    )


class PagedSpec(NamedTuple):
    """flash_attn_varlen_func with block_table: varlen q over a paged K/V (forward only)."""

    q: TensorSpec
    k_cache: TensorSpec
    v_cache: TensorSpec
    cu_seqlens_q: TensorSpec
    cu_seqlens_k: TensorSpec
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: TensorSpec
    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: TensorSpec | None
    sink: TensorSpec | None
    aligned: bool
    modes: Modes


def paged(r) -> PagedSpec:
    """The spec of a paged varlen call from its request (ops.request.request.AttentionRequest with block_table; raises
    NotCanonical)."""
    q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table = (
        r.q, r.k, r.v, r.cu_seqlens_q, r.cu_seqlens_k, r.block_table
    )  # fmt: skip
    alibi_slopes, learnable_sink, max_seqlen_q, max_seqlen_k = (
        r.alibi_slopes,
        r.learnable_sink,
        r.max_seqlen_q,
        r.max_seqlen_k,
    )
    qs = tensor(q)
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        raise NotCanonical
    return _new(
        PagedSpec,
        (
            qs,
            tensor(k_cache),
            tensor(v_cache),
            tensor(cu_seqlens_q),
            tensor(cu_seqlens_k),
            max_seqlen_q,
            max_seqlen_k,
            tensor(block_table),
            _number(r.dropout_p),
            None if r.softmax_scale is None else _number(r.softmax_scale),
            _number(r.causal),
            _window(r.window_size),
            _number(r.softcap),
            optional(alibi_slopes),
            optional(learnable_sink),
            aligned(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, learnable_sink),
            modes(q),
        ),
    )
