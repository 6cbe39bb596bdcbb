"""Host time per call of two source trees side by side, launches stubbed (no GPU): was a change to the host path
speed-neutral? Each tree runs `bench host`'s cases (flashattn2.bench.host.cases: a decode step, the dense, varlen and
packed forwards, forward + backward, the private functions; SDPA and an empty custom op, the same code on both sides:
the noise floor) in a worker process of its own, through Triton's interpreter with every launch a no-op
(ops.launch.launcher.stubbed); the rounds alternate which tree goes first.

Both workers are pinned to one CPU core: two unpinned processes on this project's 2-core VMs read the same source
1.4-1.6x apart, one process slower than the other for a whole run (the same tree against itself, pinned: 0.97-1.04).

    python tools/host_ab.py BEFORE/src AFTER/src [--rounds 16] [--calls 50] [--core 0] [--cases with_kvcache,func]

BEFORE/src: e.g. `git archive REV src | tar -x -C /tmp/before`. Prints, per case, each tree's median microseconds
per call and the median of the rounds' B/A ratios with their interquartile range.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, os, sys, time
core = int(sys.argv[2])
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {core})
sys.path.insert(0, sys.argv[1])
import flashattn2
from flashattn2.bench import host
from flashattn2.ops.launch import launcher
wanted = [w for w in sys.argv[4].split(",") if w]
table = {name: fn for name, (fn, _) in host.cases("cpu").items() if not wanted or any(w in name for w in wanted)}
calls = int(sys.argv[3])
with launcher.stubbed():
    for fn in table.values():
        for _ in range(10):
            fn()
    print(json.dumps(sorted(table)), flush=True)
    for line in sys.stdin:
        out = {}
        for name, fn in table.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = (time.perf_counter() - t) / calls * 1e6
        print(json.dumps(out), flush=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", help="the first source tree (its src/ folder: holds flashattn2/)")
    ap.add_argument("b", help="the second source tree")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--calls", type=int, default=50, help="calls per case per round")
    ap.add_argument("--core", type=int, default=0, help="the CPU core both workers are pinned to")
    ap.add_argument("--cases", default="", help="comma-separated parts of the case names to keep (default: all)")
    args = ap.parse_args(argv)
    env = dict(os.environ, TRITON_INTERPRET="1")
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, tree, str(args.core), str(args.calls), args.cases],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for tree in (args.a, args.b)
    ]
    names = [json.loads(w.stdout.readline() or "null") for w in workers]
    if names[0] is None or names[0] != names[1]:
        for w in workers:
            w.kill()
        print(f"the trees' cases differ or a worker failed: {names}", file=sys.stderr)
        return 2
    times: list[list[dict]] = [[], []]
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            workers[i].stdin.write("go\n")
            workers[i].stdin.flush()
            times[i].append(json.loads(workers[i].stdout.readline()))
    for w in workers:
        w.stdin.close()
        w.wait()
    print(f"{'case':32} {'A us':>8} {'B us':>8}  B/A (IQR), {args.rounds} rounds, core {args.core}")
    for name in names[0]:
        a, b = ([t[name] for t in side] for side in times)
        ratios = sorted(y / x for x, y in zip(a, b))
        n = len(ratios)
        print(
            f"{name:32} {statistics.median(a):8.1f} {statistics.median(b):8.1f}  {statistics.median(ratios):.3f} "
            f"({ratios[n // 4]:.3f}-{ratios[(3 * n) // 4]:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
