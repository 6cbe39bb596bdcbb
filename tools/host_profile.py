"""Where a forward + backward call's time goes at a benchmark shape (GPU): host time per call (enqueued
without a sync), wall time per call, both with and without do_bench's L2 flush before each call, and
a torch.profiler table (CPU self time: Python ops, CUDA runtime calls such as cudaLaunchKernel,
cudaMalloc or a synchronizing call; and the GPU kernels' times), beside SDPA's flash and cuDNN backends.

    python tools/host_profile.py [--shape 32,512,16,128] [--causal 1] [--dtype fp16] [--rows 25]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn2


def steps(shape, dtype, causal):
    b, s, h, d = shape
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2).contiguous()

    def ours():
        torch.autograd.grad(flashattn2.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            torch.autograd.grad(out, (qt, kt, vt), dot)

        return run

    return {
        "flashattn2": ours,
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }


def per_call(fn, n, flush=None):
    """(host us, wall us) per call over n calls: host = until the last call returned, wall = until
    the GPU finished."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        if flush is not None:
            flush.zero_()
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,512,16,128", help="batch,seqlen,nheads,headdim")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cases = steps(shape, dtype, bool(args.causal))
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")  # do_bench's L2 flush buffer
    print(f"shape {shape} causal {args.causal} {args.dtype}")
    for name, fn in cases.items():
        for label, fl in (("no flush", None), ("L2 flush", flush)):
            host, wall = per_call(fn, args.calls, fl)
            print(f"{name:12} {label:9} host {host:8.1f} us/call   wall {wall:8.1f} us/call")
    from torch.profiler import ProfilerActivity, profile

    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                flush.zero_()
                fn()
            torch.cuda.synchronize()
        print(f"===== {name}: 10 calls (each after an L2 flush), by CPU self time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(f"===== {name}: by GPU time")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


if __name__ == "__main__":
    main()
