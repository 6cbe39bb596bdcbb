"""Head dims past flash_attn 2.x on the GPU, beside the peers in one run (`python -m flashattn2 bench features
--cases dv,d512,mla`; rows in the features CSV):

- dv: a value head dim of its own, DeepSeek-V3's 192/128, against SDPA's backends where they accept it and against
  flashattn2's own d128 (16 heads, 16k tokens in 1-8 sequences, causal and not). TFLOP/s count the matmuls as they
  are: forward 2 * sq * sk * (dqk + dv) per head, backward 2 * sq * sk * (3 dqk + 2 dv) (QK^T, dK and dQ are
  dqk wide; dO V^T and dV dv wide), halved under a causal mask; at dqk = dv = d this is the paper's 4 / 10 * sq *
  sk * d.
- d512: head dim 512 (4 heads), flashattn2 against every SDPA backend that accepts it, forward and backward.
- mla: the MLA decode shape (q/k 576, v 512 a view of the K cache's first 512 columns, one latent head, 128 query
  heads, and 64, 32 and 16 at one point each; paged 64, bf16; CUDA graphs), in GB/s of distinct cache bytes read (the K cache: v is a view of it)
  beside a device-to-device copy of the same cache in the same run (its GB/s count the bytes read and written);
  the tflops column of these rows holds GB/s (their note says so).

Every flashattn2 case is checked against the reference before it is timed; a peer that refuses a shape gets a row
whose note says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import flashattn2
from .kernels import alternated, time_modes
from .results import Attention

DV_LENGTHS = (2048, 4096, 8192, 16384)
# (batch, cache length, query heads) of the MLA decode: 128 heads (DeepSeek-V3's; compute-bound: 242 FLOP a cache
# byte, above the H200's ridge of ~206), and 64, 32 and 16 over the same cache (121, 60 and 30: memory-bound)
MLA_POINTS = ((8, 8192, 128), (64, 16384, 128), (128, 8192, 128), (64, 16384, 64), (64, 16384, 32), (64, 16384, 16))
D512_LENGTHS = (1024, 2048, 4096, 8192)
TOKENS = 16384


def flops(batch, nheads, seqlen, dqk, dv, causal, mode) -> float:
    """The module docstring's count, for square attention (seqlen_q = seqlen_k)."""
    pairs = batch * nheads * seqlen * seqlen / (2 if causal else 1)
    fwd, bwd = 2.0 * pairs * (dqk + dv), 2.0 * pairs * (3 * dqk + 2 * dv)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def peers() -> dict:
    """name -> fn(q, k, v, causal) on (batch, nheads, seqlen, headdim) inputs: SDPA's backends."""
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_math": _sdpa(SDPBackend.MATH),
    }


def _inputs(batch, seqlen, nheads, dqk, dv, dtype, layout):
    shapes = ((batch, seqlen, nheads, dqk), (batch, seqlen, nheads, dqk), (batch, seqlen, nheads, dv))
    ts = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
    return ts if layout == "bshd" else [t.transpose(1, 2).contiguous() for t in ts]


def _peer_problem(fn, dtype, dqk, dv, causal) -> str:
    """'' when a peer runs the shape and agrees with the reference on a small problem, else why not."""
    from ..reference import BWD_FACTOR, FWD_FACTOR, attention_ref
    from .kernels import problems

    q, k, v = (t.requires_grad_() for t in _inputs(1, 300, 2, dqk, dv, dtype, "bhsd"))
    try:
        out = fn(q, k, v, causal)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    except RuntimeError as e:  # the backend refuses the shape
        return "not accepted: " + str(e).splitlines()[0][:120]
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(qt, kt, vt, causal=causal)
    low, _ = attention_ref(qt, kt, vt, causal=causal, upcast=False)
    named = [("out", out.transpose(1, 2), ref, low, FWD_FACTOR)]
    ref_g = torch.autograd.grad(ref, (qt, kt, vt), do.transpose(1, 2).float())
    low_g = torch.autograd.grad(low, (qt, kt, vt), do.transpose(1, 2))
    named += [(f"d{n}", g.transpose(1, 2), r, lo, BWD_FACTOR) for n, g, r, lo in zip("qkv", grads, ref_g, low_g)]
    return problems(named)


def _ours_problem(dtype, dqk, dv, causal) -> str:
    return _peer_problem(
        lambda q, k, v, c: flashattn2.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=c).transpose(
            1, 2
        ),
        dtype,
        dqk,
        dv,
        causal,
    )


def _sweep(out, case, dtype_name, dtype, variants, lengths, nheads, modes):
    """Each (name, dqk, dv, layout, fn) of variants at each length and causal setting; ratios printed against the
    first variant."""

    for causal in (False, True):
        c = "causal" if causal else "full"
        notes = {}
        for name, dqk, dv, layout, fn in variants:
            if layout == "bshd":
                notes[name] = _ours_problem(dtype, dqk, dv, causal)
            else:
                notes[name] = _peer_problem(fn, dtype, dqk, dv, causal)
        for seqlen in lengths:
            batch = max(1, TOKENS // seqlen)
            first = None
            for name, dqk, dv, layout, fn in variants:
                note = notes[name]
                times = {}
                if not note:
                    inputs = _inputs(batch, seqlen, nheads, dqk, dv, dtype, layout)
                    call = lambda q, k, v, c=causal, fn=fn: fn(q, k, v, c)  # noqa: E731
                    try:
                        times = time_modes(call, inputs, modes)
                    except (RuntimeError, torch.OutOfMemoryError) as e:
                        note = "failed: " + str(e).splitlines()[0][:120]
                fl = lambda m, b=batch, s=seqlen, dq=dqk, dv_=dv, ca=causal: flops(b, nheads, s, dq, dv_, ca, m)  # noqa: E731
                attention = Attention(dtype=dtype_name, headdim=f"{dqk}/{dv}", nheads=nheads)
                out.add(f"{case}-{c}", name, attention, f"{batch}x{seqlen}", times, fl, note)
                rate = {m: fl(m) / ms * 1e-9 for m, ms in times.items()}
                if first is None:
                    first = rate
                ratio = ", ".join(f"{m} {rate[m]:.0f} ({rate[m] / first[m]:.3f}x)" for m in rate if m in first)
                print(f"{dtype_name} {case} {c} {batch}x{seqlen} {name}: {ratio or note}")


def _ours(q, k, v, causal):
    return flashattn2.flash_attn_func(q, k, v, causal=causal)


def dv_case(out, dtype_name, dtype, modes):
    nheads = 16
    p = peers()
    variants = [
        ("flashattn2 192/128", 192, 128, "bshd", _ours),
        ("flashattn2 d128", 128, 128, "bshd", _ours),
        *((f"{name} 192/128", 192, 128, "bhsd", p[name]) for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")),
    ]
    _sweep(out, "dv", dtype_name, dtype, variants, DV_LENGTHS, nheads, modes)


def d512_case(out, dtype_name, dtype, modes):
    nheads = 4
    p = peers()
    variants = [("flashattn2 d512", 512, 512, "bshd", _ours)]
    variants += [(f"{name} d512", 512, 512, "bhsd", fn) for name, fn in p.items()]
    _sweep(out, "d512", dtype_name, dtype, variants, D512_LENGTHS, nheads, modes)


def mla_case(out, dtype_name, dtype):
    """MLA decode (module docstring) and a device copy of the same cache, alternated over 3 rounds."""
    from ..api import set_kvcache_checks
    from .decode import _time

    page = 64
    previous = set_kvcache_checks(False)
    try:
        for batch, cache_len, heads in MLA_POINTS:
            blocks = batch * cache_len // page
            kv = torch.randn(blocks, page, 1, 576, device="cuda", dtype=dtype)
            table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, -1)
            lens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=dtype)
            attention = Attention(dtype=dtype_name, headdim="576/512", nheads=heads)
            dst = torch.empty_like(kv)
            copy = lambda dst=dst, kv=kv: dst.copy_(kv)  # noqa: E731
            for splits in (0, 1):

                def step(q=q, kv=kv, table=table, lens=lens, splits=splits):
                    return flashattn2.flash_attn_with_kvcache(
                        q, kv, kv[..., :512], cache_seqlens=lens, block_table=table, num_splits=splits
                    )

                timed = alternated({"flashattn2": step, "copy": copy}, lambda c: {"fwd": _time(c, "graph")}, 3)
                med = {name: times["fwd"] for name, times in timed.items()}
                nbytes = kv.numel() * kv.element_size()
                shape = f"{batch}x{cache_len} MLA 576/512 h{heads} paged{page} splits {splits or 'auto'}"
                gbs = nbytes / med["flashattn2"] * 1e-6
                copy_gbs = 2 * nbytes / med["copy"] * 1e-6
                flop = batch * heads * cache_len * 2.0 * (576 + 512)
                note = f"GB/s; {gbs / copy_gbs:.3f}x the copy's; {flop / med['flashattn2'] * 1e-9:.0f} TFLOP/s"
                out.add("mla-decode", "flashattn2", attention, shape, {"fwd": med["flashattn2"]},
                        lambda m, n=nbytes: n * 1e3, note)  # fmt: skip
                out.add("mla-decode", "device copy", attention, shape, {"fwd": med["copy"]},
                        lambda m, n=nbytes: 2 * n * 1e3, "GB/s read + written")  # fmt: skip
                print(f"{dtype_name} mla {shape}: {gbs:.0f} GB/s, copy {copy_gbs:.0f} GB/s; {note}")
    finally:
        set_kvcache_checks(previous)


CASES = ("dv-", "d512-", "mla-")  # the features CSV's case names this module writes
_ORDER = {  # table columns: flashattn2 first, then its own reference point, then the peers
    "dv": [
        "flashattn2 192/128",
        "flashattn2 d128",
        "sdpa_cudnn 192/128",
        "sdpa_flash 192/128",
        "sdpa_efficient 192/128",
    ],
    "d512": ["flashattn2 d512", "sdpa_cudnn d512", "sdpa_flash d512", "sdpa_efficient d512", "sdpa_math d512"],
}


def markdown(rows: list[dict]) -> str:
    """The rows of these cases (features CSV rows) as tables by length: TFLOP/s forward / backward per variant, and
    the MLA decode's GB/s beside the device copy's."""
    import collections

    lines = []
    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["case"], r["shape"])].setdefault(r["variant"], {})[r["mode"]] = r
    for case in sorted({c for c, _ in by if not c.startswith("mla")}):
        shapes = sorted({s for c, s in by if c == case}, key=lambda s: int(s.split("x")[1]))
        order = _ORDER[case.split("-")[0]]
        names = [v for v in order if any(v in by[(case, s)] for s in shapes)]
        shas = sorted({r["git_sha"] for (c, _), vs in by.items() if c == case for d in vs.values() for r in d.values()})
        lines += [f"### {case}, TFLOP/s forward / backward (git {', '.join(shas)})\n"]
        lines += ["| shape | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for s in shapes:
            cells = [s]
            for n in names:
                d = by[(case, s)].get(n, {})
                f, b = d.get("fwd", {}).get("tflops", "nan"), d.get("bwd", {}).get("tflops")
                cells.append("not accepted" if f == "nan" else f"{float(f):.0f}" + (f" / {float(b):.0f}" if b else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    mla = {s: vs for (c, s), vs in by.items() if c.startswith("mla")}
    if mla:
        lines += ["### mla-decode: GB/s of distinct cache bytes, beside a device copy (read + written)\n"]
        lines += ["| shape | flashattn2 | device copy | note |", "|---|---|---|---|"]
        for s, vs in mla.items():
            ours, copy = vs["flashattn2"]["fwd"], vs["device copy"]["fwd"]
            lines.append(f"| {s} | {float(ours['tflops']):.0f} | {float(copy['tflops']):.0f} | {ours['note']} |")
        lines.append("")
    return "\n".join(lines)
