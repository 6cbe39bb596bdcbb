"""tools/ncu_sass.py reads an ncu SASS-page CSV (the "Kernel Name" line, then the header) and names the
main loop and the instructions with the most stall samples. A synthetic CSV: no GPU, no ncu."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import ncu_sass  # noqa: E402

_HEADER = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "stall_barrier",
    "stall_long_sb",
    "stall_long_sb (Not Issued)",
]


def _csv(tmp_path, rows):
    lines = ['"Kernel Name","k",', ",".join(f'"{h}"' for h in _HEADER)]
    lines += [",".join(f'"{v}"' for v in row) for row in rows]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_summary_names_the_loop_and_the_hottest_spin(tmp_path):
    rows = [("0x0", "LDC R1, c[0x0][0x28]", "1", "8", "0", "0", "0")]
    rows += [(f"0x{i:x}", f"FFMA R{i}, R1, R2, R3", "2", "1000", "0", "0", "0") for i in range(1, 30)]
    rows += [
        ("0x100", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34180], RZ", "3", "1000", "0", "0", "0"),
        ("0x110", "@!P0  BRA 0x200", "90", "1000", "0", "90", "88"),
        ("0x120", "EXIT", "0", "8", "0", "0", "0"),
        # the try-wait's out-of-line spin runs more often than the loop but does less work in all
        ("0x200", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x34180], RZ", "1", "3000", "0", "0", "0"),
        ("0x210", "@!P0  BRA 0x200", "1", "3000", "1", "0", "0"),
    ]
    rows = ncu_sass.load(_csv(tmp_path, rows))
    out = ncu_sass.summary(rows, top=1, context=1)
    first, hottest = out.split("\n\n")
    assert "instructions 1-31, each run 1000 times" in first
    assert "[31]" in hottest and "@!P0  BRA 0x200" in hottest and "long_sb 90" in hottest
    assert "[UR4+0x34180]" in hottest  # the barrier named by the instruction before
