"""One-off sweep: the MLA decode's tiles on an H100/H200 (flash_attn_with_kvcache; q/k 576, v a view of the K
cache's first 512 columns, one latent head, paged 64, bf16). Each tile is checked against the reference, then timed
with CUDA graphs beside a device copy of the same cache in alternated rounds. Tiles are forced by replacing
ops.kvcache.plan; V_FROM_K off by replacing ops.kvcache.v_from_k (the kernel then loads v again). With
--baseline NAME (a package from tools/baseline_pkg.py on the path) the older build's plan is timed too ("base").

    python tools/mla_sweep.py [--rounds 3] [--jobs 8] [--csv FILE] [--baseline flashattn2_base]

The variants are compiled first in parallel subprocesses (--only N: check and compile one variant), then timed in
this process."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys

import torch

import flashattn2
from flashattn2.ops import kvcache

# (BLOCK_M, BLOCK_N, num_warps, num_stages, V_FROM_K, KV_TMA: planning.force(tma=...)); None: the table's plan (with
# V_FROM_K and KV_TMA as chosen); "base":
# the baseline package's plan. (64-row tiles spill 1.2-1.6 KB at 255 registers in ptxas; 128 rows need 16 warps,
# which ptxas refuses at 128 registers: measured for the record with one of each.)
VARIANTS = [
    "base",
    None,
    (64, 64, 8, 1, True, True),
    (32, 32, 4, 2, True, True),
    (32, 64, 8, 2, True, True),
    (32, 64, 4, 2, True, True),
    (32, 32, 4, 1, True, False),
    (16, 32, 4, 2, True, True),
    (16, 64, 4, 2, True, True),
    (16, 64, 8, 2, True, True),
]
# (batch, cache length, query heads)
SHAPES = [(64, 16384, 128), (128, 8192, 128), (8, 8192, 128), (64, 16384, 64), (64, 16384, 32), (64, 16384, 16)]
PAGE = 64
_PLAN, _V_FROM_K = kvcache.plan, kvcache.v_from_k


BASE = None  # the baseline package (--baseline)
TMA = None  # the variant's planning.force(tma=...)


def name(variant) -> str:
    if variant is None or variant == "base":
        return variant or "table"
    bm, bn, w, s, vk, tma = variant
    return f"{bm}x{bn}w{w}s{s}" + ("-vk" if vk else "") + ("-tma" if tma else "")


def use(variant) -> None:
    global TMA
    TMA = None
    if variant is None or variant == "base":
        kvcache.plan, kvcache.v_from_k = _PLAN, _V_FROM_K
        return
    bm, bn, w, s, vk, TMA = variant

    def plan(cache, rows, batch, head_dim, elem_bytes, num_splits, sm_count, interp, *rest):
        programs = -(-rows // bm) * batch * cache.k.shape[2]
        splits = kvcache.num_splits_for(num_splits, programs, cache.capacity, bn, sm_count)
        chunk = -(-cache.capacity // (splits * bn)) * bn
        return bm, bn, w, s, -(-cache.capacity // chunk), chunk

    kvcache.plan = plan
    kvcache.v_from_k = _V_FROM_K if vk else (lambda cache, head_dim: False)


def problem(batch, cache_len, heads, lens=None):
    blocks = batch * -(-cache_len // PAGE)
    kv = torch.randn(blocks, PAGE, 1, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, -1)
    if lens is None:
        lens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=torch.bfloat16)
    return q, kv, table, lens


def step_of(q, kv, table, lens, variant=None):
    from flashattn2.ops import planning

    module = BASE if variant == "base" else flashattn2

    def step():
        with planning.force(tma=TMA):
            return module.flash_attn_with_kvcache(q, kv, kv[..., :512], cache_seqlens=lens, block_table=table)

    return step


def check(variant) -> str:
    """'' when the variant obeys flash-attn's rule (factor 3, as the kvcache tests) on ragged lengths, else why."""
    from flashattn2.reference import tolerance
    from flashattn2.reference.kvcache import kvcache_ref

    use(variant)
    notes = []
    for heads in (128, 16):
        lens = torch.tensor([1000, 77, 1], dtype=torch.int32, device="cuda")
        q, kv, table, lens = problem(3, 1024, heads, lens)
        out = torch.full((3, 1, heads, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.copy_(step_of(q, kv, table, lens, variant)())
        kw = dict(cache_seqlens=lens, block_table=table)
        ref = kvcache_ref(q, kv, kv[..., :512], **kw)[0]
        low = kvcache_ref(q, kv, kv[..., :512], **kw, upcast=False)[0]
        ok, err, bound = tolerance.check(out, ref, low, 3.0)
        if not ok:
            notes.append(f"h{heads} error {err:.3g} > {bound:.3g}")
    return "; ".join(notes)


def compile_one(index: int) -> None:
    variant = VARIANTS[index]
    try:
        note = check(variant)
        for batch, cache_len, heads in SHAPES:
            step_of(*problem(batch, cache_len, heads), variant)()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (a tile that does not compile or launch: reported, not fatal)
        note = "failed: " + " ".join(str(e).split())[:300]
    print(f"RESULT {index} {note}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--csv", default="mla-sweep.csv")
    ap.add_argument("--baseline")
    ap.add_argument(
        "--profile", type=int, help="one call of variant N at the first shape, for ncu --profile-from-start off"
    )
    args = ap.parse_args()
    global BASE
    flashattn2.set_kvcache_checks(False)
    if args.baseline:
        import importlib

        BASE = importlib.import_module(args.baseline)
        BASE.set_kvcache_checks(False)
    elif "base" in VARIANTS:
        VARIANTS.remove("base")
    if args.only is not None:
        compile_one(args.only)
        return
    if args.profile is not None:
        variant = VARIANTS[args.profile]
        use(variant)
        step = step_of(*problem(*SHAPES[0]), variant)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("PROFILED", name(variant), flush=True)
        return

    def run(i):
        cmd = [sys.executable, __file__, "--only", str(i)] + (["--baseline", args.baseline] if args.baseline else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
        return lines[0].split(" ", 2)[2] if lines else "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:300]

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        notes = dict(zip(range(len(VARIANTS)), pool.map(run, range(len(VARIANTS)))))
    for i, v in enumerate(VARIANTS):
        print(f"{name(v)}: {notes[i] or 'ok'}", flush=True)
    from flashattn2.bench.decode import _time
    from flashattn2.bench.kernels import alternated

    rows = []
    for batch, cache_len, heads in SHAPES:
        q, kv, table, lens = problem(batch, cache_len, heads)
        dst = torch.empty_like(kv)
        calls = {"copy": lambda: dst.copy_(kv)}
        for i, v in enumerate(VARIANTS):
            if not notes[i]:
                step = step_of(q, kv, table, lens, v)
                calls[name(v)] = lambda v=v, step=step: (use(v), step())[1]

        def time_one(call):
            call()  # selects the variant (use) outside the graph; the graph holds the launch
            return {"fwd": _time(call, "graph")}

        med = alternated(calls, time_one, args.rounds)
        nbytes = kv.numel() * kv.element_size()
        copy_gbs = 2 * nbytes / med["copy"]["fwd"] * 1e-6
        flop = batch * heads * cache_len * 2.0 * (576 + 512)
        for n, t in med.items():
            if n == "copy":
                continue
            ms = t["fwd"]
            gbs = nbytes / ms * 1e-6
            row = (batch, cache_len, heads, n, ms, gbs, gbs / copy_gbs, flop / ms * 1e-9, copy_gbs)
            rows.append(row)
            print(
                f"{batch}x{cache_len} h{heads} {n:>18}: {ms:.3f} ms {gbs:6.0f} GB/s ({gbs / copy_gbs:.3f}x copy "
                f"{copy_gbs:.0f}) {flop / ms * 1e-9:5.0f} TFLOP/s",
                flush=True,
            )
    with open(args.csv, "a") as f:
        if f.tell() == 0:
            f.write("batch,cache_len,heads,variant,ms,gbs,x_copy,tflops,copy_gbs,git_sha\n")
        sha = os.environ.get("FLASHATTN2_GIT_SHA", "unknown")
        for r in rows:
            f.write(",".join(str(x) if not isinstance(x, float) else f"{x:.4g}" for x in r) + f",{sha}\n")


if __name__ == "__main__":
    main()
