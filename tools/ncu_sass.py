"""Where a kernel's warps stall, instruction by instruction: the SASS page of an ncu report, summarized.

    ncu --profile-from-start off --clock-control none --kernel-name regex:attn_bwd_ws --section WarpStateStats \\
        --section SourceCounters --import-source no -o /tmp/rep python tools/ncu_profile.py CASE
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python tools/ncu_sass.py sass.csv [--top 25] [--context 6]

Prints the share of all warp-stall samples in the main loop (the execution count with the most work) and the
top instructions by samples, each with its three largest stall reasons, the instructions before it (a stall on
`@!P0 BRA` closes an mbarrier try-wait loop: the SYNCS.PHASECHK above names the barrier's shared-memory offset),
and how often it ran. No GPU needed to read a CSV. (The d256 backward's wait for the dQ writer was found this
way: bench/results/ab-gluon-nvidia-h200.md.)
"""

from __future__ import annotations

import argparse
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path: str) -> list[dict]:
    """The CSV's instruction rows (ncu writes a "Kernel Name" line before the header)."""
    with open(path, newline="") as fh:
        lines = fh.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def _int(value) -> int:
    try:
        return int(str(value).replace(",", ""))
    except ValueError:
        return 0


def summary(rows: list[dict], top: int = 25, context: int = 6) -> str:
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    # the main loop: the execution count with the most work (count x instructions), not a try-wait spin's
    counts = {}
    for r in rows:
        counts[_int(r["Instructions Executed"])] = counts.get(_int(r["Instructions Executed"]), 0) + 1
    most = max(counts, key=lambda c: c * counts[c])
    loop = [i for i, r in enumerate(rows) if _int(r["Instructions Executed"]) == most]
    in_loop = sum(_int(rows[i][SAMPLES]) for i in range(loop[0], loop[-1] + 1))
    out = [
        f"{len(rows)} instructions, {total} samples; the hottest loop (instructions {loop[0]}-{loop[-1]}, "
        f"each run {most} times) holds {100 * in_loop / total:.1f}%"
    ]
    order = sorted(range(len(rows)), key=lambda i: -_int(rows[i][SAMPLES]))[:top]
    for i in order:
        r = rows[i]
        why = sorted(((_int(r[k]), k[len("stall_") :]) for k in reasons if _int(r[k]) > 0), reverse=True)[:3]
        out.append(
            f"\n[{i}] {100 * _int(r[SAMPLES]) / total:.1f}% {r['Source'].strip()}  "
            f"({', '.join(f'{name} {n}' for n, name in why)}; run {r['Instructions Executed']} times)"
        )
        for j in range(max(0, i - context), i):
            out.append(f"      {j:5d} {_int(rows[j][SAMPLES]):7d}  {rows[j]['Source'].strip()[:100]}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--context", type=int, default=6)
    args = ap.parse_args()
    print(summary(load(args.csv), args.top, args.context))


if __name__ == "__main__":
    main()
