"""The Gluon backward's barrier protocol as tools/bwd_ring_model.py models it (the kernel's ring
indices and wait parities, random interleavings, TMA loads landing late): no deadlock and no tile
read or refilled out of turn, for every configuration the table holds (the split-ring variant
included). No GPU needed; the kernel itself runs only on an H100/H200 (test_attention.py)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import bwd_ring_model  # noqa: E402


def test_every_table_configuration():
    counts = bwd_ring_model.check(seeds=40)
    assert {"d64", "d128", "d256", "d256 split"} <= set(counts), counts
    assert all(n == 40 * 6 for n in counts.values())


def test_the_model_catches_a_wrong_parity(monkeypatch):
    """A barrier whose waits pass one phase late (parity inverted) deadlocks or lets a tile be read
    out of turn: the model fails it."""
    monkeypatch.setattr(bwd_ring_model.Bar, "passes", lambda self, parity: self.c % 2 == parity)
    with pytest.raises(AssertionError):
        bwd_ring_model.check(seeds=3)
