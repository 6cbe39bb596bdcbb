"""Representative launches with the arguments flashattn2 really passes, built by its own launchers
(ops/launch_triton.py, ops/kvcache.py, ops/launch_gluon.py, ops/geometry.py) on tiny CPU tensors for sm_90, and
the check that its direct launch path (ops.launcher.launch) hands Triton's C launcher what Triton's own path
hands it. Runs under the fake CUDA driver (tests/fake_cuda.py) in a process without TRITON_INTERPRET:

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

from fake_cuda import FakeCuda  # noqa: E402
from flashattn2.ops import _runtime, geometry, kvcache, launch_gluon, launch_triton, launcher, planning  # noqa: E402
from flashattn2.ops.geometry import Geometry  # noqa: E402
from flashattn2.ops.options import ScoreMods  # noqa: E402

ARCH = "sm90"
DEVICE = "cpu"  # tools/launch_host.py --gpu: "cuda" (the same launches on a Hopper GPU, no fake driver)


class Case(NamedTuple):
    name: str
    kernel: object  # the JITFunction (or GluonJITFunction)
    grid: tuple
    args: tuple  # as flashattn2 passes them to launcher.launch (HostDesc for host-built descriptors)
    kwargs: dict


@contextlib.contextmanager
def _captured(name: str, out: list):
    """launcher.launch replaced by one that keeps the named kernel's launch (and launches nothing)."""
    real = launcher.launch

    def keep(kernel, grid, *args, **kwargs):
        if kernel.__name__ == name:
            out.append((kernel, grid, args, kwargs))

    launcher.launch = keep
    try:
        yield
    finally:
        launcher.launch = real


@contextlib.contextmanager
def _on_sm90():
    """flashattn2's device queries answered for an H100 on CPU tensors (they would say "interp")."""
    saved = planning.arch_of, _runtime.sm_count
    planning.arch_of = lambda device: ARCH
    _runtime.sm_count = lambda device: 132
    try:
        yield
    finally:
        planning.arch_of, _runtime.sm_count = saved


def _fwd(name: str, tma: bool) -> Case:
    q, k, v = (torch.randn(2, 128, 4, 64, dtype=torch.float16, device=DEVICE) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(2, 4, 128, device=DEVICE)
    geo = Geometry.of(q, k, None, v)
    mods = ScoreMods(causal=True)
    got: list = []
    with planning.force(tma=tma), _captured("attn_fwd_kernel", got):
        runtime, flags = mods.kernel_args(geo.max_seqlen_q, geo.max_seqlen_k, lse)
        features = planning.Features(score_mods=not ScoreMods.only_causal(flags), gluon=False)
        plan = planning.plan(ARCH, q.dtype, 64, flags["CAUSAL"], geo.max_seqlen_k, features, "fwd", 64)
        launch_triton.forward(plan, q, k, v, out, lse, geo, ARCH, runtime, flags, q.shape[-1] ** -0.5)
    (call,) = got
    assert call[3]["HOST_DESC"] is tma, call[3]
    return Case(name, *call)


def _kvcache() -> Case:
    batch, nheads, nheads_k, d, capacity = 2, 8, 2, 128, 256
    q = torch.randn(batch, 1, nheads, d, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(batch, capacity, nheads_k, d, dtype=torch.float16, device=DEVICE) for _ in range(2))
    cache = kvcache.Cache(k, v, torch.tensor([100, 200], dtype=torch.int32, device=DEVICE), 0, None, None, None)
    got: list = []
    with _on_sm90(), _captured("attn_kvcache_kernel", got):
        kvcache.forward(q, cache, 1, d**-0.5, ScoreMods(causal=True), 0)
    (call,) = got
    return Case("attn_kvcache_kernel (decode, split)", *call)


def _gluon_bwd(d: int, dv: int) -> Case:
    """q/k head dim d, v's dv; a d that is two powers of two (192 = 128 + 64) takes two descriptors for each of
    Q, K, dK and the dQ accumulator (11 in all)."""
    b, n, h = 1, 256, 4
    q, k, dk = (torch.randn(b, n, h, d, dtype=torch.float16, device=DEVICE) for _ in range(3))
    v, out, dout, dv_ = (torch.randn(b, n, h, dv, dtype=torch.float16, device=DEVICE) for _ in range(4))
    lse = torch.randn(b, h, n, device=DEVICE)
    dq = torch.empty_like(q)
    geo = Geometry.of(q, k, None, v)
    features = planning.Features(gluon=True, deterministic=False)
    plan = planning.plan(ARCH, q.dtype, d, False, n, features, "bwd", dv)
    assert plan.kernel.startswith("bwd_hopper"), plan
    got: list = []
    with _captured("attn_bwd_ws_kernel", got):
        launch_gluon.BackwardLaunch(plan, geo, ARCH, q.dtype).run(dout, q, k, v, out, lse, None, dq, dk, dv_, d**-0.5)
    (call,) = got
    described = sum(type(a) is launcher.HostDesc for a in call[2])
    return Case(f"attn_bwd_ws_kernel (Gluon, {described} host descriptors)", *call)


def _fill_tail() -> Case:
    out, lse = torch.empty(40, 4, 64, dtype=torch.float16, device=DEVICE), torch.empty(4, 40, device=DEVICE)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    got: list = []
    with _captured("fill_tail_kernel", got):
        geometry.fill_tails((out, cu, 0.0, 0, None), (lse, cu, float("inf"), 1, None))
    (call,) = got
    return Case("fill_tail_kernel", *call)


BUILDERS = {
    "fwd": lambda: _fwd("attn_fwd_kernel (pointers)", tma=False),
    "fwd-host-desc": lambda: _fwd("attn_fwd_kernel (HOST_DESC, 4 host descriptors)", tma=True),
    "kvcache": _kvcache,
    "gluon-bwd": lambda: _gluon_bwd(128, 128),
    "gluon-bwd-192": lambda: _gluon_bwd(192, 128),
    "fill-tail": _fill_tail,
}


def cases(names=None) -> list[Case]:
    return [BUILDERS[n]() for n in (names or BUILDERS)]


def fresh_launcher() -> None:
    """Forget what the direct path remembered (kernels, encoded descriptors)."""
    launcher._LAUNCHED.clear()
    launcher._TMA_MAPS.clear()


def triton_launch(case: Case):
    """Triton's own path, as flashattn2 takes it when the direct one is off: the compiled kernel."""
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


def check(case: Case, fake: FakeCuda, verify: bool = True) -> dict:
    """Launch the case through Triton's path, then three times through flashattn2's launch (the first takes
    Triton's path and remembers the kernel, the others are direct): the driver must receive the same launch each
    time. "fills": the descriptors encoded at each launch (the direct path encodes each distinct one once)."""
    fresh_launcher()
    fake.launches.clear()
    fills = []
    before = launcher.direct_launches
    for i in range(4):
        n = len(fake.tma_fills)
        if i == 0:
            triton_launch(case)
        else:
            launcher.VERIFY_LAUNCH = verify and i > 1  # the remembered kernel must be Triton's choice (as on the GPU)
            try:
                launcher.launch(case.kernel, case.grid, *case.args, **case.kwargs)
            finally:
                launcher.VERIFY_LAUNCH = False
        fills.append(len(fake.tma_fills) - n)
        if i == 0:
            distinct = len(set(fake.tma_fills[n:]))  # CUtensorMaps (a box wider than the swizzle encodes as it)
    triton_path, *others = fake.launches
    return {
        "case": case.name,
        "direct": launcher.direct_launches - before,
        "same": all(other == triton_path for other in others),
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
    parser.add_argument("--check", action="store_true", help="compare the direct path's driver arguments")
    parser.add_argument("--triton-only", action="store_true", help="Triton's path and the compiled kernel's run")
    parser.add_argument("--cases", default=",".join(BUILDERS))
    parser.add_argument("--no-verify", action="store_true", help="without launcher.VERIFY_LAUNCH's check")
    args = parser.parse_args()
    launcher.DIRECT_LAUNCH = launcher.SUPPORTED or os.environ.get("FLASHATTN2_DIRECT_LAUNCH") == "1"
    with FakeCuda() as fake:
        for case in cases(args.cases.split(",")):
            row = {"case": case.name, "kernel": case.kernel.__name__}
            if args.triton_only:
                row.update(triton_only(case, fake))
            elif args.check:
                if not launcher.DIRECT_LAUNCH:
                    row["skipped"] = f"no direct path on triton {launcher.triton.__version__}"
                else:
                    try:
                        row.update(check(case, fake, verify=not args.no_verify))
                    except Exception as e:  # noqa: BLE001 -- reported: what a forced direct path breaks on
                        row["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
