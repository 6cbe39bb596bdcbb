"""Decoding over a KV cache (`python -m flashattn2 bench decode`): one query token per sequence,
bf16, headdim 128, 32 query heads, MHA (32 K/V heads) or GQA (8); GB/s of K/V read
(2 * batch * nheads_k * cache * headdim * 2 bytes over the median time) for flashattn2 with a
contiguous cache and paged caches (pages of 16 and 256), SDPA's FLASH and CUDNN backends, and a
2 GiB device-to-device copy (read + write) as the bandwidth yardstick. "contiguous-unchecked" is
the contiguous cache with set_kvcache_checks(False), timed eager only. "fp8-<layout>" (not a default) is that layout
over a float8_e4m3fn cache with FA3's k_descale/v_descale (q bf16): its GB/s count the bytes it reads, 1 per element,
and its ms against the bf16 layout's is the FP8 cache's speedup. With a baseline (a package
built by tools/baseline_pkg.py, an older commit), its layouts are timed beside flashattn2's at every
point, the two alternating over the rounds (odd rounds in reverse order; the median reported).

Two timings per point: eager (a Python call per step, as a generate() loop without graphs) and
graph (the step captured in a CUDA graph and replayed, as serving engines run decoding), so the
host time of a call and the kernel's own time are told apart."""

from __future__ import annotations

import csv
import importlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import flashattn2
from ..reference import fp8, tolerance
from ..reference.kvcache import kvcache_ref
from .kernels import cuda_graph, run_metadata
from .results import appending

FIELDS = [
    "provider",
    "layout",
    "batch",
    "nheads",
    "nheads_k",
    "cache",
    "timing",
    "ms",
    "gbs",
    "frac_copy",
    "note",
    "gpu",
    "torch",
    "triton",
    "date",
    "git_sha",
]
HEAD_DIM = 128
NHEADS = 32
MAX_BYTES = 40 * 2**30


@dataclass(frozen=True)
class Grid:
    """The points bench decode measures: each K/V head count (of NHEADS query heads), batch size and cache length
    (a point whose K/V are over MAX_BYTES is left out)."""

    batches: Sequence[int] = (1, 8, 64)
    caches: Sequence[int] = (1024, 8192, 32768, 131072)
    kv_heads: Sequence[int] = (32, 8)


def copy_gbs() -> float:
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() * 2 / ms * 1e-6


def _time(fn, timing):
    from triton.testing import do_bench

    if timing == "eager":
        return do_bench(fn, warmup=10, rep=100, return_mode="median")
    return do_bench(cuda_graph(fn).replay, warmup=10, rep=100, return_mode="median")


def _flashattn2_case(batch, nheads_k, cache, layout, module=flashattn2):
    """layout: contiguous, paged-<page size>; a suffix -unchecked runs the step with
    set_kvcache_checks(False) (no read-back of the value check: the host runs ahead). module: flashattn2 or
    a baseline package."""
    unchecked = layout.endswith("-unchecked")
    layout = layout.removesuffix("-unchecked")
    e4m3 = layout.startswith("fp8-")
    layout = layout.removeprefix("fp8-")
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    if layout == "contiguous":
        k_cache = torch.randn(batch, cache, nheads_k, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        table = None
    else:
        page = int(layout.split("-")[1])
        blocks = -(-cache // page)
        k_cache = torch.randn(batch * blocks, page, nheads_k, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)
    v_cache = torch.randn_like(k_cache)
    descales = {}
    if e4m3:  # one descale for every (sequence, kv head): randn's values span about +-5, e4m3's +-448
        descale = torch.full((batch, nheads_k), 1 / 64, device="cuda")
        descales = dict(k_descale=descale, v_descale=descale)
        rows = descale[:1].expand(k_cache.shape[0], -1)  # (quantize reads a descale per cache row or page)
        k_cache, v_cache = fp8.quantize(k_cache, rows), fp8.quantize(v_cache, rows)

    def step():
        return module.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, **descales)

    def step_unchecked():
        previous = module.set_kvcache_checks(False)
        try:
            return step()
        finally:
            module.set_kvcache_checks(previous)

    return (step_unchecked if unchecked else step), (q, k_cache, v_cache, seqlens, table)


def _check(step, tensors) -> str:
    """flash_attn's rule for the KV cache (reference.tolerance, factor 3 as in flash_attn's
    kvcache tests and ours): the error against the fp32 reference at most three times that of
    the same math in bf16, on the first sequence (the others differ in data, not code path)."""
    q, k_cache, v_cache, seqlens, table = tensors
    out = step()
    if k_cache.dtype == fp8.E4M3:  # the values the codes stand for (the bench's one descale): exact in bf16
        k_cache, v_cache = (fp8.dequantize(t, dtype=torch.bfloat16) / 64 for t in (k_cache, v_cache))
    kw = dict(cache_seqlens=seqlens[:1], block_table=None if table is None else table[:1])
    caches = (k_cache, v_cache) if table is not None else (k_cache[:1], v_cache[:1])
    ref = kvcache_ref(q[:1], *caches, **kw)[0]
    low = kvcache_ref(q[:1], *caches, **kw, upcast=False)[0]
    ok, err, bound = tolerance.check(out[:1], ref, low, 3.0)
    return "" if ok else f"check failed: max error {err:.3g} > {bound:.3g}"


def _sdpa_case(batch, nheads_k, cache, backend):
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(batch, NHEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, nheads_k, cache, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def step():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=nheads_k != NHEADS)

    return step


def run(
    out_csv,
    grid: Grid = Grid(),
    layouts=("contiguous", "paged-16", "paged-256", "contiguous-unchecked"),
    timings=("eager", "graph"),
    peers=True,
    baseline=None,
    rounds=1,
):
    """Appends one row per point of grid, case and timing to out_csv and returns the rows. The cases: flashattn2's
    layouts, a baseline package's (by its module name), and with peers SDPA's flash and cuDNN backends, alternated
    over `rounds` rounds."""
    from torch.nn.attention import SDPBackend

    base = importlib.import_module(baseline) if baseline else None
    meta = run_metadata()
    copy = copy_gbs()
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    rows = []
    with appending(out_csv, FIELDS) as (writer, fh):
        for nheads_k in grid.kv_heads:
            for batch in grid.batches:
                for cache in grid.caches:
                    kv_bytes = 2 * batch * nheads_k * cache * HEAD_DIM * 2  # bf16's; an FP8 layout reads half
                    if kv_bytes > MAX_BYTES:
                        continue
                    cases = [("flashattn2", layout) for layout in layouts]
                    cases += [(baseline, layout) for layout in layouts] if base is not None else []
                    if peers:
                        cases += [("sdpa_flash", "contiguous"), ("sdpa_cudnn", "contiguous")]
                    steps, notes, samples = {}, {}, {}
                    for provider, layout in cases:
                        note = ""
                        try:
                            if provider in ("flashattn2", baseline):
                                module = flashattn2 if provider == "flashattn2" else base
                                step, tensors = _flashattn2_case(batch, nheads_k, cache, layout, module)
                                note = _check(step, tensors)
                            else:
                                backend = (
                                    SDPBackend.FLASH_ATTENTION
                                    if provider == "sdpa_flash"
                                    else SDPBackend.CUDNN_ATTENTION
                                )
                                step = _sdpa_case(batch, nheads_k, cache, backend)
                        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                            step, note = None, "failed: " + str(exc).splitlines()[0][:120]
                        steps[provider, layout], notes[provider, layout] = (None if note else step), note
                    for r in range(rounds):  # the cases alternate, odd rounds in reverse order
                        for case in cases if r % 2 == 0 else cases[::-1]:
                            if steps[case] is None:
                                continue
                            # unchecked differs from checked only in eager calls (graphs check nothing)
                            for t in (t for t in timings if t == "eager" or not case[1].endswith("-unchecked")):
                                try:
                                    samples.setdefault(case, {}).setdefault(t, []).append(_time(steps[case], t))
                                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                                    steps[case], notes[case] = None, "failed: " + str(exc).splitlines()[0][:120]
                                    break
                    for provider, layout in cases:
                        case_timings = [t for t in timings if t == "eager" or not layout.endswith("-unchecked")]
                        note = notes[provider, layout]
                        times = {t: statistics.median(v) for t, v in samples.get((provider, layout), {}).items()}
                        read = kv_bytes // 2 if layout.startswith("fp8-") else kv_bytes
                        for timing in case_timings:
                            ms = times.get(timing, float("nan"))
                            gbs = read / ms * 1e-6
                            row = dict(
                                provider=provider,
                                layout=layout,
                                batch=batch,
                                nheads=NHEADS,
                                nheads_k=nheads_k,
                                cache=cache,
                                timing=timing,
                                ms=f"{ms:.4f}",
                                gbs=f"{gbs:.0f}",
                                frac_copy=f"{gbs / copy:.3f}",
                                note=note,
                                **meta,
                            )
                            writer.writerow(row)
                            rows.append(row)
                        fh.flush()
                        torch.cuda.empty_cache()
                        print(
                            f"hk={nheads_k} b={batch} cache={cache} {provider} {layout}: "
                            + ", ".join(f"{t} {read / times[t] * 1e-6:.0f} GB/s ({times[t]:.4f} ms)" for t in times)
                            + (f" {note}" if note else ""),
                            flush=True,
                        )
    return rows


def markdown(path) -> str:
    """Per (nheads_k, timing): GB/s of each provider/layout at each (batch, cache), and
    flashattn2's best layout over the best SDPA backend. The last row of a point wins."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return "no rows"
    latest = {}
    for r in rows:
        latest[(r["nheads_k"], r["timing"], int(r["batch"]), int(r["cache"]), r["provider"], r["layout"])] = r
    meta = rows[-1]
    runs = {}
    for r in latest.values():
        runs[r["git_sha"]] = runs.get(r["git_sha"], 0) + 1
    shas = ", ".join(f"{sha} ({n} measurements)" for sha, n in runs.items())
    lines = [
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, git {shas}; each "
        "point from its last run, its peers from the same run. "
        "Decode (1 query token), bf16, headdim 128, 32 query heads; GB/s of K/V read; x = flashattn2 "
        "(contiguous) over the best SDPA backend, same run.\n"
    ]
    groups = sorted({(k[0], k[1]) for k in latest}, key=lambda g: (-int(g[0]), g[1]))
    for hk, timing in groups:
        cols = sorted({(k[4], k[5]) for k in latest if k[0] == hk and k[1] == timing})
        points = sorted({(k[2], k[3]) for k in latest if k[0] == hk and k[1] == timing})
        kind = "MHA" if int(hk) == 32 else f"GQA ({hk} K/V heads)"
        lines.append(f"### {kind}, {timing}\n")
        unchecked = ("flashattn2", "contiguous-unchecked") in cols
        head = ["batch", "cache"] + [f"{p} {lay}" if p == "flashattn2" else p for p, lay in cols] + ["x best SDPA"]
        head += ["x best SDPA, unchecked"] if unchecked else []
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for batch, cache in points:
            vals = {}
            for p, lay in cols:
                r = latest.get((hk, timing, batch, cache, p, lay))
                vals[(p, lay)] = float(r["gbs"]) if r and r["gbs"] != "nan" else float("nan")
            ours = vals.get(("flashattn2", "contiguous"), float("nan"))
            peers = [v for (p, _), v in vals.items() if p != "flashattn2" and v == v]
            best = max(peers) if peers else float("nan")
            cells = [str(batch), str(cache)] + [("–" if v != v else f"{v:.0f}") for v in vals.values()]
            cells.append("–" if ours != ours or best != best else f"{ours / best:.2f}")
            if unchecked:
                fast = vals[("flashattn2", "contiguous-unchecked")]
                cells.append("–" if fast != fast or best != best else f"{fast / best:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
