"""float8_e4m3fn (OCP E4M3, "fn": no infinities, NaN = S.1111.111, largest finite 448) in integer arithmetic: the
codes read and written as uint8, for the GPUs whose Triton has no fp8e4nv type (sm_80/86: Triton refuses the type
below sm_89) and for the KV-cache kernels on every arch (memory-bound: a few integer ops per byte cost nothing). The
dense forward on sm_89+ takes e4m3 tiles straight into its dots (kernels/fwd.py, Path.FP8).

Both conversions are exact: decode gives the code's value; encode rounds to nearest, ties to even, saturates at
+-448 (FA3's and torch's `(x / descale).clamp(-448, 448).to(torch.float8_e4m3fn)`), and keeps NaN a NaN."""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # the largest finite e4m3fn value


@triton.jit
def e4m3_decode(code):
    """uint8 codes -> their fp32 values. The code's 7 magnitude bits placed at fp32's exponent/mantissa boundary
    (exponent bias 127 vs 7) read as 2**-120 times the value, subnormals included (fp32 subnormals, then the
    multiply by 2**120 is exact)."""
    c = code.to(tl.int32)
    sign = (c & 0x80) << 24
    x = (sign | ((c & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120
    nan = (sign | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, nan, x)


@triton.jit
def e4m3_encode(x):
    """fp32 values -> uint8 codes: round to nearest even, saturate at +-448, NaN -> 0x7F (with x's sign)."""
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    bits = a.to(tl.int32, bitcast=True)
    # normal: drop fp32's 20 low mantissa bits rounding to nearest even, then rebias the exponent (127 -> 7)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # below 2**-6: multiples of 2**-9, rounded to nearest even by fp32's own rounding of a + 2**23 (exact adds)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a < 0.015625, sub, normal)
    mag = tl.where(x != x, 0x7F, mag)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (mag | sign).to(tl.uint8)
