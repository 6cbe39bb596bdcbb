"""One suite, two places: CUDA at realistic sizes when a GPU is present, else the CPU through
Triton's interpreter at small sizes (TRITON_INTERPRET must be set before the kernels import)."""

import os

import pytest
import torch

import tiers

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from flashattn2.ops import _runtime  # noqa: E402  (after TRITON_INTERPRET is settled)
from flashattn2.ops.launch import launcher  # noqa: E402  (after TRITON_INTERPRET is settled)

DEVICE = "cuda" if ON_GPU else "cpu"


def interpreter_numpy_problem() -> str | None:
    """Why Triton's interpreter cannot run here, or None: triton 3.6's interpreter fails on numpy 2.4 and newer
    (triton-lang/triton#9171: int() of a one-element array; fixed in 3.7). The README's requirement; the H200 image
    has numpy 2.4 with triton 3.6."""
    import numpy as np
    import triton

    new_numpy = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4)
    if new_numpy and triton.__version__.startswith("3.6."):
        return f"triton 3.6's interpreter needs numpy < 2.4; this has {np.__version__}"
    return None


def skip_without_interpreter() -> None:
    """Skip a test that runs kernels through Triton's interpreter in a subprocess (gloo ranks, a CPU run) where the
    interpreter cannot run (interpreter_numpy_problem)."""
    problem = interpreter_numpy_problem()
    if problem:
        pytest.skip(problem)


def pytest_sessionstart(session):
    """On the CPU, a Triton whose interpreter cannot run here stops the suite at once, saying what to install (not a
    thousand failures, and no pin in the test extras that would downgrade everyone's numpy)."""
    if not ON_GPU and interpreter_numpy_problem():
        pytest.exit(f'{interpreter_numpy_problem()}: pip install "numpy<2.4" (or triton >= 3.7)', returncode=4)


def pytest_report_header(config):
    return f"flashattn2 tests on {DEVICE}" + ("" if ON_GPU else " (Triton interpreter)")


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    """The two tiers (tests/tiers.py): each test the table names is marked `slow`. On the CPU a run with neither -m,
    -k nor paths (the README's command) runs the first tier only (`-m slow`: the second; `-m "slow or not slow"`, -k
    or named files: both); on a GPU every test runs."""
    for item in items:
        if tiers.SLOW.search(item.nodeid):
            item.add_marker(pytest.mark.slow)
    chosen = config.option.markexpr or config.option.keyword or config.option.file_or_dir
    if not ON_GPU and not chosen:
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


class _WorkstealOrder:
    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected
    def pytest_collection_modifyitems(self, config, items):
        _worksteal_order(items)


def pytest_configure(config):
    config.pluginmanager.register(_WorkstealOrder(), "flashattn2-worksteal-order")


def _worksteal_order(items):
    """The compile checks (a subprocess each, minutes on CI's two cores) at the head of each half of the list:
    pytest-xdist's worksteal (the README's command) starts each of two workers on one contiguous half, and a
    worker that runs out steals from the other's tail; so both start on their share of the compile checks and
    the rest balances. (With them in one place, one worker ran them all while the other went idle.)"""
    compile_items = [item for item in items if item.path.name == "test_compile_targets.py"]
    rest = [item for item in items if item.path.name != "test_compile_targets.py"]
    first, second = compile_items[0::2], compile_items[1::2]
    head = max(0, len(items) // 2 - len(first))
    items[:] = first + rest[:head] + second + rest[head:]


if os.environ.get("PYTEST_XDIST_WORKER") and not ON_GPU:
    torch.set_num_threads(1)  # one thread per worker: the workers share CI's two cores


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every buffer the kernels must fill starts as NaN, so an unwritten element fails a test."""
    _runtime.POISON = True
    yield
    _runtime.POISON = False


@pytest.fixture(autouse=True)
def verify_launches():
    """On the GPU every direct relaunch of a kept kernel (ops.launch.launcher.Launch) is checked
    against the kernel Triton itself would choose for the same arguments."""
    launcher.VERIFY_LAUNCH = ON_GPU
    yield
    launcher.VERIFY_LAUNCH = False


@pytest.fixture(autouse=True)
def fresh_seed(request):
    # fresh random inputs each run; the seed is printed so a failure can be replayed
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each xdist worker shares the one GPU: hand cached blocks back after each test, or a few
    workers that ran the large cases starve the others (out-of-memory in unrelated tests)."""
    yield
    if ON_GPU:
        torch.cuda.empty_cache()


@pytest.fixture
def value_checks():
    """The opt-in value checks on (flashattn2.set_value_checks) for the test, then as before."""
    from flashattn2.ops.request import checks

    previous = checks.set_value_checks(True)
    yield
    checks.set_value_checks(previous)


@pytest.fixture
def fresh_plans(monkeypatch):
    """Empty plan caches (the prepared calls and planning's table lookups), before and after: for a test that patches
    what the plans read."""
    from flashattn2.ops.run import call as calls

    calls.clear()
    yield
    calls.clear()
