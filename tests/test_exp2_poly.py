"""The persistent Gluon forward's opt-in polynomial exp2 (kernels/fwd_hopper._exp2_mixed, a quarter
of the unmasked blocks' exponentials on the FMA pipe): its algorithm, replayed in fp32 on the CPU
with the constants its PTX is generated from, is within the error budget (the kernel itself runs
only on an H100/H200: test_attention.py forces it there)."""
import numpy as np
import pytest

fwd_hopper = pytest.importorskip("flashattn2.kernels.fwd_hopper")


def _replay(x: np.ndarray) -> np.ndarray:
    """The asm's fourth lane: max, floor, fraction, Horner's rule (fma: exact in float64, rounded
    once to fp32), 2^floor added into the exponent bits."""
    f32 = np.float32
    c1, c2, c3 = (f32(c) for c in fwd_hopper.EXP2_POLY)
    x = np.maximum(x.astype(f32), f32(fwd_hopper.EXP2_FLOOR))  # max.NaN: a NaN stays NaN
    f = np.floor(x)
    r = (x - f).astype(f32)
    p = (r.astype(np.float64) * c3 + c2).astype(f32)
    p = (p.astype(np.float64) * r + c1).astype(f32)
    p = (p.astype(np.float64) * r + 1.0).astype(f32)
    with np.errstate(invalid="ignore"):  # NaN -> int: cvt.rzi gives 0 there, as does this below
        n = np.where(np.isnan(f), 0, f).astype(np.int32)
    bits = p.view(np.int32) + (n << 23)
    return bits.view(f32)


def test_polynomial_exp2_accuracy():
    x = np.concatenate([np.linspace(-126, 0.001, 400_001), -np.logspace(-8, 0, 2001), np.arange(-126, 1.0)])
    got = _replay(x).astype(np.float64)
    want = np.exp2(x.astype(np.float32).astype(np.float64))
    rel = np.abs(got / want - 1)
    # 1.0e-4 from the fit, a few fp32 roundings on top; fp16's half ulp is 2.4e-4
    assert rel.max() < 1.2e-4, rel.max()
    assert np.all(np.diff(got[:400_001]) >= 0), "not monotone (a seam at an integer?)"


def test_polynomial_exp2_underflow():
    """Below 2^-126 the lane returns 2^-126 (0 after the cast to fp16, negligible beside a row
    sum >= 1 in fp32 and bf16): never NaN, inf or a wrapped exponent."""
    got = _replay(np.array([-126.5, -200.0, -1e4, -3.0e38], dtype=np.float32))
    assert np.all(got == np.float32(2.0 ** -126)), got
    assert np.isnan(_replay(np.array([np.nan], dtype=np.float32))).all()


def test_the_asm_is_that_algorithm():
    """The PTX's lines, in order, are the steps _replay takes, with the same constants: three
    lanes by ex2.approx, the fourth clamped (NaN kept), floored, Horner from the highest
    coefficient down, 2^floor added into the exponent."""
    hexes = [fwd_hopper._f32_hex(c) for c in (*fwd_hopper.EXP2_POLY, 1.0, fwd_hopper.EXP2_FLOOR)]
    c1, c2, c3, one, floor = hexes
    lines = [line.strip() for line in fwd_hopper._EXP2_MIXED_ASM.value.splitlines()]
    steps = [line for line in lines if line and line[0] not in "{}."]
    assert steps == [
        "ex2.approx.ftz.f32 $0, $4;", "ex2.approx.ftz.f32 $1, $5;", "ex2.approx.ftz.f32 $2, $6;",
        f"max.ftz.NaN.f32 x, $7, {floor};", "cvt.rmi.ftz.f32.f32 f, x;", "sub.ftz.f32 r, x, f;",
        f"fma.rn.ftz.f32 p, r, {c3}, {c2};", f"fma.rn.ftz.f32 p, p, r, {c1};", f"fma.rn.ftz.f32 p, p, r, {one};",
        "cvt.rzi.ftz.s32.f32 n, f;", "shl.b32 n, n, 23;", "add.s32 $3, p, n;"], steps
