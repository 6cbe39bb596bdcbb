"""Compile-only check, no GPU needed: every tile the plan table (ops/planning.py) can select builds for sm_90
(TMA and pointer paths), sm_80 and sm_86 (99 KB GPUs) within the target's shared memory. The interpreter accepts
kernels the GPU compiler rejects (TRITON-ON-CPU.md), so this runs tools/compile_check.py in a
process without TRITON_INTERPRET. With --cases lengths-one it compiles the Triton kernels with
lengths of 1 (a pipeliner failure hid there: tools/compile_check.py's LENGTHS_ONE)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


# the table's entries per architecture; the kernels with lengths of 1 (Triton's specialization of an integer
# argument equal to 1: a one-token sequence, MHA's group size) on sm_90's two load paths and sm_80's pointers,
# a test of their own (its own subprocess and timeout; xdist runs it beside the others)
RUNS = [pytest.param(arch, "table", id=arch) for arch in ("sm90", "sm80", "sm86")]
RUNS += [pytest.param(arch, "lengths-one", id=f"{arch}-lengths-one") for arch in ("sm90", "sm80")]


@pytest.mark.parametrize("arch, cases", RUNS)
def test_every_table_entry_compiles(arch, cases):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_check.py"), "--arch", arch,
                           "--cases", cases], capture_output=True, text=True, env=env, timeout=1200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"compile_check printed nothing:\n{proc.stderr[-3000:]}"
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) >= 10
