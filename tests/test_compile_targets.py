"""Compile-only check, no GPU needed: every tile the plan table (ops/planning/) can select builds for sm_90
(TMA and pointer paths), sm_80 and sm_86 (99 KB GPUs), and the FP8 configurations for sm_89, within the target's
shared memory. The interpreter accepts
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
TIMEOUT = 600  # seconds per part: 7x the slowest measured on CI's two cores (83 s)


# the table's entries per architecture, and the kernels with lengths of 1 (Triton's specialization of an integer
# argument equal to 1: a one-token sequence, MHA's group size) on sm_90's two load paths and sm_80's pointers; each
# in parts (tools/compile_check.py --shard), a test of its own, so that xdist spreads them over the workers
SHARDS = {
    ("sm90", "table"): 4,
    ("sm86", "table"): 3,
    ("sm80", "table"): 1,
    ("sm89", "table"): 1,  # the FP8 configurations (the forward's and the KV cache's) at sm86's rows
    ("sm90", "lengths-one"): 2,
    ("sm80", "lengths-one"): 1,
}
RUNS = [
    pytest.param(arch, cases, f"{i}/{n}", id=f"{arch}-{cases}-{i}of{n}")
    for (arch, cases), n in SHARDS.items()
    for i in range(n)
]


@pytest.mark.parametrize("arch, cases, shard", RUNS)
def test_every_table_entry_compiles(arch, cases, shard):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compile_check.py"), "--arch", arch, "--cases", cases, "--shard", shard],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"compile_check printed nothing:\n{proc.stderr[-3000:]}"
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) >= 5
