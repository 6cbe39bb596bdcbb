"""The sm_90 SASS of every configuration tools/compile_check.py builds (or those whose id contains --match), as
numbers to compare between Triton releases, compiled here without a GPU: registers, local memory and spill
instructions, instructions, wgmma count (HGMMA; QGMMA: e4m3), the three shortest loops of at least 60 instructions (the inner loops:
tools/sass_loops.py), the opcode mix. The same
kernel source under two Tritons (each with its own ptxas) should keep its wgmma count, spill nothing new and keep
its loops' sizes close; this is what the Gluon kernels are checked with before an untested Triton runs them.

    python tools/sass_mix.py --match hopper > mix-3.6.jsonl                      # under one Triton
    python tools/sass_mix.py --match hopper --against mix-3.6.jsonl             # under the other

With --against, each line also holds the differences from that file's line of the same id.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_loops  # noqa: E402

_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def summarize(sass: str, resources: str) -> dict:
    """The numbers of one kernel from `cuobjdump -sass` and `cuobjdump -res-usage` text."""
    regs, stack, _, local = map(int, _RES.search(resources).groups())
    instrs = sass_loops.parse(sass)
    ops = collections.Counter(sass_loops.opcode(text) for _, text in instrs)
    return {
        "regs": regs,
        "stack": stack,
        "local": local,
        "spill_stores": ops["STL"],
        "spill_loads": ops["LDL"],
        "instructions": len(instrs),
        "hgmma": ops["HGMMA"],
        "qgmma": ops["QGMMA"],  # wgmma with e4m3 operands (the FP8 forward)
        "loops": [sum(counts.values()) for _, _, counts in sass_loops.loops(instrs, 60)][:3],
        "mix": dict(ops.most_common(12)),
    }


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, flag, fh.name], capture_output=True, text=True, check=True).stdout


_COMPARED = ("regs", "stack", "local", "spill_stores", "spill_loads", "instructions", "hgmma", "qgmma")


def differences(now: dict, before: dict) -> dict:
    diff = {k: [before.get(k), now[k]] for k in _COMPARED if before.get(k) != now[k]}
    if before["loops"] != now["loops"]:
        diff["loops"] = [before["loops"], now["loops"]]
    return diff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm90", choices=("sm90", "sm80", "sm86"))
    ap.add_argument("--match", default="")
    ap.add_argument("--against", help="a file this tool wrote (under another Triton, or before a change)")
    args = ap.parse_args()
    import compile_check  # refuses TRITON_INTERPRET=1

    before = {}
    if args.against:
        with open(args.against) as fh:
            before = {row["id"]: row for row in map(json.loads, fh)}
    seen = set()
    for case in compile_check.cases(args.arch):
        name, fn, elem_bytes, constexprs, cfg, *types = case
        case_id = compile_check.case_id(name, cfg)
        if args.match not in case_id or case_id in seen:
            continue
        seen.add(case_id)
        kernel = compile_check.compile_kernel(fn, args.arch, elem_bytes, constexprs, cfg, *types)
        cubin = kernel.asm["cubin"]
        numbers = summarize(_cuobjdump(cubin, "-sass"), _cuobjdump(cubin, "-res-usage"))
        row = {"id": case_id, "triton": compile_check.triton.__version__, **numbers}
        if case_id in before:
            row["differs"] = differences(row, before[case_id])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
