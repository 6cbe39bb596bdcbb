"""Where a simulated zigzag ring's forward and backward time goes (W=8, 128k, GQA 32/8, d128, bf16), on a CUDA GPU:
    PYTHONPATH=src python tools/cp_profile.py
the kernels' totals over one call (torch.profiler), then the merge, the cast and single blocks alone."""

import torch
import flashattn2
from flashattn2 import parallel
from flashattn2.ops.merge import merge_
from triton.testing import do_bench

W, S, H, HK, D = 8, 131072, 32, 8, 128
L = S // W
dt = torch.bfloat16
q = torch.randn(W, 1, L, H, D, device="cuda", dtype=dt, requires_grad=True)
k = torch.randn(W, 1, L, HK, D, device="cuda", dtype=dt, requires_grad=True)
v = torch.randn(W, 1, L, HK, D, device="cuda", dtype=dt, requires_grad=True)
g = parallel.SimulatedGroup(W)
f = lambda: parallel.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=g)
with torch.no_grad():
    f()
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
out = f()
do = torch.randn_like(out)
torch.autograd.grad(f(), (q, k, v), do)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.autograd.grad(f(), (q, k, v), do)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16))
# pieces
acc = torch.empty(1, L, H, D, device="cuda", dtype=torch.float32)
lse = torch.empty(1, H, L, device="cuda")
o = torch.randn(1, L, H, D, device="cuda", dtype=dt)
ol = torch.randn(1, H, L, device="cuda")
merge_(acc, lse, o, ol, True)
print("merge first ms", do_bench(lambda: merge_(acc, lse, o, ol, True)))
print("merge next ms", do_bench(lambda: merge_(acc, lse, o, ol, False)))
print("acc.to(bf16) ms", do_bench(lambda: acc.to(dt)))
qq, kk, vv = q[0].detach(), k[0].detach(), v[0].detach()
print("causal 16k x 16k fwd ms", do_bench(lambda: flashattn2.flash_attn_func(qq, kk, vv, causal=True)))
print("full 16k x 8k fwd ms", do_bench(lambda: flashattn2.flash_attn_func(qq, kk[:, : L // 2], vv[:, : L // 2])))
print("full 8k x 16k fwd ms", do_bench(lambda: flashattn2.flash_attn_func(qq[:, L // 2 :], kk, vv)))
