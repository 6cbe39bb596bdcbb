"""Instructions per loop of a kernel's sm_90 SASS, compiled here without a GPU: how a change to an inner loop
moves its instruction count and mix before it is measured.

    python tools/sass_loops.py --match "d64-fp16-fwd_hopper_persist-causal 64x64w12s4" [--min 60] [--sass FILE]

Compiles the first tools/compile_check.py configuration whose id with its tile (compile_check.case_id, as
tools/ptx_hash.py prints them) contains --match, disassembles it with the cuobjdump that
ships with triton, and prints every loop (a backward branch: its target to the branch) of at least --min
instructions, innermost first, with its most frequent opcodes. A kernel's inner loops are the short ones; an
mbarrier try-wait spin shows as a long loop closed far away and can be told by its SYNCS/BRA mix. Static counts:
per loop trip, not weighted by how often it runs (ncu_sass.py reads that from a profile). E.g. one compare and
one select per masked score took the forward's masked loop from 825 to 671 instructions at d64 128(x2)x64.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)")
_GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in cuobjdump -sass output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The opcode without its predicate guard and modifiers: '@!P0 ISETP.GT.AND P1, ...' -> 'ISETP'."""
    return _GUARD.sub("", text).split()[0].split(".")[0]


def loops(instrs: list[tuple[int, str]], min_len: int = 1) -> list[tuple[int, int, collections.Counter]]:
    """(first address, branch address, opcode counts) of each backward branch's range of at least min_len
    instructions, shortest first."""
    found = []
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            lo = int(m.group(1), 16)
            body = [opcode(t) for a, t in instrs if lo <= a <= addr]
            if len(body) >= min_len:
                found.append((lo, addr, collections.Counter(body)))
    return sorted(found, key=lambda loop: sum(loop[2].values()))


def compile_sass(match: str) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_check  # noqa: E402  (refuses TRITON_INTERPRET=1)

    cases = list(compile_check.cases("sm90"))
    exact = [case for case in cases if compile_check.case_id(case[0], case[4]) == match]
    # an exact id first: 'd128-...-causal 64x64w12s3' is also a substring of the id of its q1 variant
    for name, fn, elem_bytes, constexprs, cfg, *types in exact or cases:
        if match in compile_check.case_id(name, cfg):
            kernel = compile_check.compile_kernel(fn, "sm90", elem_bytes, constexprs, cfg, *types)
            cuobjdump = os.path.join(
                os.path.dirname(compile_check.triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
            )
            with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
                fh.write(kernel.asm["cubin"])
                fh.flush()
                return subprocess.run([cuobjdump, "-sass", fh.name], capture_output=True, text=True, check=True).stdout
    raise SystemExit(f"no sm90 configuration matches {match!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", required=True, help="part of a configuration's id with its tile (compile_check.case_id)")
    ap.add_argument("--min", type=int, default=60, help="shortest loop printed (instructions)")
    ap.add_argument("--top", type=int, default=14, help="opcodes printed per loop")
    ap.add_argument("--sass", help="also write the disassembly here")
    args = ap.parse_args()
    sass = compile_sass(args.match)
    if args.sass:
        with open(args.sass, "w") as fh:
            fh.write(sass)
    for lo, hi, counts in loops(parse(sass), args.min):
        mix = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
        print(f"{lo:#07x}-{hi:#07x}: {sum(counts.values())} instructions: {mix}")


if __name__ == "__main__":
    main()
