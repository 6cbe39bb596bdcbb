"""What the CUDA driver receives, checked on the CPU (the fake driver, tests/fake_cuda.py, in a process without
TRITON_INTERPRET: tests/launch_cases.py): for flashattn2's representative launches -- the Triton forward on
pointers and on host-built descriptors, the KV-cache decode, the Gluon backward (7 and 11 host-built
descriptors), the varlen tail fill -- the direct launch path (ops.launcher) hands Triton's C launcher exactly what
Triton's own path hands it, descriptors encoded alike, the remembered kernel the one Triton chooses. On a Triton
the direct path was not written for (launcher.SUPPORTED) that check is skipped and Triton's own path is checked
to run under the fake driver, so a port of the direct path can be checked the same way."""

import json
import os
import pathlib
import subprocess
import sys

from flashattn2.ops import launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 900  # seconds: six kernels compiled for sm_90 (about 40 s on one core; CI's two are shared)
DESCRIPTORS = {"attn_fwd_kernel (HOST_DESC": 4, "attn_bwd_ws_kernel (Gluon, 7": 7, "attn_bwd_ws_kernel (Gluon, 11": 11}


def _rows(*flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])  # this source tree
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "launch_cases.py"), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and rows, proc.stderr[-3000:]
    return rows


def _descriptors(name: str) -> int:
    return next((n for prefix, n in DESCRIPTORS.items() if name.startswith(prefix)), 0)


def test_direct_launch_hands_the_driver_what_triton_does():
    flags = ("--check",) if launcher.SUPPORTED else ("--triton-only",)
    rows = _rows(*flags)
    assert len(rows) == 6, rows
    for row in rows:
        assert "error" not in row, row
        if launcher.SUPPORTED:
            assert row["direct"] == 2, row  # the launches after the first took the direct path
            assert row["same"], f"{row['case']}:\n triton {row['triton']}\n direct {row['direct_launch']}"
            # Triton's path encodes the descriptors at every launch, the direct path each distinct map once
            n = _descriptors(row["case"])
            assert row["fills"] == [n, n, row["distinct_maps"], 0] and 0 < row["distinct_maps"] <= n or n == 0, row
        else:
            assert row["launches"] == 1 and row["tma_fills"] == _descriptors(row["case"]), row
