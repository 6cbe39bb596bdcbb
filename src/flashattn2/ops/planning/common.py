"""What a plan is (Plan: dense and varlen attention; DecodePlan: the KV-cache kernel), what a call asks of a kernel
(Features), the one walker of every table (walk, first), and the rules every direction shares: the window's
resolution, the TMA load path's conditions, what the kernels write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..request import spec as specs
from ..request.checks import compute_dtype
from .geometry import block_d
from ..request.modes import Forced, TileConfig
from .tables import GLUON_KERNELS, TABLE

_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes


@dataclass(frozen=True)
class Features:
    """What a call asks of a kernel beyond its shape and dtype."""

    varlen: bool = False
    score_mods: bool = False  # a window (other than causal's), softcap, ALiBi or dropout
    # the Gluon kernels can run: a wgmma device (sm_90 exactly), a Triton they build on, every tensor with its heads
    # adjacent and TMA's 16-byte alignment; gluon_why says why not
    gluon: bool = False
    deterministic: bool = True  # backward: dQ in its own pass, bitwise-identical gradients run to run
    gluon_why: str = ""
    # the persistent Gluon forward's ring position, an int32 count a CTA runs on over all its tiles, holds the call
    persist_counter: bool = True


@dataclass(frozen=True)
class Plan:
    """What runs a dense or varlen attention call, and how it is launched: the kernel, its tile (and the dQ pass's),
    its constexprs beyond the call's own, the launch's num_warps, query rows per program (block_m x consumers), the
    Gluon backward's program order, and the Triton kernels' load path (tma: TMA descriptors, made by each program or,
    host_desc, on the host; else pointers)."""

    kernel: str
    tile: TileConfig
    why: str = ""
    causal: bool = False
    dq_tile: TileConfig | None = None
    constexprs: tuple[tuple[str, object], ...] = ()
    num_warps: int = 4
    consumers: int = 1
    # the Gluon backward's program order: 0, head-major; else heads in groups whose Q and dO fit this many bytes
    # (kernels/bwd_hopper_config.py's _ws_program; ops/launch/launch_gluon.bwd_grid)
    l2_group_bytes: int = 0
    tma: bool = False
    host_desc: bool = False
    fp8: str = ""  # float8_e4m3fn inputs: how their tiles meet the Triton forward's dots (constexprs.FP8_PATHS)

    @property
    def rows(self) -> int:
        return self.tile.block_m * self.consumers

    @property
    def gluon(self) -> bool:
        return self.kernel in GLUON_KERNELS

    @property
    def dsplit(self) -> int:
        """Programs each key / query block's dK, dV, dQ columns are split over (head dims past 256; the backward)."""
        return dict(self.constexprs).get("DSPLIT", 1)


@dataclass(frozen=True)
class DecodePlan:
    """What runs a call of the KV-cache kernel ("decode": flash_attn_with_kvcache, the paged prefill, the
    batch-invariant mode): its tile (block_m the packed rows per program), the key splits and the keys each reads
    (chunk), whether the split-merging kernel runs (combine) and as a programmatic dependent launch (pdl), whether
    whole key blocks arrive by TMA (kv_tma), whether the values are the keys' tile (v_from_k), and whether it is the
    batch-invariant mode's plan (every row through the combine, its fixed width)."""

    tile: TileConfig
    why: str
    splits: int
    chunk: int
    combine: bool
    pdl: bool
    kv_tma: bool
    v_from_k: bool
    invariant: bool
    kernel: str = "decode"


def walk(rows, facts: dict, requires=lambda row: None):
    """Each of `rows` in order with why it is passed over, None for a row that runs (the first such is the plan's):
    the row's conditions (tables.When) that the call's facts miss, and, when it has none, what its kernel requires
    (requires(row): why not, or None). The one walker of every table: the dense rows, the KV-cache kernel's rows and
    each kind of call's load paths."""
    for row in rows:
        unmet = [why for why in (when.unmet(facts) for when in row.when) if why]
        yield row, "; ".join(unmet) if unmet else requires(row)


def first(rows, facts: dict, requires=lambda row: None):
    """The first of `rows` that runs (walk). TABLE's lists and the load tables end with a row that runs everything;
    DECODE_ROWS' rows cover every value of its facts together."""
    for row, why_not in walk(rows, facts, requires):
        if why_not is None:
            return row
    raise AssertionError(f"no row for {facts}")


def head_dim_bucket(head_dim: int) -> int:
    return max(block_d(head_dim), 64)


def rows(arch: str | None = None):
    """TABLE's rows (of one arch if given): what the compile-only check builds."""
    return [row for row in TABLE if arch is None or row.arch == arch]


class Window(NamedTuple):
    """flash_attn's (causal, window_size) resolved: causal sets the right edge to 0; a window that is only that is the
    CAUSAL path, any other finite edge the LOCAL path. left and right are -1 where unbounded."""

    left: int
    right: int
    causal: bool
    local: bool


def window(causal: bool, left: int, right: int) -> Window:
    right = 0 if causal else right
    is_causal = left < 0 and right == 0
    return Window(left, right, is_causal, not is_causal and (left >= 0 or right >= 0))


def tma_ok(arch: str, forced: Forced, aligned: bool, *tensors: specs.TensorSpec) -> bool:
    """Whether the TMA load path may run: Hopper (or force(tma=True) anywhere), every base 16-byte aligned and every
    leading stride a 16-byte multiple (force(tma=False): never)."""
    if forced.tma is False or (forced.tma is None and arch != "sm90") or not aligned:
        return False
    for t in tensors:
        es = t.dtype.itemsize
        if any(s == 0 or (s * es) % 16 for s in t.stride[:-1]):
            return False
    return True


def tma_columns_ok(*tensors: specs.TensorSpec) -> bool:
    """Whether descriptors over (batch, seqlen, heads * headdim) views (host-built, and the Gluon kernels') address
    every column: TMA coordinates are int32, and a head's first column is head * headdim (the batch and row
    coordinates are below the grid's size and MAX_POSITIONS)."""
    return all(t.shape[-2] * t.shape[-1] < 2**31 for t in tensors)


def out_dtype(dtype: torch.dtype, arch: str) -> torch.dtype:
    """What the kernels write: the interpreter truncates fp32 -> 16-bit instead of rounding, so it writes fp32 and
    torch casts."""
    return torch.float32 if arch == "interp" else compute_dtype(dtype)
