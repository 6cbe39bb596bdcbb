"""The plan (ops.planning.plan: kernel, tile, load path, splits...) of a grid of calls on meta tensors -- dense, GQA,
windowed, softcapped and non-deterministic attention forward and backward at several lengths, head-dim pairs and
dtypes (FP8 too), KV caches plain, paged, latent and FP8 with each num_splits -- for every arch of the table, one
JSON line per call: two runs print the same line for a call exactly when a change left its plan alone. For refactors
of the planning code (the table walker, the facts, the plan types): run before and after, compare (`--against FILE`
does it, exit 1 if any plan differs). No GPU needed.

    python tools/plan_hash.py > before.jsonl   # then change, then
    python tools/plan_hash.py --against before.jsonl
"""

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import sys

import torch

import flashattn2
from flashattn2.ops import planning

HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128), (512, 512), (96, 96), (40, 40))
# (head dim, v's, page size, query heads, kv heads, queries, batch): MHA/GQA, paged, MLA's latent cache
CACHES = ((128, 128, 0, 32, 8, 1, 1), (128, 128, 16, 32, 32, 1, 64), (128, 128, 256, 32, 8, 4, 64),
          (576, 512, 64, 16, 1, 1, 4), (576, 512, 64, 128, 1, 1, 64), (576, 512, 0, 64, 1, 1, 4),
          (256, 256, 0, 8, 8, 7, 1))  # fmt: skip


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def calls(arch: str):
    """(id, explain's arguments) of the grid on one arch."""
    for dtype in (torch.float16, torch.float32, torch.float8_e4m3fn):
        name = str(dtype).removeprefix("torch.")
        for (d, dv), causal, window, seqlen, extra in itertools.product(
            HEAD_DIMS, (False, True), ((-1, -1), (128, 0)), (333, 1024, 4096),
            ({}, {"softcap": 5.0}, {"deterministic": False}),
        ):  # fmt: skip
            q, k, v = (
                _meta(2, seqlen, 8, d, dtype=dtype),
                _meta(2, seqlen, 2, d, dtype=dtype),
                _meta(2, seqlen, 2, dv, dtype=dtype),
            )
            opts = dict(causal=causal, window_size=window, **extra)
            yield f"{arch} {name} d{d}/{dv} {seqlen} {opts}", (q, k, v), opts
        cache_dtype = dtype
        q_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
        for (d, dv, page, hq, hk, sq, batch), seqlen, splits in itertools.product(CACHES, (1024, 65536), (0, 1, 4)):
            if page:
                k_cache = _meta(batch * seqlen // page, page, hk, d, dtype=cache_dtype)
                opts = {"block_table": torch.empty(batch, seqlen // page, dtype=torch.int32, device="meta")}
            else:
                k_cache, opts = _meta(batch, seqlen, hk, d, dtype=cache_dtype), {}
            v_cache = k_cache[..., :dv] if dv != d else _meta(*k_cache.shape, dtype=cache_dtype)
            opts.update(kvcache=True, cache_seqlens=5, num_splits=splits)
            case = f"{arch} kv {name} d{d}/{dv} page {page} heads {hq}/{hk} q {sq} {batch}x{seqlen} splits {splits}"
            yield case, (_meta(batch, sq, hq, d, dtype=q_dtype), k_cache, v_cache), opts


def plans(args, opts, arch: str) -> list[str]:
    """The plans flashattn2.explain finds for one call (forward, and backward where there is one), or its error."""
    found = []
    real = planning.explain
    planning.explain = lambda spec: found.append(planning.plan(spec)) or ""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            flashattn2.explain(*args, arch=arch, **opts)
    except (NotImplementedError, ValueError, TypeError) as e:
        return [f"{type(e).__name__}: {e}"]
    finally:
        planning.explain = real
    return [f"{type(p).__name__}{dataclasses.astuple(p)}" for p in found]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=",".join(planning.ARCHS), help="comma-separated archs (default: all)")
    ap.add_argument("--match", default="", help="only the calls whose id contains this")
    ap.add_argument("--against", default=None, help="a file this tool wrote: report what differs from it")
    args = ap.parse_args(argv)
    before = {}
    if args.against:
        with open(args.against) as fh:
            before = {row["id"]: row["plan"] for row in map(json.loads, fh)}
    changed = same = 0
    for arch in args.arch.split(","):
        for case, tensors, opts in calls(arch):
            if args.match not in case:
                continue
            plan = plans(tensors, opts, arch)
            if args.against is None:
                print(json.dumps({"id": case, "plan": plan}))
            elif case in before and before[case] != plan:
                changed += 1
                print(f"changed: {case}\n  before {before[case]}\n  after  {plan}")
            else:
                same += case in before
    if args.against is not None:
        print(f"{same} calls with the same plan, {changed} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
