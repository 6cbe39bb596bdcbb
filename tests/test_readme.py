"""The README holds: every Python block runs (each in a fresh interpreter, as a reader would paste it), its
benchmark summary is what `python -m flashattn2 bench summary` makes from bench/results/, and its settings table
names every switch the package reads.

On the CPU a block runs through Triton's interpreter: TRITON_INTERPRET=1 is in its environment unless the block
sets it itself (the CPU first call must work as printed from a clean environment), and a block written for the GPU
(`device="cuda"`) runs with the CPU as its device. On a GPU every block runs as printed."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ON_GPU

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def _block_id(code: str) -> str:
    first = next(line for line in code.splitlines() if line and not line.startswith(("import", "from", "#")))
    return re.sub(r"\W+", "-", first)[:40].strip("-")


@pytest.mark.parametrize("code", BLOCKS, ids=[_block_id(c) for c in BLOCKS])
def test_python_block_runs(code):
    if "transformers" in code:
        pytest.importorskip("transformers")
    interpreted = not ON_GPU or 'os.environ["TRITON_INTERPRET"]' in code
    if interpreted and tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"Triton's interpreter needs numpy < 2.4 (the README's requirement); this has {np.__version__}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if not ON_GPU:
        if 'os.environ["TRITON_INTERPRET"]' not in code:
            env["TRITON_INTERPRET"] = "1"
        code = code.replace('device="cuda"', 'device="cpu"')
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{run.stderr[-3000:]}"


def test_every_block_was_found():
    """The blocks this file runs: the first calls (GPU, CPU), MHA, transformers and the batch-invariant example."""
    assert len(BLOCKS) >= 5
    assert any('device="cuda"' in c for c in BLOCKS) and any('os.environ["TRITON_INTERPRET"]' in c for c in BLOCKS)


def test_bench_summary_is_generated():
    """The README's benchmark summary is render()'s from the committed CSVs: numbers cannot drift from the files
    (`python -m flashattn2 bench summary --write` regenerates it)."""
    from flashattn2.bench import summary

    start, end = README.index(summary.BEGIN), README.index(summary.END) + len(summary.END)
    assert README[start:end] == summary.render(str(ROOT / "bench" / "results"))


def test_settings_table_names_every_switch():
    """Every FLASHATTN2_* environment variable the package reads, and every setter it exports, is in the README's
    settings table."""
    import flashattn2

    table = README[README.index("## Settings") : README.index("## Tests")]
    sources = "\n".join(p.read_text() for p in (ROOT / "src" / "flashattn2").rglob("*.py"))
    env = set(re.findall(r"\"(FLASHATTN2_[A-Z_]+)\"", sources))
    setters = {name for name in flashattn2.__all__ if name.startswith("set_") or name == "batch_invariant"}
    assert env and setters
    missing = sorted(name for name in env | setters | {"TRITON_INTERPRET", "force("} if name not in table)
    assert not missing, f"not in the README's settings table: {missing}"
