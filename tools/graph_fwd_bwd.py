"""Forward + backward with the host's time taken out: each provider's call (flash_attn_func or SDPA,
then autograd.grad) captured in a CUDA graph and replayed, beside the eager time of the same call,
both by triton's do_bench (L2 flushed before each call, as the kernel grid), 16k tokens, hidden 2048.
Where eager is below graph, the GPU waited for the host (the 512-token points of the grid).

    python tools/graph_fwd_bwd.py [--modes fwd,fwd_bwd] [--seqlens 512,1024] [--dtypes fp16,bf16] > graph.txt

(on a CUDA GPU; mode fwd: the forward alone, under no_grad). Prints: dtype d causal seqlen provider
mode eager_tflops graph_tflops (one line per point)."""

import argparse

import torch
from triton.testing import do_bench
from flashattn2.bench.kernels import cuda_graph
from flashattn2.bench.providers import attention_flops, providers

ap = argparse.ArgumentParser()
ap.add_argument("--modes", default="fwd_bwd")
ap.add_argument("--seqlens", default="512,1024")
ap.add_argument("--dtypes", default="fp16,bf16")
args = ap.parse_args()
P = providers()
points = [
    (dt, d, c, n)
    for dt in args.dtypes.split(",")
    for d, c in ((64, 1), (128, 1), (128, 0), (256, 1), (64, 0))
    for n in map(int, args.seqlens.split(","))
]
print("dtype d causal seqlen provider mode eager_tflops graph_tflops")
for (dt, d, causal, n), mode in ((p, m) for p in points for m in args.modes.split(",")):
    dtype = torch.float16 if dt == "fp16" else torch.bfloat16
    b, h = 16384 // n, 2048 // d
    for prov in ("flashattn2", "sdpa_flash", "sdpa_cudnn"):
        layout, fn = P[prov]
        shape = (b, n, h, d) if layout == "bshd" else (b, h, n, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=dtype)

        def fb():
            out = fn(q, k, v, causal == 1)
            return torch.autograd.grad(out, (q, k, v), do)

        def fwd():
            with torch.no_grad():
                return fn(q, k, v, causal == 1)

        call = fwd if mode == "fwd" else fb
        try:
            g = cuda_graph(call)
            eager = do_bench(call)
            graph = do_bench(g.replay)
        except Exception as e:  # a provider that cannot be captured
            print(dt, d, causal, n, prov, mode, "error", repr(e)[:120], flush=True)
            continue
        fl = attention_flops(b, h, n, n, d, causal == 1, mode)
        print(dt, d, causal, n, prov, mode, f"{fl / eager / 1e9:.0f}", f"{fl / graph / 1e9:.0f}", flush=True)
        del g
