"""What the CUDA driver receives, checked on the CPU (the fake driver, tests/fake_cuda.py, in a process without
TRITON_INTERPRET: tests/launch_cases.py), for flashattn2's representative launches: the Triton forward on pointers
and on host-built descriptors, the KV-cache decode, the Gluon backward (7 and 11 host-built descriptors), the
varlen tail fill. The direct launch path (ops.launcher) hands Triton's C launcher exactly what Triton's own path
hands it, descriptors encoded alike, the remembered kernel the one Triton chooses (skipped on a Triton the direct
path was not written for, launcher.SUPPORTED: a port of it is checked the same way); and on every release, the
compiled kernel's run reaches the driver as Triton's own launch does."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flashattn2.ops import launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds: six kernels compiled for sm_90 (about 20 s with a cold cache on two busy cores)
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


def test_compiled_run_hands_the_driver_what_triton_does():
    """On every release: Triton's own path runs under the fake driver, each descriptor encoded at each launch, and
    the compiled kernel's run, called with the bound arguments and no hooks, reaches the driver identically (what a
    caller that remembers the compiled kernel relies on)."""
    rows = _rows("--triton-only")
    assert len(rows) == 6, rows
    for row in rows:
        assert row["launches"] == 1 and row["tma_fills"] == _descriptors(row["case"]), row
        assert row["run_same"], row


def test_direct_launch_hands_the_driver_what_triton_does():
    if not launcher.SUPPORTED:
        pytest.skip(f"ops.launcher's direct path is written for triton {launcher.WRITTEN_FOR}x")
    rows = _rows("--check")
    assert len(rows) == 6, rows
    for row in rows:
        assert "error" not in row, row
        assert row["direct"] == 2, row  # the launches after the first took the direct path
        assert row["same"], f"{row['case']}:\n triton {row['triton']}\n direct {row['direct_launch']}"
        # Triton's path encodes the descriptors at every launch, the direct path each distinct map once
        n = _descriptors(row["case"])
        assert row["fills"] == [n, n, row["distinct_maps"], 0] and 0 < row["distinct_maps"] <= n or n == 0, row
