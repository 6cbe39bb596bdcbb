"""The CPU suite's start and its two tiers (tests/tiers.py): a Triton whose interpreter cannot run stops the suite at
once; each row of the second tier's table names tests that exist, a row that picks some of a test's cases leaves
the test one in the first tier, and the README's command runs the first tier while `-m slow` runs the rest."""

import re
import subprocess
import sys

import pytest

import tiers
from conftest import ON_GPU
from test_readme import ROOT


def _collect(*args: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def every_id():  # (the CPU's: the tests that read it skip on a GPU before they ask for it)
    return _collect("-m", "slow or not slow")


@pytest.mark.skipif(ON_GPU, reason="the tiers are the CPU's (a GPU's cases have other ids, and it runs them all)")
@pytest.mark.parametrize("pattern", list(tiers.SECOND_TIER))
def test_each_row_names_tests_and_leaves_each_a_first_tier_case(pattern, every_id):
    chosen = [node for node in every_id if re.search(pattern, node)]
    assert chosen, f"tests/tiers.py's row {pattern!r} names no test (renamed or gone?)"
    if r"\[" in pattern:  # some parametrizations of a test: some stay in the first tier (no other row takes them)
        functions = {node.split("[")[0] for node in chosen}
        first = {node.split("[")[0] for node in every_id if "[" in node and not tiers.SLOW.search(node)}
        assert functions <= first, f"{pattern!r} takes every case of {sorted(functions - first)}"


@pytest.mark.skipif(ON_GPU, reason="a GPU runs both tiers")
def test_the_readme_command_runs_the_first_tier_and_m_slow_the_rest(every_id):
    first, second = set(_collect()), set(_collect("-m", "slow"))
    assert first and second and not first & second and first | second == set(every_id)
    assert all(tiers.SLOW.search(node) for node in second) and not any(tiers.SLOW.search(node) for node in first)
    assert any("test_compile_targets" in node for node in second)


def test_a_cpu_whose_interpreter_cannot_run_stops_at_once(monkeypatch):
    """triton 3.6 with numpy >= 2.4 (the test extras pin nothing): the CPU suite stops at its start naming the fix."""
    import conftest

    monkeypatch.setattr(conftest, "ON_GPU", False)
    monkeypatch.setattr(conftest, "interpreter_numpy_problem", lambda: "triton 3.6's interpreter needs numpy < 2.4")
    with pytest.raises(pytest.exit.Exception, match='pip install "numpy<2.4"'):
        conftest.pytest_sessionstart(None)
    monkeypatch.setattr(conftest, "interpreter_numpy_problem", lambda: None)
    conftest.pytest_sessionstart(None)
