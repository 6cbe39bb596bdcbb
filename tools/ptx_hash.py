"""A hash of the PTX of every configuration tools/compile_check.py builds (or those whose id
contains --match), with debug information stripped (.loc/.file lines, $L__tmp labels, the debug sections): two
runs print the same hash for a configuration exactly when a change left its code alone. For
refactors of the kernels: run before and after, compare (`--against FILE` does it). No GPU needed.

    python tools/ptx_hash.py --arch sm90 --match gluon > before.jsonl   # then change, then
    python tools/ptx_hash.py --arch sm90 --match gluon --against before.jsonl
"""

import argparse
import hashlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_check  # noqa: E402  (refuses TRITON_INTERPRET=1)

# .loc/.file lines, comments, and the $L__tmp labels debug info places at inlined scopes
_DEBUG = re.compile(r"^\s*(\.loc|\.file)\b.*$|^\s*//.*$|^\$L__tmp\d+:$", re.M)


def strip_debug(ptx: str) -> str:
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in _DEBUG.sub("", ptx).splitlines() if line.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(compile_check.SHARED_LIMIT), default="sm90")
    ap.add_argument("--match", default="")
    ap.add_argument("--against", default=None, help="a file this tool wrote: report what differs from it")
    args = ap.parse_args()
    before: dict[str, list[str]] = {}  # id -> its shas in order (an id can repeat: see below)
    if args.against:
        with open(args.against) as fh:
            for row in map(json.loads, fh):
                before.setdefault(row["id"], []).append(row["sha"])
    seen: dict[str, int] = {}
    changed = 0
    for name, fn, elem_bytes, constexprs, cfg, *types in compile_check.cases(args.arch):
        if args.match not in name:
            continue
        compiled = compile_check.compile_kernel(fn, args.arch, elem_bytes, constexprs, cfg, *types)
        sha = hashlib.sha256(strip_debug(compiled.asm["ptx"]).encode()).hexdigest()[:16]
        # (an id can repeat: a causal-only table entry builds both variants under the same names)
        row = dict(id=compile_check.case_id(name, cfg), sha=sha, shared=compiled.metadata.shared)
        if args.against:  # the n-th configuration of an id against the n-th of the file's
            n = seen[row["id"]] = seen.get(row["id"], -1) + 1
            shas = before.get(row["id"], [])
            row["same"] = n < len(shas) and shas[n] == sha
            changed += not row["same"]
        print(json.dumps(row), flush=True)
    if args.against:
        print(f"{changed} configuration(s) differ from {args.against}", file=sys.stderr)
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
