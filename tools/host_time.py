"""Host time of flashattn2's eager calls on the sm_90 paths, measured on any machine (no GPU):
the kernels are not run. CPU tensors stand in for CUDA ones, the architecture is reported as
sm_90, and `_runtime.launch` is replaced by a stub that does the direct launch's host work
(`_runtime._bound`: the binder, the key) and stops before the driver call. What this leaves
out: the driver's launch (~5-10 us per kernel), the CUDA caching allocator and each torch op's
own CUDA launch, which is why it also counts the torch ops a call runs (`--ops`).

    python tools/host_time.py [--shape 2,128,4,128] [--rounds 7] [--calls 300] [--profile FILE] [--ops]

Prints the median microseconds per call of a forward, a forward + backward
(deterministic=False: the Gluon backward's host path) and a deterministic forward + backward
(the Triton backward's), with the launches per call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.pop("TRITON_INTERPRET", None)  # the kernels as JITFunctions: launching them is stubbed

import torch  # noqa: E402

import flashattn2  # noqa: E402
from flashattn2.ops import _runtime, checks, config  # noqa: E402

launches: list[str] = []


def _stub_launch(kernel, grid, *args, **kwargs):
    bound = _runtime._bound(kernel, args, kwargs)
    if bound is not None:
        _runtime._LAUNCHED.get((bound[0], 0))
    launches.append(kernel.__name__)


def install_stubs() -> None:
    """Make this process take the sm_90 paths with CPU tensors and stubbed launches."""
    _runtime.interpreted = lambda: False
    checks.check_device = lambda device, name: None  # CPU tensors stand in for CUDA ones
    _runtime.launch = _stub_launch
    _runtime.sm_count = lambda device: 132
    config.arch_of = lambda device: "sm90"
    config.wgmma = lambda device: True
    if _runtime.hopper_kernels() is None:
        raise SystemExit("the Gluon kernels do not import with this triton: the sm_90 path cannot be stubbed")


def _cases(shape, dtype):
    b, n, h, d = shape
    q, k, v = (torch.randn(b, n, h, d, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(b, n, h, d, dtype=dtype)

    def fwd():
        with torch.no_grad():
            flashattn2.flash_attn_func(q, k, v, causal=True)

    def fwd_bwd(deterministic):
        def run():
            out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
            torch.autograd.grad(out, (q, k, v), do)
        return run

    return {"fwd": fwd, "fwd+bwd (gluon bwd)": fwd_bwd(False), "fwd+bwd (deterministic)": fwd_bwd(True)}


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def count_ops(fn) -> list[str]:
    """The aten ops one call runs (torch's dispatcher, CPU side)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,128,4,128", help="batch,seqlen,nheads,headdim")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", default=None, help="write cProfile tables of each case here")
    ap.add_argument("--ops", action="store_true", help="list the aten ops of each case")
    args = ap.parse_args()
    install_stubs()
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cases = _cases(shape, dtype)
    for name, fn in cases.items():
        launches.clear()
        fn()
        first = list(launches)
        launches.clear()
        fn()
        print(f"{name:26} launches: {', '.join(launches)}" + ("" if launches == first else " (first call differs)"))
    results = {name: [] for name in cases}
    for _ in range(args.rounds):  # rounds alternate the cases: drift hits all alike
        for name, fn in cases.items():
            results[name].append(per_call_us(fn, args.calls))
    for name, times in results.items():
        print(f"{name:26} {statistics.median(times):7.1f} us/call (median of {args.rounds} x {args.calls}; "
              f"spread {min(times):.1f}-{max(times):.1f})")
    if args.ops:
        for name, fn in cases.items():
            ops = count_ops(fn)
            print(f"{name:26} {len(ops)} aten ops: {' '.join(ops)}")
    if args.profile:
        from overhead import profile_to  # beside this file

        with open(args.profile, "w") as fh:
            for name, fn in cases.items():
                profile_to(fh, name, fn, args.calls, top=30)


if __name__ == "__main__":
    main()
