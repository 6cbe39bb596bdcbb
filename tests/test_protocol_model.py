"""The Gluon kernels' barrier protocols as tools/bwd_ring_model.py (the backward) and
tools/fwd_ring_model.py (the persistent forward's ring units and Q buffers) model them (the
kernels' ring indices and wait parities, random interleavings, TMA loads landing late): no deadlock
and no tile read or refilled out of turn, for every configuration the table holds (the backward's
split-ring variant included). No GPU needed; the kernels themselves run only on an H100/H200
(test_attention.py, test_plan_choice.py)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import bwd_ring_model  # noqa: E402
import fwd_ring_model  # noqa: E402


def test_every_table_configuration():
    counts = bwd_ring_model.check(seeds=40)
    assert {"d64", "d128", "d256 split"} <= set(counts), counts
    assert all(n == 40 * 6 for n in counts.values())


def test_the_model_catches_a_wrong_parity(monkeypatch):
    """A barrier whose waits pass one phase late (parity inverted) deadlocks or lets a tile be read
    out of turn: the model fails it."""
    monkeypatch.setattr(bwd_ring_model.Bar, "passes", lambda self, parity: self.c % 2 == parity)
    with pytest.raises(AssertionError):
        bwd_ring_model.check(seeds=3)


def test_forward_every_table_configuration():
    counts = fwd_ring_model.check(seeds=3)
    names = " ".join(counts)
    assert all(f"d{d}" in names for d in (64, 128)) and "qbuf1" in names and "qbuf2" in names, counts
    assert all(n == counts[next(iter(counts))] > 0 for n in counts.values()), counts


@pytest.mark.parametrize(
    "broken",
    [
        "parity",
        "skip from the last used unit",
        "skip one unit too few",
        "expect two blocks always",
        "one part twice",
        "shift by part of a part",
        "shift a part too far",
    ],
)
def test_the_forward_model_catches_a_broken_protocol(broken, monkeypatch):
    """Waits that pass a phase late, a consumer that arrives again on its last unit or leaves out
    its first unused one, an expect-tx that does not match the blocks loaded, two consumers on one
    part, and causal tiles shifted by a part's fraction (a part straddling row 0) or by a part too
    many: each deadlocks, reads out of turn or leaves rows out, and the model fails it."""
    if broken == "parity":
        monkeypatch.setattr(fwd_ring_model.Bar, "passes", lambda self, parity: self.c % 2 == parity)
    elif broken == "skip from the last used unit":
        monkeypatch.setattr(fwd_ring_model, "skip_from", lambda n_blocks: n_blocks)
    elif broken == "skip one unit too few":
        monkeypatch.setattr(fwd_ring_model, "skip_from", lambda n_blocks: n_blocks + 2 if n_blocks else 0)
    elif broken == "one part twice":
        monkeypatch.setattr(fwd_ring_model, "part", lambda me: me // 2 * 2)
    elif broken == "shift by part of a part":
        monkeypatch.setattr(
            fwd_ring_model, "causal_shift", lambda num_m, seqlen_q, cta_m, block_m: num_m * cta_m - seqlen_q
        )
    elif broken == "shift a part too far":
        shift = fwd_ring_model.causal_shift
        monkeypatch.setattr(fwd_ring_model, "causal_shift", lambda *args: shift(*args) + args[3])
    else:
        expect = fwd_ring_model.Bar.expect
        monkeypatch.setattr(
            fwd_ring_model.Bar, "expect", lambda self, n: expect(self, 2 if self.name.startswith("ready") else n)
        )
    with pytest.raises(AssertionError):
        fwd_ring_model.check(seeds=2)
