"""The command line (python -m flashattn2): help answers without importing torch or triton, each command has its own
help and every option a help text, and `check` runs exactly the rows its filters ask for or refuses them."""

import argparse
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import ON_GPU
from flashattn2 import __main__ as cli
from flashattn2.bench import cpu_check

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_help_imports_neither_torch_nor_triton():
    """`python -m flashattn2 --help` (and bench's, check's) is the parser alone: importing torch and triton took
    seconds before any help was printed."""
    code = (
        "import contextlib, io, runpy, sys\n"
        "for argv in (['--help'], ['bench', '--help'], ['check', '--help']):\n"
        "    sys.argv = ['flashattn2', *argv]\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        runpy.run_module('flashattn2', run_name='__main__')\n"
        "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))\n"
    )
    assert _run_python(code).strip() == "[]"


def test_package_names_load_on_first_use():
    """`import flashattn2` alone imports no torch; the first public name brings them all, as an eager import did:
    explain is the function (not the submodule of that name), flashattn2.ops is there, a missing name raises."""
    code = (
        "import sys, flashattn2\n"
        "print('torch' in sys.modules)\n"
        "print(callable(flashattn2.explain), flashattn2.ops.planning.force is not None, 'torch' in sys.modules)\n"
        "print(all(hasattr(flashattn2, n) for n in flashattn2.__all__), hasattr(flashattn2, 'nothing'))\n"
    )
    assert _run_python(code).split("\n")[:3] == ["False", "True True True", "True False"]


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_each_command_has_its_own_help(capsys):
    top, bench, check = (_help(argv, capsys) for argv in (["--help"], ["bench", "--help"], ["check", "--help"]))
    assert "bench" in top and "check" in top and "explain" in top
    assert "WHAT" in bench and "--seqlens" in bench and "--providers" in bench
    assert "--seqlens" not in check and "fp32" in check and "--headdims" in check
    assert len({top, bench, check}) == 3


def _subparsers():
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("command", ["bench", "check"])
def test_every_option_has_help(command):
    actions = [a for a in _subparsers()[command]._actions if not isinstance(a, argparse._HelpAction)]
    missing = [a.option_strings or a.dest for a in actions if not a.help]
    assert actions and not missing


def test_layouts_help_names_the_value_checks_setter():
    (layouts,) = [a for a in _subparsers()["bench"]._actions if "--layouts" in a.option_strings]
    assert "set_value_checks(False)" in layouts.help and "set_kvcache_checks" not in layouts.help


@pytest.fixture
def rows(monkeypatch):
    """The check's rows, recorded instead of run (each is seconds of interpreter)."""
    seen = []
    monkeypatch.setattr(cpu_check, "_check", lambda shape, dtype, causal: seen.append((shape, dtype, causal)) or True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # this process imported triton with it: no re-execution
    return seen


def test_check_runs_the_rows_its_filters_ask_for(rows, capsys):
    assert cli.main(["check", "--dtypes", "float16", "--headdims", "64", "--causal", "1"]) == 0
    assert [(s[-1], dtype, causal) for s, dtype, causal in rows] == [(64, torch.float16, True)] * 3
    rows.clear()
    assert cli.main(["check"]) == 0
    assert len(rows) == 3 * 2 * 3 and {s[-1] for s, _, _ in rows} == {64, 40, 128}
    assert "torch err: plain PyTorch's" in capsys.readouterr().out  # the column, explained above the table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--dtypes", "fp8"], "argument --dtypes: expected some of fp16, bf16, fp32"),
        (["check", "--headdims", "sixty-four"], "argument --headdims: expected positive integers"),
        (["check", "--causal", "2"], "argument --causal: expected 0, 1 or 0,1"),
        (["check", "--seqlens", "128"], "unrecognized arguments: --seqlens 128"),
    ],
)
def test_check_refuses_what_it_cannot_honour(rows, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err and not rows


@pytest.mark.skipif(ON_GPU, reason="without a GPU bench runs the check")
def test_bench_without_a_gpu_passes_its_filters_to_the_check_or_refuses_them(rows, capsys):
    assert cli.main(["--dtypes", "bf16", "--causal", "0"]) == 0
    assert {(dtype, causal) for _, dtype, causal in rows} == {(torch.bfloat16, False)}
    rows.clear()
    assert cli.main(["bench", "--seqlens", "128"]) == 2
    assert "not --seqlens" in capsys.readouterr().out and not rows


@pytest.mark.parametrize("argv", [["--causal", "--headdim", "128"], ["--varlen"], ["--kvcache", "--seqlen-q", "1"]])
def test_explain_prints_the_plan(capsys, argv):
    """`python -m flashattn2 explain` (the README's command), on meta tensors: the forward's plan and the backward's
    (which failed on a function the planning package had moved)."""
    assert cli.main(["explain", *argv]) == 0
    out = capsys.readouterr().out
    assert "KVCacheSpec" in out if "--kvcache" in argv else ("AttentionSpec" in out and "BackwardSpec" in out)
