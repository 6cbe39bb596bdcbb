"""The fuzzer (tests/fuzz_cases.py) for as long as asked: random calls across flashattn2's public API against the
reference, on a GPU at realistic sizes (or the CPU interpreter at the CI's tiny ones). tests/test_fuzz.py runs the
same cases in CI for 40 s.

    python tools/fuzz.py [--seconds 300] [--device cuda|cpu] [--seed S] [--functions func,kvcache,...]
    python tools/fuzz.py --seed S --case I        (one case, replayed: what a failure printed)

Prints each failing case as the `Case(...)` that replays it (paste it into a test: fuzz_cases.run(Case(...),
DEVICE)), then a summary of the cases run per function; exits 1 if any failed. On the CPU it sets TRITON_INTERPRET
itself. tools/gpu_session.sh's "fuzz" stage runs it on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0, help="wall time to fuzz for (default 300)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default: a fresh one, printed)")
    ap.add_argument("--case", type=int, default=None, help="run only this case of the seed's run, and print it")
    ap.add_argument("--first", type=int, default=0, help="the first case's index (default 0)")
    ap.add_argument("--sizes", choices=["cpu", "gpu"], default=None, help="the sizes drawn (default: the device's)")
    ap.add_argument("--functions", default=None, help="comma-separated keys of fuzz_cases.API (default: all)")
    args = ap.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before flashattn2's kernels import triton
    import fuzz_cases
    from flashattn2.ops.launch import launcher

    launcher.VERIFY_LAUNCH = device == "cuda"  # as the tests: every direct launch checked against Triton's choice
    sizes = {"cpu": fuzz_cases.CPU, "gpu": fuzz_cases.GPU}[args.sizes or ("gpu" if device == "cuda" else "cpu")]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    functions = args.functions.split(",") if args.functions else None
    unknown = set(functions or ()) - set(fuzz_cases.API)
    if unknown:
        ap.error(f"--functions: unknown {sorted(unknown)}; expected some of {sorted(fuzz_cases.API)}")
    if args.case is not None:
        case = fuzz_cases.draw(seed, args.case, sizes, functions)
        print(case, flush=True)
        fuzz_cases.run(case, device)
        print(f"case {seed}:{args.case} passed")
        return 0

    print(f"fuzz seed={seed} on {device} ({args.seconds:.0f} s, {'gpu' if sizes.gpu else 'cpu'} sizes)", flush=True)
    counts = collections.Counter()
    log = lambda text: print(text, flush=True)  # noqa: E731
    start = time.monotonic()
    count, failures = fuzz_cases.fuzz(seed, args.seconds, sizes, device, log, functions, args.first)
    for index in range(args.first, args.first + count):
        counts[fuzz_cases.draw(seed, index, sizes, functions).fn] += 1
    print(f"fuzz seed={seed}: {count} cases in {time.monotonic() - start:.0f} s, {len(failures)} failed")
    print("  " + ", ".join(f"{fn} {n}" for fn, n in sorted(counts.items())))
    for index, case, error in failures:
        print(
            f"  replay: python tools/fuzz.py --seed {seed} --case {index}{' --device cpu' if device == 'cpu' else ''}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
