"""The dense and varlen attention plans: TABLE's rows for (direction, arch, head-dim bucket, bytes per element) in
order, the first whose conditions hold on the call's facts (plain causal or not, a key-length and a value-head-dim
bound, the Gluon switch: Row.when) and whose kernel the call can run (REQUIRES: why not); every list ends with a
Triton row that runs everything. The Triton kernels' load path is ATTENTION_LOADS' first row whose load_facts hold
(host-built descriptors, per-program TMA, pointers); whether the Gluon kernels can run comes from the spec."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from ...errors import ArgumentError
from .. import _runtime
from ..request import spec as specs
from .geometry import block_d
from ...kernels.constexprs import FP8_BF16, FP8_DOTS, FP8_DOTS_INTERP, FP8_FP32, FP8_NONE
from ..request.checks import E4M3
from ..request.modes import Forced, fp8_dots, forced, wgmma
from .tables import ATTENTION_LOADS, GLUON_FP8_HEAD_DIMS, GLUON_HEAD_DIMS, L2_GROUP_BYTES, ROWS, UNSUPPORTED, Row
from . import common
from .common import _GRID_YZ, Features, Plan, head_dim_bucket, out_dtype, tma_columns_ok, tma_ok, window
from .decoding import sm_count


class Asked(NamedTuple):
    """What the dense table's rows are matched against: a call's direction and sizes, its features, what force()
    holds (hashable: the plans are cached by it)."""

    arch: str
    dtype: torch.dtype
    head_dim: int
    causal: bool  # plain causal: causal without a window
    max_seqlen_k: int
    features: Features
    direction: str  # "fwd" or "bwd"
    head_dim_v: int
    forced: Forced


def _gluon_requires(direction: str):
    """Why a call cannot run the Gluon kernels of `direction`, or None: they take dense fp16/bf16 inputs with a
    (q/k, v) head-dim pair of GLUON_HEAD_DIMS (the forward: e4m3 ones too, GLUON_FP8_HEAD_DIMS), causal or not and
    no other score modification, keys present, on a device and tensors they run on (Features.gluon)."""

    def why_not(a: Asked) -> str | None:
        fp8 = a.dtype == E4M3 and direction == "fwd"
        pairs = GLUON_FP8_HEAD_DIMS if fp8 else GLUON_HEAD_DIMS[direction]
        if a.features.varlen:
            return "varlen: the Gluon kernels take dense inputs"
        if a.features.score_mods:
            return "a window, softcap, ALiBi or dropout: the Gluon kernels take a causal mask or none"
        if (a.head_dim, a.head_dim_v) not in pairs:
            return (
                f"head dims {a.head_dim}/{a.head_dim_v}: the Gluon kernels take "
                + ", ".join(f"{d}/{dv}" for d, dv in pairs)
                + (" on e4m3 inputs" if fp8 else "")
            )
        if a.dtype not in (torch.float16, torch.bfloat16) and not fp8:
            return f"{a.dtype}: the Gluon kernels take fp16 and bf16" + (
                " (the forward: e4m3 too)" if direction == "bwd" else ""
            )
        if a.max_seqlen_k == 0:
            return "no keys"
        if not a.features.gluon:
            return a.features.gluon_why
        return None

    return why_not


def _gluon_bwd(a: Asked) -> str | None:
    if a.features.deterministic:
        return "deterministic: the Gluon backward adds dQ in any order"
    if -(-a.max_seqlen_k // 64) > _GRID_YZ:  # its key blocks (64 keys at least) on the grid's second axis
        return f"{a.max_seqlen_k} keys: more key blocks than a grid's second axis holds"
    return _GLUON_BWD(a)


def _gluon_persist(a: Asked) -> str | None:
    if not a.features.persist_counter:
        return "a CTA's key blocks past 2**31: the persistent kernel counts its ring positions in int32"
    return _GLUON_FWD(a)


_GLUON_FWD, _GLUON_BWD = _gluon_requires("fwd"), _gluon_requires("bwd")
# kernel -> why a call (Asked) cannot run it, None when it can; the Triton kernels run everything
REQUIRES = {
    "fwd": lambda a: None,
    "bwd_dkdv": lambda a: None,
    "fwd_hopper_persist": _gluon_persist,
    "fwd_hopper_ws": _GLUON_FWD,
    "bwd_hopper": _gluon_bwd,
}


def facts(asked: Asked) -> dict:
    """The facts the dense rows' conditions (Row.when) name: plain_causal, keys (max_seqlen_k), v_bucket (v's head-dim
    bucket), hopper (the Gluon kernels on: FLASHATTN2_HOPPER and force(hopper=...))."""
    hopper = asked.forced.hopper if asked.forced.hopper is not None else _runtime.gluon_switch() is not False
    return {
        "plain_causal": asked.causal,
        "keys": asked.max_seqlen_k,
        "v_bucket": head_dim_bucket(asked.head_dim_v),
        "hopper": hopper,
    }


def _rows(asked: Asked) -> tuple[Row, ...]:
    """TABLE's rows of the call's (direction, arch, head-dim bucket, bytes per element)."""
    key = (asked.direction, asked.arch, head_dim_bucket(max(asked.head_dim, asked.head_dim_v)), asked.dtype.itemsize)
    if key in UNSUPPORTED:
        raise NotImplementedError(
            f"flashattn2 on {asked.arch}, {asked.dtype}, head dim {asked.head_dim}, {asked.direction}: "
            + UNSUPPORTED[key]
        )
    return ROWS[key]


def walk(asked: Asked):
    """TABLE's rows for the call in order, each with why it is passed over (None: it runs): their conditions on the
    call's facts, then what each row's kernel requires (common.walk)."""
    return common.walk(_rows(asked), facts(asked), lambda row: REQUIRES[row.kernel](asked))


def lookup(
    arch: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool,
    max_seqlen_k: int,
    features: Features,
    direction: str,
    head_dim_v: int | None = None,
) -> Plan:
    """TABLE's plan for a call with these features, under what force() holds (the tile and kernel part of plan();
    tests read the table through it)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return _lookup(Asked(arch, dtype, head_dim, causal, max_seqlen_k, features, direction, head_dim_v, forced()))


@functools.lru_cache(maxsize=4096)
def _lookup(asked: Asked) -> Plan:
    row = common.first(_rows(asked), facts(asked), lambda row: REQUIRES[row.kernel](asked))
    return _derive(row, asked.forced, asked.causal)


def _derive(row: Row, forced: Forced, causal: bool) -> Plan:
    """The row's plan with forced tiles in place and the constexprs that follow from the tile."""
    tile = forced.tile(row.kernel) or row.tile
    constexprs = dict(row.constexprs)
    num_warps, consumers, l2 = tile.num_warps, 1, 0
    if row.kernel == "fwd_hopper_persist":
        if tile.num_warps not in (8, 12):
            raise ArgumentError(
                f"fwd_hopper_persist: num_warps counts the consumer warps (8 or 12), got {tile.num_warps}"
            )
        consumers = tile.num_warps // 4
        # 4: the default partition's warps (the producer); snake order under a causal mask
        constexprs.update(QBUF=tile.qbuf or 2, SNAKE=causal, CONSUMERS=consumers)
        num_warps = 4
    elif row.kernel == "fwd_hopper_ws":
        consumers = 2
    elif row.kernel == "bwd_hopper":
        if constexprs["DO_STAGES"] is None:
            constexprs["DO_STAGES"] = tile.num_stages
        grouped = forced.bwd_order == "grouped" or (forced.bwd_order is None and causal)
        l2 = L2_GROUP_BYTES if grouped else 0
    dq_tile = (forced.tile("bwd_dq") or row.dq_tile) if row.kernel == "bwd_dkdv" else None
    return Plan(row.kernel, tile, row.why, causal, dq_tile, tuple(constexprs.items()), num_warps, consumers, l2)


def _gluon_ready(direction: str, s: specs.AttentionSpec, *tensors: specs.TensorSpec) -> tuple[bool, str]:
    """(Features.gluon, why not): sm_90 exactly (wgmma, which sm_100 lacks), the Gluon module for `direction` importing
    under this Triton, and every tensor with its heads adjacent in memory (3-D descriptors over (batch, seqlen,
    heads * headdim)) and TMA's alignment (a `v = k[..., :dv]` view has heads that are not adjacent)."""
    arch, forced_ = s.modes.arch, s.modes.forced
    if arch != "sm90":
        return False, f"arch {arch}: the Gluon kernels are sm_90's"
    if not (s.q.device.type == "meta" or wgmma(s.q.device)):  # (meta: explain's device of the spec's arch)
        return False, "not an sm_90 device (the Gluon kernels use wgmma)"
    if not all(t.heads_adjacent for t in tensors):
        return False, "a tensor's heads are not adjacent in memory (the Gluon kernels' 3-D TMA boxes)"
    if not tma_ok(arch, forced_, specs.all_aligned(s.aligned, 3), *tensors):
        return False, "a tensor not 16-byte aligned, or TMA forced off"
    if not tma_columns_ok(*tensors):
        return False, "nheads * headdim of 2**31 or more: past TMA's int32 coordinates"
    hopper = _runtime.hopper_kernels()
    if hopper is None or getattr(hopper, direction) is None:
        # not asked for the Triton kernels: say what is lost (on a GPU; explain's meta tensors run nothing)
        if forced_.hopper is not False and s.q.device.type != "meta":
            _runtime.warn_without_gluon(direction)
        return False, "the Gluon kernels do not run on this Triton release (README: compatibility)"
    return True, ""


def _persist_counter(s: specs.AttentionSpec) -> bool:
    """Whether the persistent Gluon forward's ring position, an int32 count a CTA runs on over its tiles (each
    advances it by its key blocks + 1: kernels/fwd_hopper_persist.py), stays below 2**31: its tiles (at least 128 query
    rows: two consumers of 64) over one CTA per SM, each with up to cdiv(seqlen_k, 64) + 1 positions."""
    batch, seqlen_q, nheads = s.q.shape[:3]
    tiles = -(-seqlen_q // 128) * batch * nheads
    per_cta = -(-tiles // max(1, min(tiles, sm_count(s.q.device, s.modes.arch))))
    return per_cta * (-(-s.k.shape[1] // 64) + 1) < 2**31


def out_spec(s: specs.AttentionSpec, dtype: torch.dtype) -> specs.TensorSpec:
    """The fresh output's layout: contiguous, q's shape with v's head dim."""
    shape = (*s.q.shape[:-1], s.v.shape[-1])
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return specs.TensorSpec(torch.Size(shape), stride, dtype, s.q.device)


def attention_plan(s: specs.AttentionSpec, direction: str, deterministic: bool, extra=(), aligned=True):
    """The dense/varlen plan of an attention call's forward, or of its backward (extra: dout and the gradients'
    specs); returns (what the table's rows are matched against, the facts of its loads but the row's: load_facts)."""
    arch, forced_ = s.modes.arch, s.modes.forced
    w = window(s.causal, *s.window)
    score_mods = w.local or s.softcap > 0 or s.alibi is not None or s.dropout_p > 0
    max_seqlen_k = s.max_seqlen_k if s.varlen else s.k.shape[1]
    out = out_spec(s, out_dtype(s.q.dtype, arch))
    tensors = (s.q, s.k, s.v, out, *extra)
    gluon, gluon_why = False, "varlen: the Gluon kernels take dense inputs"
    fp8 = s.q.dtype == E4M3
    pairs = GLUON_FP8_HEAD_DIMS if fp8 else GLUON_HEAD_DIMS[direction]
    if fp8 and (direction != "fwd" or fp8_mode(s) != FP8_DOTS):
        gluon_why = "FP8: the Gluon forward takes e4m3 into its dots on an sm_90 device"
    elif not s.varlen and (s.q.shape[-1], s.v.shape[-1]) in pairs:
        gluon, gluon_why = _gluon_ready(direction, s, s.q, s.k, s.v, *extra[:1])
    persist = not (gluon and direction == "fwd") or _persist_counter(s)
    features = Features(s.varlen, score_mods, gluon, deterministic, gluon_why, persist)
    asked = Asked(
        arch=arch, dtype=s.q.dtype, head_dim=s.q.shape[-1], causal=w.causal, max_seqlen_k=max_seqlen_k,
        features=features, direction=direction, head_dim_v=s.v.shape[-1], forced=forced_,
    )  # fmt: skip
    loads = {
        "tma": tma_ok(arch, forced_, specs.all_aligned(s.aligned, 3) and specs.all_aligned(aligned), *tensors),
        "host_desc_off": forced_.host_desc is False,
        "varlen": s.varlen,
        "pow2_heads_adjacent": all(t.shape[-1] == block_d(t.shape[-1]) and t.heads_adjacent for t in tensors),
        "columns_int32": tma_columns_ok(*tensors),
        # (FP8 on the Triton path: V goes transposed, not by host-built descriptors: kernels/fwd.vt_src)
        "fp8": fp8,
    }
    return asked, loads


def load_facts(plan: Plan, loads: dict) -> dict:
    """The facts ATTENTION_LOADS' rows name: attention_plan's and the row's column split (dsplit: past 256 each
    block's columns are split over programs, whose chunks are pointer loads)."""
    return {**loads, "dsplit": plan.dsplit}


def _with_loads(plan: Plan, loads: dict) -> Plan:
    if plan.gluon:  # (host-built descriptors, always)
        return plan
    path = common.first(ATTENTION_LOADS, load_facts(plan, loads)).path
    return replace(plan, tma=path != "pointers", host_desc=path == "host_desc")


def fp8_mode(s: specs.AttentionSpec) -> str:
    """How an FP8 call's e4m3 tiles meet the Triton forward's dots (constexprs.FP8_PATHS; FP8_NONE for other dtypes).
    q/k head dims under 32 take the decoded path: 8-bit dots need K >= 32."""
    if s.q.dtype != E4M3:
        return FP8_NONE
    interp = s.modes.arch == "interp"
    if fp8_dots(s.q.device, s.modes.arch) and s.q.shape[-1] >= 32:
        return FP8_DOTS_INTERP if interp else FP8_DOTS
    return FP8_FP32 if interp else FP8_BF16


def forward(s: specs.AttentionSpec) -> Plan:
    asked, loads = attention_plan(s, "fwd", True)
    fp8 = fp8_mode(s)
    return _with_loads(replace(_lookup(asked), fp8=fp8) if fp8 else _lookup(asked), loads)


def backward(b: specs.BackwardSpec) -> Plan:
    asked, loads = attention_plan(b.forward, "bwd", b.deterministic, (b.dout, *b.grads), b.aligned)
    return _with_loads(_lookup(asked), loads)
