"""Tile sweep on a GPU: correctness of each candidate, then TFLOP/s beside SDPA in the same run.

python tools/sweep.py --out DIR [--heads-dims 128,64,256] [--kernels fwd,bwd_dkdv,bwd_dq]
Writes DIR/sweep.csv and prints a table. Not a test: the chosen entries go into ops/config.py.
"""
import argparse
import csv
import itertools
import os
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn2
from flashattn2.bench.kernels import check_provider
from flashattn2.ops import attention, config

T = config.TileConfig
CANDIDATES = {
    ("fwd", 64): [T(128, 64, 4, 3), T(128, 128, 4, 3), T(128, 128, 8, 3), T(128, 64, 4, 4), T(128, 128, 8, 2),
                  T(64, 64, 4, 4), T(128, 64, 8, 3)],
    ("fwd", 128): [T(128, 64, 4, 2), T(128, 64, 4, 3), T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 128, 8, 2),
                   T(128, 128, 8, 3), T(128, 128, 4, 2), T(64, 64, 4, 3), T(128, 32, 4, 3)],
    ("fwd", 256): [T(64, 64, 4, 2), T(128, 64, 8, 2), T(64, 32, 4, 2), T(128, 32, 8, 2), T(64, 64, 8, 2),
                   T(128, 64, 8, 1), T(64, 64, 4, 1)],
    ("bwd_dkdv", 64): [T(64, 128, 8, 2), T(64, 128, 8, 3), T(32, 128, 4, 3), T(64, 64, 4, 3), T(128, 128, 8, 2),
                       T(64, 128, 4, 2), T(32, 64, 4, 3)],
    ("bwd_dkdv", 128): [T(64, 128, 8, 2), T(64, 128, 8, 3), T(32, 128, 4, 3), T(64, 64, 4, 3), T(128, 128, 8, 2),
                        T(64, 128, 4, 2), T(32, 64, 4, 3), T(64, 64, 8, 2), T(32, 128, 8, 2)],
    ("bwd_dkdv", 256): [T(64, 64, 8, 1), T(32, 64, 8, 2), T(64, 32, 8, 2), T(32, 32, 4, 2), T(64, 64, 8, 2),
                        T(32, 64, 4, 2)],
    ("bwd_dq", 64): [T(128, 64, 8, 2), T(128, 32, 4, 3), T(64, 64, 4, 3), T(128, 128, 8, 2), T(64, 128, 8, 2),
                     T(128, 64, 4, 2)],
    ("bwd_dq", 128): [T(128, 64, 8, 2), T(128, 32, 4, 3), T(64, 64, 4, 3), T(128, 128, 8, 2), T(64, 128, 8, 2),
                      T(128, 64, 4, 2), T(64, 64, 8, 2), T(128, 32, 8, 2)],
    ("bwd_dq", 256): [T(64, 64, 8, 1), T(64, 32, 8, 2), T(32, 64, 8, 2), T(64, 64, 8, 2), T(128, 32, 8, 2)],
}


def flops(batch, nheads, seqlen, d, causal, mode):
    f = 4 * batch * nheads * seqlen * seqlen * d / (2 if causal else 1)
    return f * {"fwd": 1.0, "bwd": 2.5}[mode]


def make(batch, nheads, seqlen, d, dtype):
    g = lambda: torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=dtype)
    return g(), g(), g(), g()


def check(kernel, cfg, d, dtype, causal):
    """'' when this tile obeys flash-attn's rule (out and gradients), else what failed."""
    with config.override(**{kernel: cfg}):
        return check_provider(lambda q, k, v, c: flashattn2.flash_attn_func(q, k, v, causal=c), "bshd",
                              dtype, d, causal)


def time_ours(kernel, cfg, shape, dtype, causal):
    batch, nheads, seqlen, d = shape
    q, k, v, do = make(batch, nheads, seqlen, d, dtype)
    scale = d ** -0.5
    mods = attention.ScoreMods(causal=causal)
    with config.override(**{kernel: cfg}):
        out, lse = attention.forward(q, k, v, scale, mods)
        if kernel == "fwd":
            fn = lambda: attention.forward(q, k, v, scale, mods)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            fn = lambda: attention.backward(do, q, k, v, out, lse, None, dq, dk, dv, scale, mods)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms


def time_sdpa(backend, shape, dtype, causal, mode):
    batch, nheads, seqlen, d = shape
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in make(batch, nheads, seqlen, d, dtype))
    if mode == "bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        if mode == "fwd":
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            fn = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--head-dims", default="128,64,256")
    ap.add_argument("--kernels", default="fwd,bwd_dkdv,bwd_dq")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seqlens", default="16384,2048")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    path = os.path.join(args.out, "sweep.csv")
    w = csv.writer(open(path, "a"))
    for d in map(int, args.head_dims.split(",")):
        nheads = 2048 // d
        shapes = [(16384 // s, nheads, s, d) for s in map(int, args.seqlens.split(","))]
        for causal, shape in itertools.product((False, True), shapes):
            for mode, backend in itertools.product(("fwd", "bwd"), ("flash", "cudnn")):
                be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
                try:
                    ms = time_sdpa(be, shape, dtype, causal, mode)
                except Exception as exc:  # a backend may refuse a shape (cuDNN d256 bwd on some builds)
                    print("sdpa", backend, mode, shape, "failed:", str(exc)[:100])
                    continue
                row = ["sdpa_" + backend, mode, d, causal, shape[2], "", ms, flops(*shape, causal, mode) / ms * 1e-9, ""]
                w.writerow(row)
                rows.append(row)
                print(*row, sep=",", flush=True)
        for kernel in args.kernels.split(","):
            mode = "fwd" if kernel == "fwd" else "bwd"
            for cfg in CANDIDATES[(kernel, d)]:
                t0 = time.time()
                try:
                    problems = "; ".join(p for p in (check(kernel, cfg, d, dtype, c) for c in (False, True)) if p)
                    ok = not problems
                    print(kernel, d, cfg, "check:", problems or "ok", flush=True)
                except Exception as exc:
                    print(kernel, d, cfg, "failed:", str(exc).splitlines()[-1][:160], flush=True)
                    continue
                for causal, shape in itertools.product((False, True), shapes):
                    ms = time_ours(kernel, cfg, shape, dtype, causal)
                    row = [kernel, mode, d, causal, shape[2], str(cfg),
                           ms, flops(*shape, causal, mode) / ms * 1e-9, ok]
                    w.writerow(row)
                    rows.append(row)
                    print(*row, f"{time.time() - t0:.1f}s", sep=",", flush=True)


if __name__ == "__main__":
    main()
