"""Host time per call (CPU-bound: tiny inputs, no sync inside the loop) of flashattn2's entry points
beside SDPA's, and a cProfile of the dense forward: what a decode step or a short sequence pays
before any kernel runs.  python tools/overhead.py [--profile FILE]"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import flashattn2


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def profile_to(fh, name: str, fn, calls: int, top: int = 25) -> None:
    """cProfile of `calls` calls of fn, written to fh: by own time, then by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    print(f"===== {name}", file=fh)
    pstats.Stats(prof, stream=fh).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=fh).sort_stats("cumulative").print_stats(top + 15)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.float16
    q, k, v = (torch.randn(1, 128, 4, 64, device=dev, dtype=dt) for _ in range(3))
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    qv, kv_, vv = (t.reshape(128, 4, 64) for t in (q, k, v))
    cu = torch.tensor([0, 50, 128], device=dev, dtype=torch.int32)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fwd_bwd():
        out = flashattn2.flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), do)

    qsg, ksg, vsg = (t.detach().requires_grad_() for t in (qs, ks, vs))
    dos = do.transpose(1, 2).contiguous()

    def sdpa_fwd_bwd():
        out = F.scaled_dot_product_attention(qsg, ksg, vsg, is_causal=True)
        torch.autograd.grad(out, (qsg, ksg, vsg), dos)

    cases = {
        "flashattn2 fwd": lambda: flashattn2.flash_attn_func(q, k, v, causal=True),
        "flashattn2 varlen fwd": lambda: flashattn2.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 78, 78, causal=True),
        "flashattn2 fwd+bwd": fwd_bwd,
        "sdpa fwd": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
        "sdpa fwd+bwd": sdpa_fwd_bwd,
    }
    from flashattn2.ops import planning

    cases["planning.arch_of"] = lambda: planning.arch_of(q.device)
    cases["torch.empty_like"] = lambda: torch.empty_like(q)
    with torch.no_grad():
        for name in ("flashattn2 fwd", "flashattn2 varlen fwd", "sdpa fwd", "planning.arch_of", "torch.empty_like"):
            host, wall = per_call_us(cases[name])
            print(f"{name:24} host {host:7.1f} us/call   wall {wall:7.1f} us/call")
    # decoding: batch 8, 32 query heads over 8 K/V heads, 8k cache, bf16
    b, hk, n = 8, 8, 8192
    bf = torch.bfloat16
    dq = torch.randn(b, 1, 32, 128, device=dev, dtype=bf)
    kc, vc = (torch.randn(b, n, hk, 128, device=dev, dtype=bf) for _ in range(2))
    seqlens = torch.full((b,), n - 1, dtype=torch.int32, device=dev)
    kn, vn = (torch.randn(b, 1, hk, 128, device=dev, dtype=bf) for _ in range(2))
    ang = torch.rand(n + 16, 64, device=dev)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    kp, vp = (torch.randn(b * n // 16, 16, hk, 128, device=dev, dtype=bf) for _ in range(2))
    table = torch.randperm(b * n // 16, device=dev, dtype=torch.int32).view(b, n // 16)
    dqs, kcs, vcs = (t.transpose(1, 2) for t in (dq, kc, vc))
    decode = {
        "kvcache decode": lambda: flashattn2.flash_attn_with_kvcache(dq, kc, vc, cache_seqlens=seqlens),
        "kvcache append+rotary": lambda: flashattn2.flash_attn_with_kvcache(
            dq, kc, vc, kn, vn, cos, sin, cache_seqlens=seqlens, causal=True
        ),
        "kvcache paged-16": lambda: flashattn2.flash_attn_with_kvcache(
            dq, kp, vp, cache_seqlens=seqlens, block_table=table
        ),
        "sdpa decode": lambda: F.scaled_dot_product_attention(dqs, kcs, vcs, enable_gqa=True),
    }
    cases.update(decode)
    for name, fn in decode.items():
        host, wall = per_call_us(fn)
        print(f"{name:24} host {host:7.1f} us/call   wall {wall:7.1f} us/call")
    for name in ("flashattn2 fwd+bwd", "sdpa fwd+bwd"):
        host, wall = per_call_us(cases[name])
        print(f"{name:24} host {host:7.1f} us/call   wall {wall:7.1f} us/call")
    if args.profile:
        with open(args.profile, "w") as fh:
            for name in ("flashattn2 fwd", "kvcache decode", "kvcache append+rotary", "flashattn2 fwd+bwd"):
                with torch.set_grad_enabled(name.endswith("bwd")):
                    profile_to(fh, name, cases[name], 300)


if __name__ == "__main__":
    main()
