"""flashattn2.explain: which kernel, tile and load path a call runs, and the rows of the plan table passed over, with
why (ops.planning.explain over the call's spec).

    flashattn2.explain(q, k, v, causal=True)                              # flash_attn_func (and its backward)
    flashattn2.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n)   # varlen
    flashattn2.explain(q, k_cache, v_cache, kvcache=True, cache_seqlens=seqlens, k=k_new, v=v_new)  # decoding
    flashattn2.explain(q, k, v, arch="sm90")    # meta tensors: what an H100/H200 (sm90), A100 (sm80), other (sm86) runs

The tensors may be on the "meta" device (no memory): the plan is then the one `arch` runs (default "sm90"), on a
device of that arch's size; a GPU's own name (sm89: Ada, sm120: consumer Blackwell) plans with its table
rows (sm86's) and its FP8 path. Nothing runs.
"""

from __future__ import annotations

import contextlib

import torch

from .ops.run import call as calls
from .ops.request import checks, modes
from .ops import planning
from .ops.request import spec as specs
from .ops.request.request import AttentionRequest, KVCacheRequest


# what `arch` takes: the table's architectures, then the GPUs named by their own sm
ARCH_NAMES = (*planning.ARCHS, *(a for a in modes.GPU_ARCHS if a not in planning.ARCHS))


def explain(q, k, v, /, *, kvcache: bool = False, arch: str | None = None, **kwargs) -> str:
    """The plan of the call flash_attn_func (kwargs: its options), flash_attn_varlen_func (cu_seqlens_q given; with
    block_table: the paged prefill) or, with kvcache=True, flash_attn_with_kvcache (k, v: k_cache, v_cache; the new
    tokens as kwargs k=, v=) would run, and for attention calls its backward's; printed and returned."""
    meta = q.device.type == "meta"
    if arch is not None and not meta:
        raise checks.ArgumentError(f"explain: arch is for meta tensors (a device of that arch), not {q.device} ones")
    token = checks.META_OK.set(True)
    try:
        return _explain(q, k, v, kvcache, arch, meta, kwargs)
    finally:
        checks.META_OK.reset(token)


def _explain(q, k, v, kvcache: bool, arch: str | None, meta: bool, kwargs) -> str:
    if kvcache:
        spec = _kvcache_spec(q, k, v, kwargs)
        parts = [spec]
    elif kwargs.get("block_table") is not None:
        spec = _paged_spec(q, k, v, kwargs)
        parts = [spec]
    else:
        spec = _attention_spec(q, k, v, kwargs)
        parts = [spec]
    fp8_dots, note = None, ""
    if meta:
        arch = arch or "sm90"
        capability = modes.GPU_ARCHS.get(arch)
        rows = modes.table_arch(*capability) if capability else arch
        if rows != arch:  # a GPU's name: its table rows, its FP8 path
            note, fp8_dots, arch = f"{arch}: the {rows} rows\n", capability >= (8, 9), rows
        parts = [_on(arch, p) for p in parts]
    fp8 = parts[0].q.dtype == checks.E4M3  # the FP8 forward has no backward
    if isinstance(parts[0], specs.AttentionSpec) and not parts[0].modes.invariant and not fp8:
        parts.append(_backward_spec(parts[0]))
    with planning.force(fp8_dots=fp8_dots) if fp8_dots is not None else contextlib.nullcontext():
        text = note + "\n".join(planning.explain(p) for p in parts)
    print(text)
    return text


def _on(arch: str, spec):
    if arch not in planning.ARCHS:
        raise checks.ArgumentError(f"explain: arch must be one of {ARCH_NAMES}, got {arch!r}")
    return spec._replace(modes=spec.modes._replace(arch=arch))


def _known(kwargs, fields) -> None:
    unknown = set(kwargs) - set(fields)
    if unknown:
        raise checks.ArgumentError(f"explain: unknown arguments {sorted(unknown)}")


def _attention_spec(q, k, v, kwargs):
    _known(kwargs, set(AttentionRequest._fields) - {"block_table"})
    return specs.attention(calls.validate_attention(AttentionRequest(q, k, v, **kwargs)))


def _backward_spec(s: specs.AttentionSpec) -> specs.BackwardSpec:
    out = planning.out_spec(s, s.q.dtype)
    return specs.BackwardSpec(s, out, out, False, bool(s.deterministic), (s.q, s.k, s.v), s.aligned)


def _kvcache_spec(q, k_cache, v_cache, kwargs):
    _known(kwargs, KVCacheRequest._fields)
    spec = calls.kvcache(KVCacheRequest(q, k_cache, v_cache, **kwargs)).spec
    if q.device.type == "meta":  # every meta tensor's data_ptr() is 0: the same memory only where v views k
        spec = spec._replace(v_from_k=spec.v_from_k and (v_cache is k_cache or v_cache._base is k_cache))
    return spec


def _paged_spec(q, k, v, kwargs):
    _known(kwargs, AttentionRequest._fields)
    return calls.paged(AttentionRequest(q, k, v, **kwargs)).spec


def main(argv) -> int:
    """python -m flashattn2 explain: the plan of a call of the given shape (meta tensors; --arch: whose plan)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flashattn2 explain", description=main.__doc__)
    ap.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    ap.add_argument("--seqlen-q", type=int, default=4096, help="query tokens per sequence (default 4096)")
    ap.add_argument("--seqlen-k", type=int, default=None, help="key tokens per sequence (default: --seqlen-q)")
    ap.add_argument("--nheads", type=int, default=32, help="query heads (default 32)")
    ap.add_argument("--nheads-k", type=int, default=None, help="K/V heads (default --nheads; fewer: GQA)")
    ap.add_argument("--headdim", type=int, default=128, help="q's and k's head dim (default 128)")
    ap.add_argument("--headdim-v", type=int, default=None, help="v's head dim (default --headdim)")
    ap.add_argument(
        "--dtype", default="bf16", choices=("fp16", "bf16", "fp32", "fp8"),
        help="default bf16; fp8: e4m3 q, k, v (FA3's FP8 forward), with --kvcache an e4m3 cache and bf16 q",
    )  # fmt: skip
    ap.add_argument("--causal", action="store_true", help="a causal mask")
    ap.add_argument("--window", default=None, help="window_size as LEFT,RIGHT (-1: unbounded)")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap (default 0: none)")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout_p (default 0)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes (one per head)")
    ap.add_argument("--sink", action="store_true", help="a learnable sink")
    ap.add_argument("--deterministic", action="store_true", help="the deterministic backward")
    ap.add_argument("--varlen", action="store_true", help="flash_attn_varlen_func: --batch sequences packed")
    ap.add_argument("--kvcache", action="store_true", help="flash_attn_with_kvcache: --seqlen-k is the cache")
    ap.add_argument("--page-size", type=int, default=None, help="kvcache: a paged cache of this page size")
    ap.add_argument("--num-splits", type=int, default=0, help="kvcache: num_splits (default 0: chosen)")
    ap.add_argument(
        "--arch", default="sm90", choices=ARCH_NAMES,
        help="whose plan: a table's (sm90: H100/H200, the default; sm80: A100; sm86: other GPUs; interp) or a GPU's "
        "(sm89, sm120: the sm86 rows, with their own FP8 path)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": checks.E4M3}[a.dtype]
    seqlen_k = a.seqlen_k or a.seqlen_q
    nheads_k = a.nheads_k or a.nheads
    dv = a.headdim_v or a.headdim
    meta = dict(dtype=dtype, device="meta")
    opts = dict(causal=a.causal, softcap=a.softcap)
    if a.window:
        opts["window_size"] = tuple(int(x) for x in a.window.split(","))
    if a.alibi:
        opts["alibi_slopes"] = torch.empty(a.nheads, dtype=torch.float32, device="meta")
    if a.sink:
        opts["learnable_sink"] = torch.empty(a.nheads, dtype=torch.float32, device="meta")
    if a.kvcache:
        q_dtype = torch.bfloat16 if dtype == checks.E4M3 else dtype  # (an FP8 cache's queries: 16-bit)
        q = torch.empty(a.batch, a.seqlen_q, a.nheads, a.headdim, dtype=q_dtype, device="meta")
        if a.page_size:
            pages = a.batch * -(-seqlen_k // a.page_size)
            k = torch.empty(pages, a.page_size, nheads_k, a.headdim, **meta)
            opts["block_table"] = torch.empty(a.batch, pages // a.batch, dtype=torch.int32, device="meta")
        else:
            k = torch.empty(a.batch, seqlen_k, nheads_k, a.headdim, **meta)
        # a narrower v: MLA's latent cache, v the K cache's first columns; else a cache of its own
        v = k[..., :dv] if dv < a.headdim else torch.empty(*k.shape[:-1], dv, **meta)
        opts["cache_seqlens"] = torch.empty(a.batch, dtype=torch.int32, device="meta")
        explain(q, k, v, kvcache=True, arch=a.arch, num_splits=a.num_splits, **opts)
        return 0
    opts.update(dropout_p=a.dropout, deterministic=a.deterministic)
    if a.varlen:
        q = torch.empty(a.batch * a.seqlen_q, a.nheads, a.headdim, **meta)
        k = torch.empty(a.batch * seqlen_k, nheads_k, a.headdim, **meta)
        v = torch.empty(a.batch * seqlen_k, nheads_k, dv, **meta)
        cu = torch.empty(a.batch + 1, dtype=torch.int32, device="meta")
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=a.seqlen_q, max_seqlen_k=seqlen_k)
    else:
        q = torch.empty(a.batch, a.seqlen_q, a.nheads, a.headdim, **meta)
        k = torch.empty(a.batch, seqlen_k, nheads_k, a.headdim, **meta)
        v = torch.empty(a.batch, seqlen_k, nheads_k, dv, **meta)
    explain(q, k, v, arch=a.arch, **opts)
    return 0
