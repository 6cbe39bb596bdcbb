"""Representative launches with the arguments flashattn2 really passes, captured from its public API (a prepared
call's launcher.Launch objects, ops/run/call.py) on tiny CPU tensors planned for sm_90, and the check that a
launcher.Launch's direct call hands Triton's C launcher what Triton's own path hands it. Runs under the fake CUDA
driver (tests/fake_cuda.py) in a process without TRITON_INTERPRET:

    python tests/launch_cases.py --check      (one JSON line per case; tests/test_launch_driver.py)

tools/launch_host.py measures the same cases' host time per launch."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("launch_cases: unset TRITON_INTERPRET first (the fake driver runs Triton's compiled path)")
os.environ.setdefault("FLASHATTN2_HOPPER", "1")  # the Gluon kernels on every Triton release (a tested one or not)

import torch  # noqa: E402

import flashattn2  # noqa: E402
from fake_cuda import FakeCuda  # noqa: E402
from flashattn2.ops import _runtime, planning  # noqa: E402
from flashattn2.ops.request import checks  # noqa: E402
from flashattn2.ops.launch import launcher  # noqa: E402
from flashattn2.ops.run import call as calls  # noqa: E402
from flashattn2.ops.request import spec as specs  # noqa: E402
from flashattn2.ops.planning import dense  # noqa: E402

DEVICE = "cpu"  # tools/launch_host.py --gpu: "cuda" (the same launches on a Hopper GPU, no fake driver)


class Case(NamedTuple):
    name: str
    kernel: object  # the JITFunction (or GluonJITFunction)
    grid: tuple
    args: tuple  # as the prepared call passes them to its launcher.Launch (HostDesc for host-built descriptors)
    kwargs: dict  # the Launch's keywords: the constexprs and launch options its plan fixed


@contextlib.contextmanager
def on_sm90():
    """flashattn2 made to plan and launch for an H100 on CPU tensors, outside the interpreter: every call's modes
    say sm90 (ops.request.spec.modes; on a CPU tensor they would say "interp"), the device is a wgmma one (the Gluon
    kernels' condition, planning's dense.wgmma) with 132 SMs (_runtime.sm_count: the decode's splits, the persistent
    grids), CPU tensors pass the device check (which allows them only in the interpreter), and the TMA scratch allocator
    is left to the fake driver's (_runtime.ensure_tma_allocator would install a CUDA one). Prepared calls made inside
    are dropped on both sides (their plans are sm90's). No-op with DEVICE "cuda": the GPU answers for itself."""
    if DEVICE != "cpu":
        yield
        return
    saved = (specs.modes, dense.wgmma, _runtime.sm_count, checks.check_device, _runtime.ensure_tma_allocator)
    specs.modes = lambda t: specs.Modes("sm90", planning.forced(), False)
    dense.wgmma = lambda device: True
    _runtime.sm_count = lambda device: 132
    checks.check_device = lambda device, name: None
    _runtime.ensure_tma_allocator = lambda: None
    calls.clear()
    try:
        yield
    finally:
        specs.modes, dense.wgmma, _runtime.sm_count, checks.check_device, _runtime.ensure_tma_allocator = saved
        calls.clear()


def _captured(name: str, run) -> tuple:
    """(kernel, grid, args, kwargs) of the one launch of the kernel `name` that run() makes through a prepared
    call's Launch, nothing launched (launcher.stubbed)."""
    got = []

    def watch(kernel, grid, args, kwargs):
        if kernel.__name__ == name:
            got.append((kernel, grid, args, kwargs))

    with on_sm90(), launcher.stubbed(), launcher.watched(watch):
        run()
    assert len(got) == 1, (name, [g[1] for g in got])
    return got[0]


def _randn(*shape, requires_grad=False) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float16, device=DEVICE).requires_grad_(requires_grad)


def _fwd(name: str, host_desc: bool) -> Case:
    """The Triton forward (the Gluon one off), causal, on pointers or on host-built descriptors."""
    q, k, v = (_randn(2, 128, 4, 64) for _ in range(3))
    force = dict(tma=True, host_desc=True) if host_desc else dict(tma=False)

    def run():
        with planning.force(hopper=False, **force):
            flashattn2.flash_attn_func(q, k, v, causal=True)

    call = _captured("attn_fwd_kernel", run)
    assert call[3]["PATH"].HOST_DESC is host_desc, call[3]
    return Case(name, *call)


def _kvcache() -> Case:
    """A decode step (one query) over a GQA cache, its keys split over programs (num_splits 0: 132 SMs choose)."""
    batch, nheads, nheads_k, d, capacity = 2, 8, 2, 128, 256
    q = _randn(batch, 1, nheads, d)
    k, v = (_randn(batch, capacity, nheads_k, d) for _ in range(2))
    seqlens = torch.tensor([100, 200], dtype=torch.int32, device=DEVICE)
    call = _captured(
        "attn_kvcache_kernel", lambda: flashattn2.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
    )
    assert call[3]["PATH"].SPLIT, call[3]
    return Case("attn_kvcache_kernel (decode, split)", *call)


def _gluon_bwd(d: int, dv: int) -> Case:
    """The Gluon backward (deterministic=False); q/k head dim d, v's dv. A d that is two powers of two (192 = 128 +
    64) takes two descriptors for each of Q, K, dK and the dQ accumulator (11 in all)."""
    b, n, h = 1, 256, 4
    q, k = (_randn(b, n, h, d, requires_grad=True) for _ in range(2))
    v = _randn(b, n, h, dv, requires_grad=True)

    def run():
        out = flashattn2.flash_attn_func(q, k, v, deterministic=False)
        out.backward(torch.ones_like(out))

    call = _captured("attn_bwd_ws_kernel", run)
    described = sum(type(a) is launcher.HostDesc for a in call[2])
    return Case(f"attn_bwd_ws_kernel (Gluon, {described} host descriptors)", *call)


def _gluon_fwd(fp8: bool) -> Case:
    """The Gluon forward, causal: fp16 at d128 (the persistent kernel), or e4m3 with FA3's descales at d256 (the
    warp-specialized kernel, V through the transposed FP8 copy's descriptor)."""
    b, n, h, d = (1, 64, 2, 256) if fp8 else (1, 256, 4, 128)
    q, k, v = (_randn(b, n, h, d) for _ in range(3))
    descales = {}
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        descales = {f"{x}_descale": torch.rand(b, h, device=DEVICE) + 0.5 for x in "qkv"}
    name = "attn_fwd_ws_kernel" if fp8 else "attn_fwd_persist_kernel"
    call = _captured(name, lambda: flashattn2.flash_attn_func(q, k, v, causal=True, **descales))
    described = sum(type(a) is launcher.HostDesc for a in call[2])
    return Case(f"{name} (Gluon{', FP8' * fp8}, {described} host descriptors)", *call)


def _fill_tail() -> Case:
    """A varlen forward whose rows past cu_seqlens[-1] (30 of 40) get out 0 and lse +inf."""
    q, k, v = (_randn(40, 4, 64) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)

    def run():
        flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20)

    return Case("fill_tail_kernel", *_captured("fill_tail_kernel", run))


BUILDERS = {
    "fwd": lambda: _fwd("attn_fwd_kernel (pointers)", host_desc=False),
    "fwd-host-desc": lambda: _fwd("attn_fwd_kernel (HOST_DESC, 4 host descriptors)", host_desc=True),
    "kvcache": _kvcache,
    "gluon-bwd": lambda: _gluon_bwd(128, 128),
    "gluon-bwd-192": lambda: _gluon_bwd(192, 128),
    "fill-tail": _fill_tail,
    "gluon-fwd": lambda: _gluon_fwd(fp8=False),
    "gluon-fwd-fp8": lambda: _gluon_fwd(fp8=True),
}


def cases(names=None) -> list[Case]:
    return [BUILDERS[n]() for n in (names or BUILDERS)]


@contextlib.contextmanager
def triton_paths(case: Case, out: list):
    """Each launch that takes Triton's own path (JITFunction.run, not a warmup) for the case's kernel appends 1 to
    out: a Launch's direct call takes none."""
    kernel = case.kernel
    run = kernel.run

    def counted(*args, **kwargs):
        if not kwargs.get("warmup"):
            out.append(1)
        return run(*args, **kwargs)

    kernel.run = counted  # kernel[grid] calls self.run: the instance's own
    try:
        yield
    finally:
        del kernel.run


def triton_launch(case: Case):
    """Triton's own path (kernel[grid], a HostDesc as its TensorDescriptor): the compiled kernel."""
    compiled = case.kernel[case.grid](*launcher._for_triton(case.args), **case.kwargs)
    return compiled.result() if hasattr(compiled, "result") else compiled


def bound_args(case: Case) -> tuple:
    """Every kernel parameter's value in order as Triton's path binds it (HostDesc as TensorDescriptor): the
    positional arguments, then the keywords (the launch options excluded)."""
    args = launcher._for_triton(case.args)
    return (*args, *(case.kwargs[p.name] for p in case.kernel.params[len(args) :]))


def run_launch(case: Case, compiled) -> None:
    """The compiled kernel's run with the current stream and the bound arguments, no launch hooks: what a caller
    that remembers the compiled kernel calls."""
    gx, gy, gz = (*case.grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound_args(case))


def moved_case(case: Case) -> Case:
    """The case with each tensor (a descriptor's too) replaced by a copy: what a later call of the same prepared call
    launches (a tensor that appears twice is copied once)."""
    copies: dict = {}

    def moved(t):
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        return copies[id(t)]

    args = []
    for a in case.args:
        if isinstance(a, torch.Tensor):
            a = moved(a)
        elif type(a) is launcher.HostDesc:
            a = launcher.HostDesc((moved(a[0]), *a[1:]))
        args.append(a)
    return case._replace(args=tuple(args))


def check(case: Case, fake: FakeCuda, verify: bool = True) -> dict:
    """Launch the case through Triton's own path, then three times through a fresh launcher.Launch (the first takes
    Triton's path and keeps the compiled kernel, the second and third call it directly, the third under
    VERIFY_LAUNCH): the driver must receive the same launch each time; then on copies of the tensors (moved_case),
    through Triton's path and the Launch, alike ("moved_same"). "triton_paths": the launches of each that went
    through JITFunction.run; "fills": the descriptors encoded at each (3.6's Launch encodes each distinct one once,
    elsewhere the compiled kernel's run encodes each at every launch)."""
    launcher._TMA_MAPS.clear()
    fake.launches.clear()
    launch = launcher.Launch(case.kernel, **case.kwargs)
    fills, paths, kept = [], [], None
    for i in range(4):
        n, counted = len(fake.tma_fills), []
        with triton_paths(case, counted):
            if i == 0:
                triton_launch(case)
            else:
                launcher.VERIFY_LAUNCH = verify and i == 3  # the kept kernel must be Triton's choice (as on the GPU)
                try:
                    launch(case.grid, *case.args)
                finally:
                    launcher.VERIFY_LAUNCH = False
        if i == 1:
            kept = launch.compiled
        fills.append(len(fake.tma_fills) - n)
        paths.append(len(counted))
        if i == 0:
            distinct = len(set(fake.tma_fills[n:]))  # CUtensorMaps (a box wider than the swizzle encodes as it)
    triton_path, *others = fake.launches
    # a later call's tensors: the same launch on copies (other addresses), Triton's path and the Launch's direct call
    moved = moved_case(case)
    fake.launches.clear()
    triton_launch(moved)
    launch(moved.grid, *moved.args)
    moved_same = fake.launches[0] == fake.launches[1] and fake.launches[0] != triton_path
    described = launch.described
    return {
        "case": case.name,
        "triton_paths": paths,
        "kept": kept is not None and launch.compiled is kept,
        "described": None if described is None else "triton" if described is launcher._TRITON_ENCODES else "once",
        "launches": 1 + len(others),
        "same": all(other == triton_path for other in others),
        "moved_same": moved_same,
        "fills": fills,
        "distinct_maps": distinct,
        "triton": repr(triton_path),
        "direct_launch": repr(others[-1]),
    }


def triton_only(case: Case, fake: FakeCuda) -> dict:
    """Triton's own path under the fake driver (what reached the C launcher, the descriptors encoded), and whether
    the compiled kernel's run (run_launch) hands the driver the same launch."""
    fake.launches.clear()
    fake.tma_fills.clear()
    compiled = triton_launch(case)
    fills = len(fake.tma_fills)
    run_launch(case, compiled)
    triton_path, run_path = fake.launches
    return {"launches": 1, "tma_fills": fills, "run_same": run_path == triton_path, "triton": repr(triton_path)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare the Launch's direct call's driver arguments")
    parser.add_argument("--triton-only", action="store_true", help="Triton's path and the compiled kernel's run")
    parser.add_argument("--cases", default=",".join(BUILDERS))
    parser.add_argument("--no-verify", action="store_true", help="without launcher.VERIFY_LAUNCH's check")
    args = parser.parse_args()
    with FakeCuda() as fake:
        for case in cases(args.cases.split(",")):
            row = {"case": case.name, "kernel": case.kernel.__name__}
            if args.triton_only:
                row.update(triton_only(case, fake))
            elif args.check:
                try:
                    row.update(check(case, fake, verify=not args.no_verify))
                except Exception as e:  # noqa: BLE001 -- reported: what the Launch breaks on
                    row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
