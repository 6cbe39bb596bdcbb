"""Host time per launch of flashattn2's kernels on the CPU, the driver stubbed (tests/fake_cuda.py): the same
launches (tests/launch_cases.py: the arguments flashattn2's public API passes to its launcher.Launch objects, tiny
CPU tensors, compiled for sm_90) through each path, under whichever Triton runs this:

  triton   kernel[grid](*args, **kwargs), descriptors prebuilt as Triton's TensorDescriptor: Triton's own path
  launch   a launcher.Launch's direct call (its first call, Triton's path, made before timing): what a prepared
           call pays per launch
  run      the floor: the compiled kernel's run(...) with the current stream and the arguments bound beforehand
           (Triton's launcher still encodes every descriptor, its fill stubbed)
  run-encoded  (host-built descriptors, triton 3.6: launcher.DESCRIPTORS_ENCODED_ONCE) the C launcher called as the
           Launch calls it, the descriptors encoded beforehand: the floor of a caller that also keeps them encoded

Each round times every (case, path) as the median over --batches batches of --n launches (after a warm-up);
the table gives the median over rounds and their spread (min-max). The C launcher and the driver are stubs: their
costs (argument parsing, cuPointerGetAttribute per tensor, cuTensorMapEncodeTiled, cuLaunchKernelEx) are not in
these numbers.

    python tools/launch_host.py [--rounds 5] [--n 20] [--batches 100] [--cases fwd,kvcache] [--json FILE]
(in a process without TRITON_INTERPRET; TRITON_CACHE_DIR keeps the compiled kernels between runs). Batches are short
(20 launches: well under a scheduler time slice) so that their median is not a batch another process preempted
(on a busy host, batches of a few milliseconds each lost 20 us per launch). --gpu: the same launches on a Hopper GPU,
with the real driver (the GPU synchronized before each batch), to see what the stubs leave out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import triton  # noqa: E402

import launch_cases  # noqa: E402
from fake_cuda import FakeCuda  # noqa: E402
from flashattn2.ops.launch import launcher  # noqa: E402

PATHS = ("triton", "launch", "run", "run-encoded")


def launches(case: launch_cases.Case) -> dict:
    """path -> a function of no arguments that launches the case that way (a path that cannot: why, a string)."""
    _, kernel, grid, args, kwargs = case
    triton_args = launcher._for_triton(args)
    compiled = launch_cases.triton_launch(case)
    bound = launch_cases.bound_args(case)
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    gx, gy, gz = (*grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream

    def triton_path():
        kernel[grid](*triton_args, **kwargs)

    def floor():
        run(gx, gy, gz, stream(0), function, meta, None, None, None, *bound)

    launch = launcher.Launch(kernel, **kwargs)
    launch(grid, *args)  # Triton's path: the compiled kernel kept
    paths = []
    with launch_cases.triton_paths(case, paths):
        launch(grid, *args)
    assert launch.compiled is not None and not paths, "the Launch's second call did not call the kernel directly"

    def direct():
        launch(grid, *args)

    out = {"triton": triton_path, "launch": direct, "run": floor}
    described = launch.described
    if described is None:
        out["run-encoded"] = "no host-built descriptors"
    elif not isinstance(described, launcher._Described):
        out["run-encoded"] = f"triton {triton.__version__}: the compiled kernel's run encodes them"
    else:
        pointers = [a.data_ptr() if i in launch.pointers else a for i, a in enumerate(args)]
        encoded = described.expand(pointers)
        raw, constexprs = described.launch, launch.constexprs

        def floor_encoded():
            raw(gx, gy, gz, stream(0), function, meta, None, None, None, *encoded, *constexprs)

        out["run-encoded"] = floor_encoded
    return out


def per_launch_us(fn, n: int, batches: int, sync=None) -> tuple[float, float]:
    """(wall, this process's CPU) us per launch: medians over the batches (sync: called before each)."""
    for _ in range(max(20, n // 4)):
        fn()
    wall, cpu = [], []
    for _ in range(batches):
        if sync is not None:
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            fn()
        wall.append((time.perf_counter() - t0) / n * 1e6)
        cpu.append((time.process_time() - c0) / n * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(launch_cases.BUILDERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--gpu", action="store_true", help="on the GPU, the real driver")
    parser.add_argument("--c-launcher", action="store_true", help="Triton's C launcher, against a stub libcuda")
    parser.add_argument("--json", help="write the rows there too")
    args = parser.parse_args()
    if args.gpu:
        launch_cases.DEVICE = "cuda"
    sync = torch.cuda.synchronize if args.gpu else None
    with contextlib.nullcontext() if args.gpu else FakeCuda(record=False, c_launcher=args.c_launcher):
        cases = launch_cases.cases(args.cases.split(","))
        fns = {case.name: launches(case) for case in cases}
        samples: dict = {(c, p): [] for c in fns for p in PATHS if callable(fns[c][p])}
        for _ in range(args.rounds):
            for c, paths in fns.items():
                for p in PATHS:
                    if callable(paths[p]):
                        samples[c, p].append(per_launch_us(paths[p], args.n, args.batches, sync))
    rows = []
    where = torch.cuda.get_device_name() if args.gpu else "CPU, fake driver" + (", C launcher" * args.c_launcher)
    print(
        f"{where}: triton {triton.__version__}, host us per launch (median of {args.rounds} rounds, min-max; CPU time)"
    )
    for c, paths in fns.items():
        row = {"case": c, "triton": triton.__version__, "where": where}
        for p in PATHS:
            if (c, p) in samples:
                s, cpu = [w for w, _ in samples[c, p]], [u for _, u in samples[c, p]]
                row[p] = {
                    "median": round(statistics.median(s), 2),
                    "min": round(min(s), 2),
                    "max": round(max(s), 2),
                    "cpu": round(statistics.median(cpu), 2),
                }
            else:
                row[p] = paths[p]
        rows.append(row)
        cells = [
            f"{p} {row[p]['median']:.2f} ({row[p]['min']:.2f}-{row[p]['max']:.2f}; {row[p]['cpu']:.2f})"
            if isinstance(row[p], dict)
            else f"{p}: {row[p]}"
            for p in PATHS
        ]
        print(f"{c}: " + "; ".join(cells), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
