"""What is remembered of a cu_seqlens tensor between calls, without reading it back from the GPU.

Every varlen call clamps its cu_seqlens into the rows on the device (in_range), so the kernels stay in bounds
whatever the values. Beside that, per tensor and computed once on the device: the sequences longest first (the
grid's order), and, when the opt-in value checks read the values on the host, (last value, longest sequence) --
what lets a call skip filling the rows past the last sequence. An entry holds while its tensor lives and is not
modified in place: torch bumps the version counter of a tensor and its views on every in-place op. Writes that bypass
the counter (through .data, numpy or DLPack, or a custom kernel) are not seen: the kernels still read the new values
(clamped on every call), but a checked tensor's new values go unchecked and the grid's order may be stale. Inference
tensors have no counter and are never remembered.

Safe under concurrent calls: readers take an entry in one dict read, writers replace entries and evict under a lock.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch


class Seen(NamedTuple):
    """What is remembered of one cu_seqlens tensor."""

    ref: weakref.ref
    version: int  # torch's version counter when remembered
    data_ptr: int
    values: tuple[int, int] | None  # (last value, longest sequence) when read on the host, else None
    order: torch.Tensor  # the sequence indices longest first, int32 on the tensor's device


_new = tuple.__new__
_SEEN: dict[int, Seen] = {}  # id(cu_seqlens) -> Seen
_SEEN_MAX = 64
_LOCK = threading.Lock()


# the attribute of a clamped copy in_range made, what is remembered of it (no weakref, lock or eviction: it lives as
# long as the copy, which only flashattn2 holds)
_OWN = "_flashattn2_seen"


def entry(cu: torch.Tensor) -> Seen | None:
    own = getattr(cu, _OWN, None)
    if own is not None:
        return own if own.version == cu._version else None
    seen = _SEEN.get(id(cu))
    if seen is None or seen.ref() is not cu:  # (an inference tensor is never remembered: see remember)
        return None
    return seen if seen.version == cu._version and seen.data_ptr == cu.data_ptr() else None


def known(cu: torch.Tensor) -> tuple[int, int] | None:
    """(cu[-1], max sequence length) of a cu_seqlens tensor checked earlier and unchanged since, or None."""
    return remembered(cu)[0]


def remembered(cu: torch.Tensor) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """(known(cu), the sequence indices longest first (int32, on cu's device)), or (None, None) for a cu_seqlens not
    seen earlier or modified since; (None, order) for one whose values were not read."""
    seen = entry(cu)
    return (None, None) if seen is None else (seen.values, seen.order)


def remember(cu: torch.Tensor, values, order: torch.Tensor) -> None:
    if getattr(cu, _OWN, None) is not None:  # a clamped copy in_range made: remembered on itself
        setattr(cu, _OWN, _new(Seen, (None, cu._version, 0, values, order)))
        return
    # a tensor made under torch.inference_mode has no version counter to trust; under it, order is one too
    if cu.is_inference() or torch.is_inference_mode_enabled():
        return
    seen = _new(Seen, (weakref.ref(cu), cu._version, cu.data_ptr(), values, order))
    with _LOCK:
        if len(_SEEN) >= _SEEN_MAX:
            dead = [key for key, old in _SEEN.items() if old.ref() is None]
            for key in dead or [next(iter(_SEEN))]:
                _SEEN.pop(key, None)
        _SEEN[id(cu)] = seen


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def in_range(cu: torch.Tensor, rows: int) -> torch.Tensor:
    """cu_seqlens with its values clamped into [0, rows] on the device, without reading them: the kernels then
    stay within the rows whatever the values. The clamp runs on every call (a copy kept from an earlier call
    would miss writes torch does not see, and a smaller row count). Beside it, the sequences longest first (the
    grid's order) are computed on the device once per tensor and remembered, for the clamped copy too (the kernels
    and the backward look that up); an order gone stale only reorders the grid. Nothing is remembered while
    torch.compile traces, a CUDA graph is captured or inference mode is on (the grid then keeps the sequences' own
    order)."""
    clamped = cu.clamp(0, rows)
    if torch.compiler.is_compiling() or _capturing(cu) or torch.is_inference_mode_enabled() or cu.is_inference():
        return clamped
    seen = entry(cu)
    if seen is None:
        lengths = clamped[1:] - clamped[:-1]
        order = torch.argsort(lengths, descending=True, stable=True).to(torch.int32)
        remember(cu, None, order)
        values = None
    else:  # values read earlier stay true of the copy when they lie within the rows
        values, order = (seen.values if seen.values and seen.values[0] <= rows else None), seen.order
    setattr(clamped, _OWN, _new(Seen, (None, clamped._version, 0, values, order)))
    return clamped
