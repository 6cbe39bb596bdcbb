"""Compile-only check, no GPU needed: every tile the config table can select builds for sm_90
(TMA and pointer paths), sm_80 and sm_86 (99 KB GPUs) within the target's shared memory. The interpreter accepts
kernels the GPU compiler rejects (TRITON-ON-CPU.md), so this runs tools/compile_check.py in a
process without TRITON_INTERPRET."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ["sm90", "sm80", "sm86"])
def test_every_table_entry_compiles(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_check.py"), "--arch", arch],
                          capture_output=True, text=True, env=env, timeout=1200)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"compile_check printed nothing:\n{proc.stderr[-3000:]}"
    bad = [r for r in rows if not r["ok"]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) >= 10
