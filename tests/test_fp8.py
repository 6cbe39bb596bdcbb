"""The FP8 forward (FA3's API: float8_e4m3fn q, k, v with q_descale, k_descale, v_descale) and the e4m3 codec the
kernels share.

Accuracy, the bound stated in the README ("FP8"): against the fp64 reference on the dequantized inputs, our error is at
most 2x the error of PyTorch doing the same rounding (reference.attention_ref with p_dtype: P = exp(s - rowmax)
rounded to e4m3 where the dots take e4m3, to bf16 on the sm_80/86 path; the output rounded to bf16) plus one bf16
ulp of the largest output: flash_attn's tolerance rule with that emulation as the yardstick. Both kernel paths run
here (force(fp8_dots=...)): the interpreter's FP8_DOTS_INTERP rounds P as the GPU does (kernels/fp8.e4m3_encode),
its sm_80/86 path decodes to fp32 (P unrounded)."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, ON_GPU
from tolerance import assert_close

import flashattn2
from flashattn2 import ArgumentError
from flashattn2.errors import ArgumentTypeError
from flashattn2.kernels.fp8 import e4m3_decode, e4m3_encode
from flashattn2.ops.request.modes import force
from flashattn2.reference import FWD_FACTOR, attention_ref
from flashattn2.reference.fp8 import E4M3, dequantize, quantize

E4M3_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


@triton.jit
def _codec_kernel(Codes, Values, X, Encoded, N: tl.constexpr, M: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Values + i, e4m3_decode(tl.load(Codes + i)))
    j = tl.arange(0, M)
    tl.store(Encoded + j, e4m3_encode(tl.load(X + j)))


def test_codec_is_exact():
    """Every code decodes to torch's value (-0 and NaN's sign included); encoding rounds to nearest even, saturates
    at +-448 and keeps NaN, as torch's `x.clamp(-448, 448).to(float8_e4m3fn)`: exactly, ties and subnormals too."""
    codes = E4M3_CODES.to(DEVICE)
    exact = codes.view(E4M3).float()
    halfway = (exact[1:127] + exact[:126]) / 2  # ties between neighbouring positive codes
    x = torch.cat(
        [
            exact,
            halfway,
            -halfway,
            torch.randn(1024, device=DEVICE) * 100,
            torch.randn(512, device=DEVICE) * 1e-2,
            torch.randn(512, device=DEVICE) * 1e-3,
            (torch.rand(512, device=DEVICE) - 0.5) * 2000,
            torch.tensor([float("inf"), -float("inf"), 1e-30, -1e-30, 449.0, 464.0, 465.0, 1e6], device=DEVICE),
        ]
    )
    x = torch.cat([x, torch.zeros(4096 - x.numel(), device=DEVICE)])
    values = torch.empty(256, device=DEVICE)
    encoded = torch.empty(4096, dtype=torch.uint8, device=DEVICE)
    _codec_kernel[(1,)](codes, values, x, encoded, N=256, M=4096)
    nan = exact.isnan()
    assert torch.equal(values.isnan(), nan) and torch.equal(values[~nan], exact[~nan])
    assert torch.equal(values.signbit(), exact.signbit())
    expected = x.clamp(-448, 448).to(E4M3).view(torch.uint8)
    assert torch.equal(encoded, expected), (x[encoded != expected][:4], encoded[encoded != expected][:4])


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dv=None, descales=True):
    """e4m3 q, k, v made from normal values by quantize (descales in [0.5, 2) or None) and their dequantized fp64."""
    dv = d if dv is None else dv
    made = []
    for shape in ((batch, seqlen_q, nheads, d), (batch, seqlen_k, nheads_k, d), (batch, seqlen_k, nheads_k, dv)):
        x = torch.randn(shape, device=DEVICE) * 2
        descale = torch.rand(batch, nheads_k, device=DEVICE) * 1.5 + 0.5 if descales else None
        x8 = quantize(x, descale)
        made.append((x8, descale, dequantize(x8, descale)))
    return made


def _check(out, lse, deq, dots: bool, name="", **opts):
    """out (bf16) and lse against the fp64 reference on the dequantized inputs, with the emulation of the path's
    rounding as the yardstick (the module docstring). The lse within 2**-10 of its magnitude, 1e-4 without the e4m3
    dots; on them, or within _e4m3_dot_error of its dots' terms where larger."""
    (q, k, v) = deq
    ref, ref_lse = attention_ref(q, k, v, **opts)
    low, _ = attention_ref(q.float(), k.float(), v.float(), p_dtype=E4M3 if dots else torch.float32, **opts)
    assert out.dtype == torch.bfloat16
    assert_close(f"{name} out", out, ref, low.to(torch.bfloat16), FWD_FACTOR)
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
        rel = 2**-10 if dots and ON_GPU else 1e-4
        bound = torch.full_like(ref_lse, rel * max(1.0, ref_lse[finite].abs().max().item()))
        if dots and ON_GPU:  # each row's own terms
            bound = torch.maximum(bound, _e4m3_dot_error(q.shape[-1]) * _terms(q, k, opts.get("softmax_scale")))
        error = (lse.double() - ref_lse).abs()
        assert (error[finite] < bound[finite]).all(), f"lse error {error[finite].max().item()} (bound {bound.max()})"


def _e4m3_dot_error(d: int) -> float:
    """A score's error on Hopper's e4m3 MMA, relative to its terms (the sum of |q_i k_i| * scale): the tensor core
    keeps 13 of the fp32 accumulator's mantissa bits (e8m13, truncated) each time it adds into it, once per k = 32
    step of a d-long dot and within a step relative to that step's terms, so at most (d / 32 + 1) * 2**-13 of the
    terms, biased towards zero; the lse's error is at most its largest score's. Measured on an H100: 2**-14.8 of the
    terms at one key (d128); 0.0193 at the worst of 5,328 rows (d256, 517 keys, lse ~19), past 2**-12 of the terms
    and 2**-10 of the lse."""
    return (d / 32 + 1) * 2**-13


def _terms(q, k, softmax_scale=None) -> torch.Tensor:
    """Each row's (batch, head, query: the lse's shape) largest sum of |q_i k_i| * softmax_scale over its keys: the
    yardstick of a dot's error when its accumulation is not exact (GQA: each query head with its key head)."""
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k = k.abs().repeat_interleave(group, dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.abs().double(), k.double()).amax(dim=-1) * scale


@pytest.mark.parametrize("dots", [True, False], ids=["e4m3-dots", "decoded"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
def test_forward(dots, causal, descales):
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(2, 70, 79, 4, 2, 64, descales=descales)
    with force(fp8_dots=dots):
        out, lse, _ = flashattn2.flash_attn_func(
            q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
        )
    _check(out, lse, (q64, k64, v64), dots, causal=causal)


@pytest.mark.parametrize("dots", [True, False], ids=["e4m3-dots", "decoded"])
def test_every_option(dots):
    """A window, softcap, ALiBi and a learnable sink at once, GQA, a value head dim of its own, a softmax_scale."""
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(2, 40, 90, 6, 2, 96, dv=64)
    alibi = torch.rand(2, 6, device=DEVICE) * 0.3
    sink = torch.randn(6, device=DEVICE)
    opts = dict(window_size=(30, 5), softcap=8.0, alibi_slopes=alibi, softmax_scale=0.2)
    with force(fp8_dots=dots):
        out = flashattn2.flash_attn_func(q, k, v, **opts, learnable_sink=sink, q_descale=qd, k_descale=kd, v_descale=vd)
    _check(out, None, (q64, k64, v64), dots, learnable_sink=sink, **opts)


@pytest.mark.parametrize("dots", [True, False], ids=["e4m3-dots", "decoded"])
def test_varlen_and_packed(dots):
    """flash_attn_varlen_func with a descale row per sequence (an empty one among them), and the packed forms,
    which give the unpacked call's output exactly."""
    lengths_q = [30, 0, 65]  # the keys: 41, 7, 70
    cu_q = torch.tensor([0, 30, 30, 95], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 41, 48, 118], dtype=torch.int32, device=DEVICE)
    q = quantize(torch.randn(95, 4, 64, device=DEVICE) * 2)
    kv = quantize(torch.randn(118, 2, 2, 64, device=DEVICE) * 2)
    k, v = kv.unbind(1)
    qd, kd, vd = (torch.rand(3, 2, device=DEVICE) + 0.5 for _ in range(3))
    scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    with force(fp8_dots=dots):
        out = flashattn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 65, 70, causal=True, **scales)
        packed = flashattn2.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 65, 70, causal=True, **scales)
    assert torch.equal(out, packed)
    q64, k64, v64 = dequantize(q, qd, cu_q), dequantize(k, kd, cu_k), dequantize(v, vd, cu_k)
    for b in range(3):
        if lengths_q[b] == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        deq = (q64[None, rows], k64[None, keys], v64[None, keys])
        _check(out[None, rows], None, deq, dots, name=f"sequence {b}", causal=True)
    # dense packed forms: one descale row per batch entry
    (q, qd, _), (k, kd, _), (v, vd, _) = _inputs(2, 33, 33, 4, 4, 64)
    with force(fp8_dots=dots):
        plain = flashattn2.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
        qkv = flashattn2.flash_attn_qkvpacked_func(
            torch.stack([q, k, v], dim=2), q_descale=qd, k_descale=kd, v_descale=vd
        )
        kvp = flashattn2.flash_attn_kvpacked_func(
            q, torch.stack([k, v], dim=2), q_descale=qd, k_descale=kd, v_descale=vd
        )
    assert torch.equal(plain, qkv) and torch.equal(plain, kvp)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 37), (37, 1)])
def test_lengths_of_one(seqlen_q, seqlen_k):
    """Triton specializes an integer argument equal to 1: one-token sequences, batch 1 and MHA are their own
    kernels."""
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(1, seqlen_q, seqlen_k, 2, 2, 64)
    out = flashattn2.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    _check(out, None, (q64, k64, v64), True, causal=True)


def test_nan_stays_nan():
    """A NaN code in a query row makes that row's output NaN and no other's; a saturated value stays finite."""
    (q, qd, _), (k, kd, _), (v, vd, _) = _inputs(1, 20, 30, 2, 2, 64)
    codes = q.view(torch.uint8).clone()
    codes[0, 5, 1, 3] = 0x7F  # e4m3fn's NaN
    out = flashattn2.flash_attn_func(codes.view(E4M3), k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    nan_rows = out.isnan().any(-1)
    assert nan_rows[0, 5, 1] and nan_rows.sum() == 1
    big = quantize(torch.full((1, 20, 2, 64), 1e6, device=DEVICE))  # saturated at 448
    assert torch.isfinite(flashattn2.flash_attn_func(big, k, v, q_descale=qd, k_descale=kd, v_descale=vd)).all()


def test_explain_names_the_fp8_rows():
    """FP8 takes the Gluon forward on sm_90 exactly where a bf16 call of its shape does (a Triton release that runs
    the Gluon kernels), the Triton forward elsewhere; each row says FP8 in its why."""
    meta = lambda *shape, dtype=E4M3: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    for d in (64, 128, 256, 96):
        q = meta(2, 4096, 32, d)
        for arch in ("sm90", "sm80"):
            text = flashattn2.explain(q, q, q, causal=True, arch=arch)
            first = text.splitlines()[0]
            bf16 = meta(2, 4096, 32, d, dtype=torch.bfloat16)
            gluon = "hopper" in flashattn2.explain(bf16, bf16, bf16, causal=True, arch=arch).splitlines()[0]
            assert ("hopper" in first) == (gluon and arch == "sm90" and d != 96), text
            assert "why: FP8: " in text, text


def test_errors_name_the_argument():
    (q, qd, _), (k, kd, _), (v, vd, _) = _inputs(2, 8, 8, 4, 2, 64)
    bf16 = q.to(torch.bfloat16)
    with pytest.raises(ArgumentError, match="q_descale is for float8_e4m3fn"):
        flashattn2.flash_attn_func(bf16, bf16, bf16, q_descale=qd)
    with pytest.raises(ArgumentError, match=r"k_descale must have shape \(batch, nheads_k\) = \(2, 2\)"):
        flashattn2.flash_attn_func(q, k, v, k_descale=kd[:1])
    with pytest.raises(ArgumentTypeError, match="v_descale must be float32"):
        flashattn2.flash_attn_func(q, k, v, v_descale=vd.double())
    with pytest.raises(ArgumentTypeError, match="q, k and v must have one dtype"):
        flashattn2.flash_attn_func(q, k.to(torch.bfloat16), v)
    with pytest.raises(NotImplementedError, match="float8_e5m2"):
        flashattn2.flash_attn_func(q.to(torch.float8_e5m2), k, v)
    with pytest.raises(NotImplementedError, match="dropout"):
        flashattn2.flash_attn_func(q, k, v, dropout_p=0.1, q_descale=qd)
    with pytest.raises(NotImplementedError, match="no backward"):
        flashattn2.flash_attn_func(q, k, v, learnable_sink=torch.zeros(4, device=DEVICE, requires_grad=True))
    with pytest.raises(NotImplementedError, match="block_table"):
        table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
        cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
        flashattn2.flash_attn_varlen_func(q[0], k, v, cu, cu, 4, 4, block_table=table)


def test_batch_invariant_mode():
    """In the batch-invariant mode the FP8 forward runs the KV-cache kernel's FP8 path: a sequence's rows are the same
    bits alone and in a batch, and obey the accuracy rule (its P is not rounded to e4m3: the cache kernel decodes)."""
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(3, 21, 45, 4, 2, 64)
    with flashattn2.batch_invariant():
        out = flashattn2.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        one = flashattn2.flash_attn_func(
            q[1:2], k[1:2], v[1:2], causal=True, q_descale=qd[1:2], k_descale=kd[1:2], v_descale=vd[1:2]
        )
    assert torch.equal(out[1:2], one)
    _check(out, None, (q64, k64, v64), False, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="the device's own path (sm_89+: e4m3 dots; sm_80/86: decoded to bf16)")
def test_device_path_at_size():
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(2, 2048, 2048, 16, 4, 128)
    out = flashattn2.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    dots = torch.cuda.get_device_capability() >= (8, 9)
    _check(out, None, (q64, k64, v64), dots, causal=True)


@pytest.mark.parametrize("keys", [5, 32, 77, 128])
def test_gluon_key_order_keeps_pv(keys):
    """The FP8 Gluon forward takes P's keys in constexprs.FP8_KEY_ORDER (FwdConfig.p_operand's reshape and permute,
    done here in torch with the same constants) and V^T's copy (launch_gluon.fp8_vt) holds its keys in the same order,
    so P V is unchanged; the copy's keys past v's are zeros (P is 0 there, and 0 * NaN would not be)."""
    from flashattn2.kernels.constexprs import FP8_KEY_DIMS, FP8_KEY_GROUP, FP8_KEY_ORDER
    from flashattn2.ops.launch.launch_gluon import fp8_vt

    padded = -(-keys // FP8_KEY_GROUP) * FP8_KEY_GROUP
    v = torch.randn(2, keys, 3, 16, dtype=torch.float64)
    vt = fp8_vt(v, torch.full((2, 3, 16, padded), float("nan"), dtype=torch.float64))
    assert torch.isfinite(vt).all() and vt.eq(0).sum(-1).eq(padded - keys).all()  # every column written
    p = torch.rand(2, 3, 8, padded, dtype=torch.float64)
    p[..., keys:] = 0  # (the kernel's masked keys)
    permutation = (0, 1, 2, 3, *(4 + i for i in FP8_KEY_ORDER))  # the kernel's, after (batch, head) here
    p_kernel = p.reshape(2, 3, 8, padded // FP8_KEY_GROUP, *FP8_KEY_DIMS).permute(permutation).reshape(p.shape)
    assert not torch.equal(p_kernel, p)  # (a test of the order, not of the identity)
    got = p_kernel @ vt.transpose(-1, -2)
    want = p[..., :keys] @ v.permute(0, 2, 1, 3)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon forward's FP8 path: an sm_90 device")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extra", ["descales", "no-descales", "sink", "ones", "many-tiles"])
def test_gluon_forward(d, causal, extra):
    """The Gluon forward on e4m3 inputs (its persistent and warp-specialized kernels: FwdConfig's FP8) where the plan
    picks it: odd lengths, GQA, seqlen_q != seqlen_k, with and without descales, a learnable sink, batch and lengths
    of 1 (Triton's constants), more tiles than SMs; out NaN-poisoned before the kernel runs (the conftest)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are sm_90's")
    # many-tiles: more tiles than SMs, so a persistent CTA runs several (its O buffers reused, stores in flight)
    shape = {"ones": (1, 1, 1, 2, 2), "many-tiles": (4, 1000, 1000, 16, 4)}.get(extra, (2, 333, 517, 8, 2))
    batch, seqlen_q, seqlen_k, nheads, nheads_k = shape
    (q, qd, q64), (k, kd, k64), (v, vd, v64) = _inputs(
        batch, seqlen_q, seqlen_k, nheads, nheads_k, d, descales=extra != "no-descales"
    )
    assert "hopper" in flashattn2.explain(q, k, v, causal=causal).splitlines()[0]
    sink = torch.randn(nheads, device=DEVICE) if extra == "sink" else None
    out, lse, _ = flashattn2.flash_attn_func(
        q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True, learnable_sink=sink
    )
    _check(out, lse, (q64, k64, v64), True, causal=causal, learnable_sink=sink)
