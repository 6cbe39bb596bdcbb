"""What the CUDA driver receives, checked on the CPU (the fake driver, tests/fake_cuda.py, in a process without
TRITON_INTERPRET: tests/launch_cases.py), for flashattn2's representative launches: the Triton forward on pointers
and on host-built descriptors, the KV-cache decode, the Gluon backward (7 and 11 host-built descriptors), the
Gluon forward (16-bit, persistent; FP8 with descales, warp-specialized, over the transposed V copy), the varlen tail
fill, each captured from flashattn2's public API. On every release a launcher.Launch's direct call hands
Triton's C launcher exactly what Triton's own path hands it, descriptors encoded alike, the kept kernel the one Triton
chooses; and the compiled kernel's run reaches the driver as Triton's own launch does. The test runs under whichever
Triton the suite runs (its subprocess without TRITON_INTERPRET)."""

import json
import os
import pathlib
import subprocess
import sys

from flashattn2.ops.launch import launcher

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds: eight kernels compiled for sm_90 (about 30 s with a cold cache on two busy cores)
CASES = 8
DESCRIPTORS = {
    "attn_fwd_kernel (HOST_DESC": 4,
    "attn_bwd_ws_kernel (Gluon, 7": 7,
    "attn_bwd_ws_kernel (Gluon, 11": 11,
    "attn_fwd_persist_kernel (Gluon, 4": 4,
    "attn_fwd_ws_kernel (Gluon, FP8, 4": 4,
}


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
    assert len(rows) == CASES, rows
    for row in rows:
        assert row["launches"] == 1 and row["tma_fills"] == _descriptors(row["case"]), row
        assert row["run_same"], row


def test_launch_hands_the_driver_what_triton_does():
    """On every release: a fresh launcher.Launch's first call takes Triton's own path and keeps the compiled kernel,
    its later calls (the last under VERIFY_LAUNCH) call it directly, and each reaches the driver exactly as Triton's
    own launch of the same arguments does -- again on copies of the tensors (a later call's addresses)."""
    rows = _rows("--check")
    assert len(rows) == CASES, rows
    for row in rows:
        assert "error" not in row, row
        assert row["triton_paths"] == [1, 1, 0, 0] and row["kept"], row  # the later calls were direct
        assert row["same"], f"{row['case']}:\n triton {row['triton']}\n direct {row['direct_launch']}"
        assert row["moved_same"], row
        # Triton's path encodes the descriptors at every launch; so does the compiled kernel's run, except on 3.6,
        # where the Launch encodes each distinct map once (launcher.DESCRIPTORS_ENCODED_ONCE)
        n = _descriptors(row["case"])
        if n == 0:
            assert row["fills"] == [0, 0, 0, 0] and row["described"] is None, row
        elif launcher.DESCRIPTORS_ENCODED_ONCE:
            assert row["described"] == "once" and 0 < row["distinct_maps"] <= n, row
            assert row["fills"] == [n, n, row["distinct_maps"], 0], row
        else:
            assert row["described"] == "triton" and row["fills"] == [n] * 4, row
