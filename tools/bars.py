"""Issue #5's bars counted on a kernel-grid CSV (the latest row of each point and provider, as the
report takes them; the ratios of a point come from the run that measured flashattn2 there only if
its peers were measured in that run too -- the bench measures them together).

    python tools/bars.py [bench/results/kernels-nvidia-h200.csv]

Prints each bar's count of passing points and the points that miss, with their ratios; for the last line (not a
bar: >= 1.0x cuDNN), the points that reach it (#5 asks for them listed)."""

from __future__ import annotations

import sys

from flashattn2.bench import report

BARS = [  # (name, which points, mode(s), peer, ratio)
    ("d64/d128 forward >= 0.9x cuDNN", lambda d: d in (64, 128), ("fwd",), "sdpa_cudnn", 0.9),
    ("d64/d128 backward >= 0.8x cuDNN", lambda d: d in (64, 128), ("bwd",), "sdpa_cudnn", 0.8),
    ("d256 forward >= 1.5x SDPA flash", lambda d: d == 256, ("fwd",), "sdpa_flash", 1.5),
    ("d256 backward >= 1.0x cuDNN", lambda d: d == 256, ("bwd",), "sdpa_cudnn", 1.0),
    (">= 1.2x SDPA flash", lambda d: True, ("fwd", "bwd", "fwd_bwd"), "sdpa_flash", 1.2),
    ("(not a bar) >= 1.0x cuDNN", lambda d: True, ("fwd", "bwd", "fwd_bwd"), "sdpa_cudnn", 1.0),
]


def main(path: str) -> None:
    groups = report.groups(report.load(path))
    for kind in sorted({key[1] for key in groups}):
        print(f"## {kind or 'dense'}")
        for name, dims, modes, peer, bar in BARS:
            passed, misses, reached = 0, [], []
            for (dtype, k, d, causal, mode), points in sorted(groups.items()):
                if k != kind or mode not in modes or not dims(d):
                    continue
                for seqlen, by in sorted(points.items()):
                    ours, theirs = by.get("flashattn2"), by.get(peer)
                    if ours is None or theirs is None or theirs != theirs:
                        continue
                    ratio = ours / theirs
                    point = f"{dtype} d{d} {'causal' if causal else 'full'} {mode} {seqlen}: {ratio:.3f}"
                    if ratio >= bar:
                        passed += 1
                        reached.append(point)
                    else:
                        misses.append(point)
            print(f"{name}: {passed}/{passed + len(misses)}")
            for m in reached if name.startswith("(not") else misses:
                print(f"    {m}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/kernels-nvidia-h200.csv")
