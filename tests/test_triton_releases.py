"""The Triton releases flashattn2 runs on: the Gluon kernels run by default only on a release they were measured on
(ops._runtime.GLUON_TESTED), FLASHATTN2_HOPPER=1 opts in elsewhere and =0 opts out (the plan table's switch); a Hopper GPU left without
them warns once, saying which Triton, what it costs and how to opt in. (That the Gluon kernels compile on every
release in the range: tests/test_compile_targets.py, run under each Triton CI installs.)"""

import pathlib
import re
import warnings

import pytest
import triton

from flashattn2.ops import _runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_choice(monkeypatch):
    """hopper_kernels() decided anew under the test's environment, and again after it."""
    monkeypatch.setattr(_runtime, "_GLUON_SWITCH", None)  # FLASHATTN2_HOPPER unset (it is read once, at import)
    monkeypatch.setattr(_runtime, "_WARNED_WITHOUT_GLUON", False)
    _runtime.hopper_kernels.cache_clear()
    yield monkeypatch
    _runtime.hopper_kernels.cache_clear()


def test_gluon_kernels_on_a_tested_release(fresh_choice):
    fresh_choice.setattr(_runtime, "GLUON_TESTED", (triton.__version__,))
    assert _runtime.hopper_kernels() is _runtime.gluon_modules()
    assert _runtime.gluon_modules().fwd is not None and _runtime.gluon_modules().bwd is not None
    fresh_choice.setattr(_runtime, "_GLUON_SWITCH", False)  # =0: the plan table's switch; force(hopper=True) runs them
    _runtime.hopper_kernels.cache_clear()
    assert _runtime.hopper_kernels() is _runtime.gluon_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _runtime.warn_without_gluon("fwd")  # turned off by the user: no warning


def test_untested_release_warns_once_and_opts_in(fresh_choice):
    fresh_choice.setattr(_runtime, "GLUON_TESTED", ("0.0.",))
    assert _runtime.hopper_kernels() is None
    with pytest.warns(RuntimeWarning, match=rf"triton {re.escape(triton.__version__)} .*FLASHATTN2_HOPPER=1") as got:
        _runtime.warn_without_gluon("fwd")
    assert "0.73x" in str(got[0].message) and "compatibility table" in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _runtime.warn_without_gluon("bwd")  # once per process
    fresh_choice.setattr(_runtime, "_GLUON_SWITCH", True)  # FLASHATTN2_HOPPER=1
    _runtime.hopper_kernels.cache_clear()
    assert _runtime.hopper_kernels() is _runtime.gluon_modules()


def test_explain_on_an_untested_release_plans_without_a_gpus_warning(fresh_choice):
    """explain's meta tensors (python -m flashattn2 explain --arch sm90, on any machine) say the Triton kernels run and
    why, without the warning meant for a call on a Hopper GPU."""
    import torch

    import flashattn2
    from flashattn2.ops.run import call as calls

    fresh_choice.setattr(_runtime, "GLUON_TESTED", ("0.0.",))
    calls.clear()
    q = torch.empty(2, 1024, 8, 128, dtype=torch.bfloat16, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = flashattn2.explain(q, q, q, arch="sm90")
    assert "do not run on this Triton release" in text and not text.startswith("AttentionSpec on sm90: fwd_hopper")
    calls.clear()


def test_the_tested_releases_are_in_the_declared_range():
    """pyproject's triton range admits every release the Gluon kernels were measured on and the newest CI runs."""
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"triton\s*([^"]*)"', text)
    low, high = re.fullmatch(r">=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", spec.replace(" ", "")).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split(".") if x)
    for release in (*_runtime.GLUON_TESTED, triton.__version__):
        assert as_tuple(low) <= as_tuple(release.rstrip(".")) < as_tuple(high), (release, spec)
