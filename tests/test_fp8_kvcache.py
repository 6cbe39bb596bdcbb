"""flash_attn_with_kvcache over FP8 (float8_e4m3fn) caches with FA3's descales: contiguous and paged, q in FP8 or in
16 bits, the append's quantization (byte-exact), the options that keep working over such a cache, the errors.

The accuracy bound: the oracle is the float64 reference (reference.kvcache.kvcache_ref) on the dequantized inputs --
the cache after the call and an FP8 q, each code times its descale, exact. The emulation of the kernel's rounding is
the same reference computed in the dtype of the kernel's dots (q's; bf16 for an FP8 q) on the same dequantized values
rounded to that dtype; ours may be off the oracle by at most FWD_FACTOR = 2 times the emulation's error plus a floor
of one unit in the last place of the largest output (reference.tolerance.check, the package's rule)."""

import pytest
import torch

import flashattn2
from cases import randn
from conftest import DEVICE
from flashattn2.errors import ArgumentError, ArgumentTypeError
from flashattn2.reference import fp8 as rf
from flashattn2.reference import tolerance
from flashattn2.reference.kvcache import kvcache_ref
from flashattn2.ops.request.request import AttentionRequest
from flashattn2.reference.rotary import rotary_ref

E4M3 = rf.E4M3
CAPACITY = 24
HEAD_DIM = 32

RATIOS = {}  # case -> our error / the emulation's (printed: the report's measured ratios)


def _descale(batch, nheads_k, on):
    return (torch.rand(batch, nheads_k, device=DEVICE) * 1.5 + 0.5) if on else None


def _codes(t):
    return t.view(torch.uint8)


def make(c):
    """A case: (q, k_cache, v_cache, kwargs, meta); the caches e4m3 codes of random values with their descales."""
    batch, nheads_k, group = c.get("batch", 2), c.get("nheads_k", 2), c.get("group", 2)
    dtype, head_dim, head_dim_v = c.get("dtype", torch.bfloat16), c.get("head_dim", HEAD_DIM), c.get("head_dim_v")
    head_dim_v = head_dim_v or head_dim
    seqlen_new, seqlen_q = c.get("seqlen_new", 0), c.get("seqlen_q", 1)
    descales = c.get("descales", True)
    kd, vd = _descale(batch, nheads_k, descales), _descale(batch, nheads_k, descales)
    page = c.get("paged")
    kwargs = {}
    if page:
        max_blocks = -(-CAPACITY // page)
        num_blocks = batch * max_blocks + 2
        rows, width = num_blocks, page
        kwargs["block_table"] = (
            torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32).to(DEVICE)
        )
    else:
        rows, width = batch + (2 if c.get("batch_idx") else 0), CAPACITY
        if c.get("batch_idx"):
            kwargs["cache_batch_idx"] = torch.randperm(rows)[:batch].to(torch.int32).to(DEVICE)
    # the descales are a sequence's (batch row b), the cache's rows another order: quantize with unit descales, the
    # values meant are codes * descale of the row that reads them
    k_cache = rf.quantize(randn(rows, width, nheads_k, head_dim, dtype=torch.float32) * 2)
    if c.get("latent"):
        v_cache = k_cache[..., :head_dim_v]
    else:
        v_cache = rf.quantize(randn(rows, width, nheads_k, head_dim_v, dtype=torch.float32) * 2)
    lens = torch.randint(0, CAPACITY - seqlen_new + 1, (batch,))
    lens[0] = CAPACITY - seqlen_new
    kwargs["cache_seqlens"] = lens.to(torch.int32).to(DEVICE)
    if c.get("leftpad"):
        kwargs["cache_leftpad"] = (torch.rand(batch) * (lens + 1)).long().clamp(max=lens).to(torch.int32).to(DEVICE)
    q = randn(batch, seqlen_q, nheads_k * group, head_dim, dtype=torch.float32)
    qd = None
    if c.get("q_fp8"):
        qd = _descale(batch, nheads_k, descales)
        q = rf.quantize(q.view(batch, seqlen_q, nheads_k, group * head_dim), qd).view(q.shape)
    else:
        q = q.to(dtype)
    if seqlen_new:
        new_dtype = E4M3 if c.get("new_fp8") else (torch.bfloat16 if c.get("q_fp8") else dtype)
        k = randn(batch, seqlen_new, nheads_k, head_dim, dtype=torch.float32) * 2
        v = randn(batch, seqlen_new, nheads_k, head_dim_v, dtype=torch.float32) * 2
        kwargs.update(k=k.to(new_dtype), v=v.to(new_dtype))
    if c.get("rotary"):
        angle = torch.rand(CAPACITY + 16, head_dim // 4, device=DEVICE) * 6.28
        kwargs.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=False)
    for name in ("causal", "softcap", "num_splits"):
        if name in c:
            kwargs[name] = c[name]
    if c.get("sink"):
        kwargs["learnable_sink"] = torch.randn(nheads_k * group, device=DEVICE)
    kwargs.update(q_descale=qd, k_descale=kd, v_descale=vd)
    return q, k_cache, v_cache, kwargs


def _per_row(descale, rows, batch_idx):
    """A (batch, nheads_k) descale as the cache rows' (rows, 1, nheads_k, 1): row batch_idx[b] (or b) takes b's;
    rows no sequence reads take 1."""
    out = torch.ones(rows, descale.shape[1], dtype=descale.dtype, device=descale.device)
    idx = torch.arange(descale.shape[0], device=descale.device) if batch_idx is None else batch_idx.long()
    out[idx] = descale
    return out[:, None, :, None]


def dequantized(q, k_cache, v_cache, kwargs, dtype):
    """q and the caches' values (code * descale) in dtype; a paged cache's pages take their sequence's descale."""
    kd, vd, qd = kwargs["k_descale"], kwargs["v_descale"], kwargs["q_descale"]
    if q.dtype == E4M3:
        b, s, h, d = q.shape
        hk = k_cache.shape[2]
        q = rf.dequantize(q.view(b, s, hk, h // hk * d), qd).view(b, s, h, d)
    q = q.to(dtype)
    table = kwargs.get("block_table")
    out = []
    for cache, d in ((k_cache, kd), (v_cache, vd)):
        x = cache.to(torch.float64)
        if d is not None:
            if table is None:
                x = x * _per_row(d.double(), x.shape[0], kwargs.get("cache_batch_idx"))
            else:
                page_d = torch.ones(x.shape[0], d.shape[1], dtype=torch.float64, device=x.device)
                for b in range(table.shape[0]):
                    page_d[table[b].long()] = d[b].double()
                x = x * page_d[:, None, :, None]
        out.append(x.to(dtype))
    return q, *out


def attend(q, k_cache, v_cache, kwargs, dtype, upcast):
    """The reference's attention over the caches after the call (the new keys in place): q rotated as the call
    rotates it (every query at its own position: causal), the caches as dtype."""
    q, kc, vc = dequantized(q, k_cache, v_cache, kwargs, dtype)
    lens = kwargs["cache_seqlens"]
    seqlen_new = kwargs["k"].shape[1] if "k" in kwargs else 0
    if "rotary_cos" in kwargs:
        assert kwargs.get("causal"), "the cases rotate q per token"
        cos, sin = kwargs["rotary_cos"].to(dtype), kwargs["rotary_sin"].to(dtype)
        q = rotary_ref(q, cos, sin, kwargs["rotary_interleaved"], lens.long())
    names = ("cache_batch_idx", "cache_leftpad", "block_table", "causal", "softcap", "learnable_sink")
    extra = {n: kwargs[n] for n in names if n in kwargs}
    return kvcache_ref(q, kc, vc, cache_seqlens=lens + seqlen_new, upcast=upcast, **extra)[:2]


def check_accuracy(name, out, q, k_cache, v_cache, kwargs):
    compute = torch.bfloat16 if q.dtype == E4M3 else q.dtype
    assert out.dtype == compute
    ref, _ = attend(q, k_cache, v_cache, kwargs, torch.float64, True)
    low, _ = attend(q, k_cache, v_cache, kwargs, compute, False)
    ok, err, bound = tolerance.check(out, ref, low, tolerance.FWD_FACTOR)
    low_err = tolerance.max_error(low, ref)
    RATIOS[name] = err / low_err if low_err else float("nan")
    print(f"{name}: error {err:.3g}, emulation {low_err:.3g}, ratio {RATIOS[name]:.2f}, bound {bound:.3g}")
    assert ok, f"{name}: error {err} > bound {bound} (2 x the emulation's {low_err} + the floor)"


def appended(k_cache, kwargs, before, name):
    """The cache the append must leave: `before` with sequence b's new rows at cache_seqlens[b] .. as their codes
    (16-bit k/v: reference.fp8.quantize with the sequence's descale, torch's exact rounding; e4m3: as given)."""
    expected = before.clone()
    new = kwargs[name]
    if new.dtype != E4M3:
        new = rf.quantize(new, kwargs[f"{name}_descale"])
    lens, table = kwargs["cache_seqlens"].long(), kwargs.get("block_table")
    batch_idx = kwargs.get("cache_batch_idx")
    for b in range(new.shape[0]):
        for i in range(new.shape[1]):
            pos = int(lens[b]) + i
            if table is not None:
                expected[int(table[b, pos // before.shape[1]]), pos % before.shape[1]] = new[b, i]
            else:
                row = b if batch_idx is None else int(batch_idx[b])
                expected[row, pos] = new[b, i]
    return expected


def run(name, c):
    q, k_cache, v_cache, kwargs = make(c)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    if "k" in kwargs and "rotary_cos" not in kwargs and not c.get("latent"):
        assert torch.equal(_codes(k_cache), _codes(appended(k_cache, kwargs, before_k, "k")))
        assert torch.equal(_codes(v_cache), _codes(appended(v_cache, kwargs, before_v, "v")))
    check_accuracy(name, out, q, k_cache, v_cache, kwargs)
    return out


CASES = {
    "contiguous-bf16-q": dict(),
    "contiguous-fp16-q-no-descales-mha-batch1": dict(dtype=torch.float16, descales=False, group=1, batch=1),
    "contiguous-fp32-q-append2": dict(dtype=torch.float32, seqlen_new=2),
    "contiguous-fp16-append1-causal": dict(dtype=torch.float16, seqlen_new=1, causal=True, seqlen_q=1),
    "fp8-q-contiguous-gqa4": dict(q_fp8=True, group=4, seqlen_q=2, causal=True),
    "fp8-q-no-descales": dict(q_fp8=True, descales=False),
    "paged3-append4-causal": dict(paged=3, seqlen_new=4, seqlen_q=4, causal=True),
    "paged16-fp8-q-split3": dict(paged=16, q_fp8=True, num_splits=3),
    "paged256-fp8-append": dict(paged=256, seqlen_new=2, new_fp8=True, batch=1),
    "fp8-q-fp8-append1": dict(q_fp8=True, seqlen_new=1, new_fp8=True),
    "rotary-fp16-append": dict(dtype=torch.float16, seqlen_new=3, seqlen_q=3, rotary=True, causal=True),
    "batch-idx-softcap": dict(batch_idx=True, softcap=2.0, seqlen_new=2),
    "leftpad-split2": dict(leftpad=True, num_splits=2, seqlen_new=1),
    "sink-split3": dict(sink=True, num_splits=3, q_fp8=True),
    "latent-576-512": dict(head_dim=576, head_dim_v=512, nheads_k=1, group=4, latent=True, batch=1, paged=16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_against_reference(name):
    run(name, CASES[name])


def test_batch_invariant_mode():
    """Under the batch-invariant mode a sequence's output over an FP8 cache is the same, bit for bit, alone or in a
    batch (and within the bound)."""
    q, k_cache, v_cache, kwargs = make(dict(batch=3, seqlen_q=2, causal=True))
    with flashattn2.batch_invariant():
        out = flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        alone = {n: (t[:1] if isinstance(t, torch.Tensor) and n != "learnable_sink" else t) for n, t in kwargs.items()}
        first = flashattn2.flash_attn_with_kvcache(q[:1], k_cache, v_cache, **alone)
    assert torch.equal(out[:1], first)
    check_accuracy("batch-invariant", out, q, k_cache, v_cache, kwargs)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # (the interpreter's max over the NaN row)
def test_saturation_and_nan():
    """The append saturates at +-448 (times the descale); a NaN in q (an FP8 q's NaN code) makes its row's output NaN
    and no other's."""
    q, k_cache, v_cache, kwargs = make(dict(q_fp8=True, seqlen_new=1, batch=1, group=2))
    k = kwargs["k"].float()
    k[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, -460.0], device=k.device) * kwargs["k_descale"][0, 0]
    kwargs["k"] = k.to(torch.bfloat16)
    _codes(q)[0, 0, 1, 3] = 0x7F  # NaN: query 0, head 1
    out = flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    pos = int(kwargs["cache_seqlens"][0])
    assert k_cache[0, pos, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    assert out[0, 0, 1].isnan().all()
    assert not out[0, 0, [0, 2, 3]].isnan().any()


def test_varlen_paged_fp8_is_not_supported():
    q = randn(4, 2, HEAD_DIM, dtype=torch.bfloat16)
    kc = rf.quantize(randn(2, 16, 2, HEAD_DIM, dtype=torch.float32))
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="block_table"):
        flashattn2.flash_attn_varlen_func(q, kc, kc, cu, cu, 4, 4, block_table=table)


def test_op_schema():
    """torch.library.opcheck of flashattn2::fwd_kvcache over an FP8 cache, FP8 q: the schema takes the descales,
    the fake implementation gives a bf16 output."""
    from flashattn2.ops.run import registry

    q, k_cache, v_cache, kwargs = make(dict(q_fp8=True, seqlen_new=1, new_fp8=True))
    args = (q, k_cache, v_cache, kwargs["k"], kwargs["v"], None, None, kwargs["cache_seqlens"], 0, None, None, None)
    args += (0.2, True, -1, -1, 0.0, True, None, 1, None, kwargs["q_descale"], kwargs["k_descale"], kwargs["v_descale"])
    torch.library.opcheck(registry.fwd_kvcache, args, test_utils=("test_faketensor",))


def _errors():
    q = randn(2, 1, 4, HEAD_DIM, dtype=torch.bfloat16)
    kc = rf.quantize(randn(2, 16, 2, HEAD_DIM, dtype=torch.float32))
    b16 = kc.to(torch.bfloat16)
    d = torch.ones(2, 2, device=DEVICE)
    k16 = randn(2, 1, 2, HEAD_DIM, dtype=torch.bfloat16)
    seq = dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int32, device=DEVICE))
    cos = torch.ones(32, HEAD_DIM // 2, dtype=torch.bfloat16, device=DEVICE)
    return {
        "k_descale-shape": ((q, kc, kc), dict(k_descale=d[:1]), ArgumentError, "k_descale"),
        "v_descale-dtype": ((q, kc, kc), dict(v_descale=d.double()), ArgumentTypeError, "v_descale"),
        "k_descale-type": ((q, kc, kc), dict(k_descale=1.0), ArgumentTypeError, "k_descale"),
        "q_descale-16-bit-q": ((q, kc, kc), dict(q_descale=d), ArgumentError, "q_descale"),
        "k_descale-16-bit-cache": ((q, b16, b16), dict(k_descale=d), ArgumentError, "k_descale"),
        "v_descale-16-bit-cache": ((q, b16, b16), dict(v_descale=d), ArgumentError, "v_descale"),
        "fp8-k-16-bit-v": ((q, kc, b16), {}, ArgumentTypeError, "v_cache"),
        "fp8-q-16-bit-cache": ((rf.quantize(q), b16, b16), {}, ArgumentTypeError, "FP8 cache"),
        "e5m2": ((q, kc.to(torch.float8_e5m2), kc), {}, NotImplementedError, "float8_e5m2"),
        "new-k-fp32": ((q, kc, kc, k16.float(), k16.float()), seq, ArgumentTypeError, "k is"),
        "rotary-fp8-k": (
            (q, kc, kc, rf.quantize(k16), rf.quantize(k16)),
            dict(seq, rotary_cos=cos, rotary_sin=cos),
            NotImplementedError,
            "rotary",
        ),
    }


ERRORS = _errors()


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_argument(name):
    args, kwargs, error, match = ERRORS[name]
    with pytest.raises(error, match=match):
        flashattn2.flash_attn_with_kvcache(*args, **kwargs)


@pytest.mark.parametrize("varlen", [False, True])
def test_decode_takes_fp8_for_the_invariant_mode(varlen):
    """kvcache.Decode over e4m3 q, k and v with descales, as the batch-invariant mode's dense FP8 forward makes it
    (kvcache.invariant_shape(call, descale specs), then decode(q, kvcache.Cache(..., descales))): the output bf16, within the bound
    of the fp64 attention of the dequantized inputs."""
    from flashattn2.ops.run import call as calls
    from flashattn2.ops.launch import kvcache
    from flashattn2.ops import planning
    from flashattn2.ops.request import spec as specs
    from flashattn2.ops.request.options import Options
    from flashattn2.reference.attention import attention_ref

    batch, seqlen, nheads_k, group = 2, 9, 2, 2
    qd, kd, vd = (_descale(batch, nheads_k, True) for _ in range(3))
    q = randn(batch, seqlen, nheads_k * group, HEAD_DIM, dtype=torch.float32)
    q8 = rf.quantize(q.view(batch, seqlen, nheads_k, -1), qd).view(q.shape)
    k8, v8 = (rf.quantize(randn(batch, seqlen, nheads_k, HEAD_DIM, dtype=torch.float32), d) for d in (kd, vd))
    cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32, device=DEVICE) if varlen else None
    args = (q8, k8, v8) if not varlen else tuple(t.flatten(0, 1) for t in (q8, k8, v8))
    maxes = (seqlen, seqlen) if varlen else (0, 0)
    with flashattn2.batch_invariant():
        spec = specs.attention(AttentionRequest(*args, cu, cu, *maxes, causal=True))
        options = Options(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxes[0], max_seqlen_k=maxes[1],
                          softmax_scale=HEAD_DIM**-0.5, causal=True)  # fmt: skip
        call = calls.AttentionCall(spec, options, planning.plan(spec))
    descales = (qd, kd, vd)
    shape = kvcache.invariant_shape(call, tuple(specs.optional(d) for d in descales))
    decode = kvcache.Decode(call.plan, shape, spec.modes.arch)
    q_, k_, v_ = args
    if varlen:
        rows = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
        out, _ = decode(q_, kvcache.Cache(k_[None], v_[None], cu[1:], 0, rows, cu[:-1], None, descales), cu)
        out = out.view(batch, seqlen, *out.shape[1:])
    else:
        out, _ = decode(q_, kvcache.Cache(k_, v_, None, seqlen, descales=descales))
    assert out.dtype == torch.bfloat16
    deq = [rf.dequantize(t.view(batch, seqlen, nheads_k, -1), d).view(t.shape) for t, d in zip((q8, k8, v8), descales)]
    ref = attention_ref(*deq, causal=True)[0]
    low = attention_ref(*(t.to(torch.bfloat16) for t in deq), causal=True, upcast=False)[0]
    ok, err, bound = tolerance.check(out, ref, low, tolerance.FWD_FACTOR)
    assert ok, f"error {err} > bound {bound}"


def test_compile_decode_step_fullgraph():
    """torch.compile over a decode step on an FP8 cache, FP8 q: no graph break, the eager step's output and cache."""
    torch._dynamo.reset()
    q, k_cache, v_cache, kwargs = make(dict(q_fp8=True, seqlen_new=1))
    names = ("k", "v", "cache_seqlens", "q_descale", "k_descale", "v_descale")

    def step(q, k_cache, v_cache, k, v, cache_seqlens, q_descale, k_descale, v_descale):
        return flashattn2.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, causal=True,
        )  # fmt: skip

    kc, vc = k_cache.clone(), v_cache.clone()
    eager = step(q, kc, vc, *(kwargs[n] for n in names))
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, kc2, vc2, *(kwargs[n] for n in names))
    assert compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, eager)
    assert torch.equal(_codes(kc2), _codes(kc)) and torch.equal(_codes(vc2), _codes(vc))
