"""Which kernel, tile and load path run a call: one function over the plan table.

    plan(spec) -> Plan (dense, varlen) | DecodePlan (the KV-cache kernel)

for every call a spec describes (ops.request.spec): dense, packed and varlen attention forward (AttentionSpec) and
backward (BackwardSpec), the KV-cache kernel (KVCacheSpec: decoding, chunked prefill; its tiles, splits and load path),
the paged prefill (PagedSpec), the batch-invariant mode (any of them under it), and the blocks of the context-parallel
ring (attention calls of their own). The rows are data in ops.planning.tables, each with the measurement that chose it;
`explain(spec)` prints the plan and the rows passed over, with why. Dense rows: TABLE's rows for (direction, arch,
head-dim bucket, bytes per element) in order, the first whose kernel the call can run (REQUIRES) and whose causal,
key-length and value-head-dim bounds hold; every list ends with a Triton row that runs everything. KV-cache rows:
DECODE_ROWS in order, the first whose facts the call has (decode_facts). The load paths are rows too
(ATTENTION_LOADS, DECODE_LOADS), and one walker matches every table (common.walk: a row's When conditions on the
call's facts).

Forcing a plan (A/Bs, tests): `with force(fwd=TileConfig(...), hopper=False, arch="sm80"): ...` (ops.request.modes). The
environment has one switch here: FLASHATTN2_HOPPER (ops._runtime.gluon_switch): 0 turns the Gluon (Hopper) kernels
off, 1 runs them on a Triton release they were not measured on.

The second step of a call (ops.request before it, ops.launch after): the table (tables.py), the rows' geometry the
kernels' blocks follow (geometry.py), the dense and KV-cache facts and plans (dense.py, decoding.py), the plan types
and the walker (common.py).
"""

from __future__ import annotations

import torch

from ..request import spec as specs
from ..request.modes import (  # noqa: F401  (the API of plans)
    ARCHS,
    KERNELS,
    Forced,
    TileConfig,
    arch_of,
    entered,
    force,
    forced,
    fp8_cvt,
    native_arch,
    parse_tile,
    wgmma,
)
from .tables import (  # noqa: F401  (TABLE and its types are read through this module)
    ATTENTION_LOADS,
    DECODE_LOADS,
    DECODE_ROWS,
    GLUON_FP8_HEAD_DIMS,
    GLUON_HEAD_DIMS,
    GLUON_KERNELS,
    HEAD_DIM_BUCKETS,
    INVARIANT_MAX_SPLITS,
    INVARIANT_SPLIT_KEYS,
    INVARIANT_SPLIT_KEYS_INTERP,
    INTERP,
    L2_GROUP_BYTES,
    MANY_PROGRAMS,
    MAX_SPLITS,
    SHORT_SPLIT,
    TABLE,
    UNSUPPORTED,
    DecodeRow,
    Row,
)
from ...kernels.constexprs import FP8_PATHS
from .common import DecodePlan, Features, Plan, Window, head_dim_bucket, out_dtype, rows, tma_ok, window  # noqa: F401
from .decoding import (  # noqa: F401
    Cache,
    decode,
    decode_facts,
    decode_row,
    decode_tile,
    invariant_cache,
    kvcache_cache,
    latent_dims,
    paged_cache,
    v_from_k,
)
from .dense import REQUIRES, _derive, _lookup, lookup, out_spec  # noqa: F401  (tests, the compile check, explain)
from . import common, decoding, dense  # noqa: F401  (tests patch their constants)

DIRECTIONS = ("fwd", "bwd")


def plan(spec) -> Plan | DecodePlan:
    """The plan of a call its spec describes (the module docstring)."""
    if isinstance(spec, specs.AttentionSpec):
        if spec.modes.invariant:
            return _decode_of(invariant_cache(spec), spec.modes, 0, spec.q.device)
        return dense.forward(spec)
    if isinstance(spec, specs.BackwardSpec):
        return dense.backward(spec)
    if isinstance(spec, specs.KVCacheSpec):
        return _decode_of(kvcache_cache(spec), spec.modes, spec.num_splits, spec.q.device)
    if isinstance(spec, specs.PagedSpec):
        return _decode_of(paged_cache(spec), spec.modes, 0, spec.q.device)
    raise TypeError(f"plan: not a call spec: {type(spec).__name__}")


def _decode_of(c: Cache, modes: specs.Modes, num_splits: int, device: torch.device) -> DecodePlan:
    return decode(c, modes.arch, modes.forced, modes.invariant, num_splits, decoding.sm_count(device, modes.arch))


def _call(spec) -> str:
    """One line of what a spec describes: the call, its inputs' shapes and dtype, its options."""
    s = spec.forward if isinstance(spec, specs.BackwardSpec) else spec
    if isinstance(s, specs.AttentionSpec):
        kind, k = ("varlen" if s.varlen else "dense") + (" backward" if s is not spec else " forward"), s.k
    else:
        k = s.k_cache
        kind = (
            "paged prefill" if isinstance(s, specs.PagedSpec) else "KV cache" + (" (append)" if s.k is not None else "")
        )
    dtype = lambda t: str(t.dtype).removeprefix("torch.")
    k_dtype = "" if k.dtype == s.q.dtype else f" {dtype(k)}"  # (an FP8 cache read by 16-bit queries)
    parts = [f"{kind} {dtype(s.q)} q {tuple(s.q.shape)}{k_dtype} k {tuple(k.shape)}"]
    parts += [name for name, on in (("causal", s.causal), ("ALiBi", s.alibi is not None), ("sink", s.sink is not None))
              if on]  # fmt: skip
    if s.window != (-1, -1):
        parts.append(f"window {s.window}")
    if s.softcap:
        parts.append(f"softcap {s.softcap}")
    if getattr(s, "dropout_p", 0.0):
        parts.append(f"dropout {s.dropout_p}")
    if isinstance(s, specs.AttentionSpec) and s.modes.invariant:
        parts.append("batch-invariant")
    return ", ".join(parts)


def explain(spec) -> str:
    """The plan of a call and the rows passed over, with why: what `flashattn2.explain` prints."""
    chosen = plan(spec)
    lines = [f"{type(spec).__name__} on {spec_arch(spec)}: {chosen.kernel} {chosen.tile}", "  call: " + _call(spec)]
    if (
        isinstance(spec, specs.AttentionSpec)
        and spec.modes.invariant
        or not isinstance(spec, (specs.AttentionSpec, specs.BackwardSpec))
    ):
        c = (
            invariant_cache(spec)
            if isinstance(spec, specs.AttentionSpec)
            else kvcache_cache(spec)
            if isinstance(spec, specs.KVCacheSpec)
            else paged_cache(spec)
        )
        modes = spec.modes
        num_splits = spec.num_splits if isinstance(spec, specs.KVCacheSpec) else 0
        facts = decode_facts(c, modes.arch, modes.invariant, num_splits, decoding.sm_count(spec.q.device, modes.arch))
        walk = list(decoding.walk(facts))
        loads = decoding.load_facts(c, modes.arch, modes.forced, modes.invariant, chosen.tile)
        lines.append("  facts: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        lines.append(
            f"  splits {chosen.splits} of {chosen.chunk} keys, combine {chosen.combine}, pdl {chosen.pdl}, "
            f"kv_tma {chosen.kv_tma}, v_from_k {chosen.v_from_k}"
        )
        lines += _loads(DECODE_LOADS, loads)
        if facts["fp8"]:
            lines.append(f"  fp8: {_cache_fp8(spec)}")
        describe = lambda row: " ".join(f"{k}={v}" for k, v in row.when) + f" {row.tile}"  # noqa: E731
    else:
        b = spec if isinstance(spec, specs.BackwardSpec) else None
        s = spec.forward if b is not None else spec
        asked, loads = (
            dense.attention_plan(s, "bwd", b.deterministic, (b.dout, *b.grads), b.aligned)
            if b is not None
            else dense.attention_plan(s, "fwd", True)
        )
        walk = list(dense.walk(asked))
        lines.append("  facts: " + ", ".join(f"{k}={v}" for k, v in dense.facts(asked).items()))
        if not chosen.gluon:
            lines += _loads(ATTENTION_LOADS, dense.load_facts(chosen, loads))
        if chosen.fp8:
            lines.append(f"  fp8: {FP8_PATHS[chosen.fp8]}")
        describe = lambda row: f"{row.kernel} {row.tile}"  # noqa: E731  (its unmet conditions follow)
    lines.append(f"  why: {chosen.why}")
    for row, why_not in walk:
        if why_not is None:
            break
        lines.append(f"  passed over: {describe(row)}: {why_not}")
    return "\n".join(lines)


def _loads(table, facts: dict) -> list[str]:
    """explain's lines of a call's load path: the one it takes, with why, and those passed over, with why not."""
    lines = []
    for row, why_not in common.walk(table, facts):
        if why_not is None:
            return [f"  load path: {row.path}: {row.why}", *lines]
        lines.append(f"  load path passed over: {row.path}: {why_not}")
    raise AssertionError("every load-path table ends with pointer loads")


def _cache_fp8(spec) -> str:
    """How the decode kernel converts an FP8 call's e4m3 codes (the call line names the dtypes)."""
    cache = spec.k_cache if isinstance(spec, specs.KVCacheSpec) else spec.k
    if fp8_cvt(cache.device, spec.modes.arch):
        return "e4m3 codes converted by cvt (the GPU's e4m3 type, sm_89+)"
    return "e4m3 codes converted by integer arithmetic (kernels.fp8.e4m3_decode)"


def spec_arch(spec) -> str:
    return (spec.forward if isinstance(spec, specs.BackwardSpec) else spec).modes.arch
