"""The README holds: every Python block runs as printed (each in a fresh interpreter, from an environment without
TRITON_INTERPRET, as a reader would paste it) and prints what its comments say, its benchmark summary is what
`python -m flashattn2 bench summary` makes from bench/results/, and its settings table names every switch the
package reads.

A block that runs kernels sets TRITON_INTERPRET=1 itself where there is no GPU; on a GPU every block runs on it."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ON_GPU, interpreter_numpy_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
# (the paragraph above, the block) for each shell block
SHELL = [(m.group(1), m.group(2)) for m in re.finditer(r"((?:^[^\n]+\n)+)\n```bash\n(.*?)^```", README, re.M | re.S)]
NEEDS_GPU = "needs a GPU"
SETS_INTERPRETER = 'os.environ["TRITON_INTERPRET"] = "1"'


def _block_id(code: str) -> str:
    first = next(
        line
        for line in code.splitlines()
        if line and not line.startswith(("import", "from", "#", "if ", "    ", "device = "))
    )
    return re.sub(r"\W+", "-", first)[:40].strip("-")


def expected_output(code: str) -> list[str]:
    """The lines a block promises to print: each top-level `print(...)  # EXPECTED` line's comment, up to a ": "
    that starts its explanation."""
    return [m.group(1).split(": ")[0].strip() for m in re.finditer(r"^print\(.*\)  # (.*)$", code, re.M)]


@pytest.mark.parametrize("code", BLOCKS, ids=[_block_id(c) for c in BLOCKS])
def test_python_block_runs_as_printed(code):
    if "transformers" in code:
        pytest.importorskip("transformers")
    if not ON_GPU and SETS_INTERPRETER in code and interpreter_numpy_problem():
        pytest.skip(interpreter_numpy_problem())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{run.stderr[-3000:]}"
    printed = [line.strip() for line in run.stdout.splitlines()]
    expected = expected_output(code)
    found = iter(printed)
    missing = [line for line in expected if not any(line == p for p in found)]  # in order
    assert not missing, f"README block printed {printed}, its comments promise {expected}:\n{code}"


def test_every_block_was_found():
    """The blocks this file runs: the first call, MHA, transformers, SimulatedGroup, the batch-invariant example and
    install_as_flash_attn; each prints what its comments promise, and each that runs kernels sets the interpreter
    itself for a CPU."""
    assert len(BLOCKS) >= 6
    assert all(expected_output(code) for code in BLOCKS)
    kernels = [code for code in BLOCKS if "torch.randn" in code or "generate(" in code]
    assert len(kernels) >= 5 and all(SETS_INTERPRETER in code for code in kernels)


def test_expected_output_reads_the_comments():
    code = "x = 1\nprint(x)  # 1\nprint(x == 1)  # True: an explanation\n    print(x)  # nested: not read\n"
    assert expected_output(code) == ["1", "True"]


def test_bench_summary_is_generated():
    """The README's benchmark summary is render()'s from the committed CSVs: numbers cannot drift from the files
    (`python -m flashattn2 bench summary --write` regenerates it)."""
    from flashattn2.bench import summary

    start, end = README.index(summary.BEGIN), README.index(summary.END) + len(summary.END)
    assert README[start:end] == summary.render(str(ROOT / "bench" / "results"))


def test_bench_subcommands_are_each_named():
    """The Benchmark section names every `bench` subcommand the command line takes (`fp8` was missing once)."""
    from flashattn2.__main__ import WHATS

    section = README[README.index("## Benchmark") :]
    assert [w for w in WHATS if f"`{w}`" not in section and f"bench {w}" not in section] == []


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


def _shell_kind(above: str, code: str) -> str:
    """gpu: the paragraph above says it needs a GPU; install: pip lines (CI installs as they do: .ci/run); suite:
    the test commands (.ci/run runs them as printed); else run: this file runs it."""
    if NEEDS_GPU in above:
        return "gpu"
    if "python -m pytest" in code:
        return "suite"
    if all(line.startswith("pip install") for line in code.splitlines()):
        return "install"
    return "run"


def test_every_shell_block_is_run_or_says_why_not():
    """Each shell block runs on a CPU (an install line, a test command CI runs, or a command test_shell_block_runs_
    as_printed runs), or the paragraph above it says it needs a GPU and the next block is its CPU form."""
    assert len(SHELL) == README.count("```bash") >= 6  # (a block without a paragraph above it would be missed)
    kinds = [_shell_kind(above, code) for above, code in SHELL]
    ci = (ROOT / ".ci" / "run").read_text()
    for i, (kind, (_, code)) in enumerate(zip(kinds, SHELL)):
        if kind == "gpu":
            assert i + 1 < len(SHELL) and kinds[i + 1] == "run", f"no CPU form after {code!r}"
        if kind == "suite":  # CI runs the README's command as printed (less its install: CI's own)
            assert code.strip().split(" && ", 1)[-1] in ci, code
        if kind == "install":  # the extras named exist
            extras = set(re.findall(r'"\.\[(\w+)\]"', code))
            assert extras <= set(re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text(), re.M)), code
    assert kinds.count("run") >= 2 and kinds.count("suite") >= 2


RUN = list(dict.fromkeys(code for above, code in SHELL if _shell_kind(above, code) == "run"))  # each once


@pytest.mark.skipif(ON_GPU, reason="the CPU forms (a GPU runs the examples in tests/test_examples.py)")
@pytest.mark.parametrize("code", RUN, ids=[re.sub(r"\W+", "-", c)[:40].strip("-") for c in RUN])
def test_shell_block_runs_as_printed(code):
    """The block as a reader pastes it, from the clone's root in an environment without TRITON_INTERPRET (the
    example sets it on a CPU), the venv's scripts (torchrun) on the PATH."""
    if interpreter_numpy_problem():
        pytest.skip(interpreter_numpy_problem())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    run = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{run.stderr[-3000:]}"
