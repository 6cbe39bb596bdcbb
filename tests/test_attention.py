"""flash_attn_func against the reference: out, logsumexp and gradients, by flash_attn's rule."""

import random

import pytest
import torch

import flashattn2
from cases import CAUSAL, DTYPES, SHAPE_PARAMS, make_qkv, randn
from conftest import DEVICE, ON_GPU
from flashattn2.ops import _runtime, planning
from flashattn2.ops.launch import launcher
from flashattn2.ops.request import modes, spec
from flashattn2.ops.run import call as calls
from flashattn2.ops.request.request import AttentionRequest
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from spies import HOPPER, spy_launches
from tolerance import assert_close, check_against_reference

T = planning.TileConfig
force = planning.force
# Kernel paths: on CUDA the table's choice (on an H200: the Gluon forward where it applies, its
# persistent kernel at head dim 64/128 and its warp-specialized one at 256, the Gluon backward, TMA with
# host-built descriptors where the inputs allow them), the Triton kernels instead of the Gluon ones,
# descriptors made in each program, the forced pointer (non-TMA) path, and the other architectures'
# rows and load path (on an H200: what an A100 or an RTX card runs); on the CPU, both load paths (TMA:
# host-built descriptors for power-of-two head dims) with tiles where BLOCK_M != BLOCK_N so masked-block
# ranges are exercised.
if ON_GPU:
    PATHS = [
        pytest.param({}, id="table"),
        pytest.param({"hopper": False}, id="triton"),
        pytest.param({"hopper": False, "host_desc": False}, id="kernel-desc"),
        pytest.param({"tma": False}, id="no-tma"),
        pytest.param({"arch": "sm80"}, id="sm80"),
        pytest.param({"arch": "sm86"}, id="sm86"),
    ]
else:
    PATHS = [
        pytest.param({}, id="ptr-64x64"),
        pytest.param(
            {
                "tma": True,
                "host_desc": True,
                "fwd": T(32, 64, 4, 1),
                "bwd_dkdv": T(16, 32, 4, 1),
                "bwd_dq": T(64, 16, 4, 1),
            },
            id="tma-mixed-tiles",
        ),
    ]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_forward_backward(shape, dtype, causal, path):
    q, k, v = make_qkv(shape, dtype)
    with force(**path):
        out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.dtype == dtype and lse.dtype == torch.float32 and s_dmask.numel() == 0
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_against_reference(q, k, v, out, lse, grads, do, causal)


@pytest.mark.parametrize("blocks", [3, 13], ids=["head-by-head", "all-heads-first"])
def test_causal_block_orders(blocks):
    """Causal grids take query blocks head by head (up to 8 per head) or the heaviest of all heads
    first (more): every block is computed once in both orders (the Triton forward and its dQ pass:
    the Gluon kernels, which an H100/H200 would take here, have their own orders)."""
    block = 64 if ON_GPU else 16
    seqlen = blocks * block - 5  # a ragged last block
    q, k, v = make_qkv((3, seqlen, seqlen + 7, 4, 2, 64 if ON_GPU else 32), torch.float16)
    tile = T(block, block, 4, 1)
    with force(fwd=tile, bwd_dq=tile, hopper=False):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, True)


@pytest.mark.parametrize("causal", CAUSAL)
def test_lse_gradient(causal):
    """The returned logsumexp is differentiable (ring attention needs it)."""
    shape = (2, 70, 90, 2, 1, 32)
    q, k, v = make_qkv(shape, torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * do).sum() + (lse * dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, do, causal, dlse=dlse)


@pytest.mark.parametrize("which", ["out-only", "lse-only"])
def test_one_output_gradient(which, monkeypatch):
    """Missing output gradients are not materialized (registry._grad_of_out): with only `out`
    used, the backward gets no lse gradient and the preprocess reads none (HAS_DLSE off); with
    only the logsumexp used, the output's gradient is zeros. Both against the reference."""
    q, k, v = make_qkv((2, 70, 90, 4, 2, 64), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    flags = spy_launches(monkeypatch, "attn_bwd_preprocess_kernel", "HAS_DLSE")
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    if which == "out-only":
        grads = torch.autograd.grad(out, (q, k, v), do)
        dlse = None
    else:
        grads = torch.autograd.grad(lse, (q, k, v), dlse)
        do = torch.zeros_like(out)
    assert flags == [(which == "lse-only",)], flags
    check_against_reference(q, k, v, out, lse, grads, do, True, dlse=dlse)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_pad, copy_lse", [(100, 128, True), (128, 128, False), (128, 128, True), (61, 64, True)]
)
@pytest.mark.parametrize("d", [64, 256])  # 64 and 32 rows per preprocess program
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_padded_preprocess(seqlen_q, seqlen_pad, copy_lse, d, with_dlse):
    """The Gluon backward's one preprocess launch (ops.launch.launch_triton.Preprocess with seqlen_pad): delta =
    rowsum(dO * O) - dlse up to seqlen_q and 0 to seqlen_pad, the fp32 dQ accumulator's padded rows
    zeroed, and where asked (a tail; the launcher also asks for a non-contiguous lse) lse copied
    with +inf past seqlen_q; every buffer starts NaN-filled. (On the CPU the interpreter runs it; on
    an H100/H200 it is what the Gluon backward runs.)"""
    from flashattn2.ops.launch import launch_triton
    from flashattn2.ops.launch.layout import Layout

    b, h = 2, 3
    out, dout = (randn(b, seqlen_q, h, d, dtype=torch.float16) for _ in range(2))
    lse = randn(b, h, seqlen_q, dtype=torch.float32)
    dlse = randn(b, h, seqlen_q, dtype=torch.float32) if with_dlse else None
    layout = Layout(spec.attention(AttentionRequest(out, out, out)), 1.0)
    delta, lse_pad = (_runtime.empty((b, h, seqlen_pad), torch.float32, out.device) for _ in range(2))
    acc = _runtime.empty((b, seqlen_pad, h, d), torch.float32, out.device)
    pre = launch_triton.Preprocess(layout, spec.tensor(out), spec.tensor(dout), with_dlse, False, seqlen_pad, copy_lse)
    pre(launch_triton.PreprocessTensors(out, dout, lse, dlse, delta, None, lse_pad if copy_lse else None, acc))
    expected = (out.float() * dout.float()).sum(-1).transpose(1, 2)
    if with_dlse:
        expected = expected - dlse
    torch.testing.assert_close(delta[:, :, :seqlen_q], expected, rtol=1e-5, atol=1e-4)
    assert (delta[:, :, seqlen_q:] == 0).all()
    if copy_lse:
        assert torch.equal(lse_pad[:, :, :seqlen_q], lse) and torch.isposinf(lse_pad[:, :, seqlen_q:]).all()
    else:
        assert lse_pad.isnan().all()  # not written
    assert (acc == 0).all()


@pytest.mark.parametrize("layout", ["bhsd-transposed", "sliced-headdim", "last-dim-strided"])
def test_strided_inputs(layout):
    b, s, h, d = 2, 113, 4, 48
    dtype = torch.float16
    if layout == "bhsd-transposed":
        make = lambda: randn(b, h, s, d, dtype=dtype).transpose(1, 2)
    elif layout == "sliced-headdim":
        make = lambda: randn(b, s, h, d + 24, dtype=dtype)[..., 5 : 5 + d]
    else:  # stride(-1) != 1: copied, as flash_attn does
        make = lambda: randn(b, s, h, 2 * d, dtype=dtype)[..., ::2]
    q, k, v = (make().requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, True)


def test_ready_is_for_kernels_rule():
    """A prepared call proves its tensors ready by ops.run.call's reading of the spec, which must be for_kernels' own
    rule on every layout (a size-1 or empty dimension with stride 0, a last dimension of one): where they differed, a
    call copied by for_kernels would still not be ready (the fuzzer found seqlen_k 0 raising NotReady)."""
    from flashattn2.ops.run.registry import for_kernels

    rng = random.Random(0)
    base = torch.zeros(200)
    for _ in range(2000):
        ndim = rng.randint(1, 4)
        shape = [rng.choice((0, 1, 1, 2, 3)) for _ in range(ndim)]
        stride = [rng.choice((0, 1, 2, 3, 6, 12)) for _ in range(ndim)]
        t = base.as_strided(shape, stride)
        assert calls._kernel_ready(spec.tensor(t)) == (for_kernels(t) is t), (shape, stride)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_inputs_not_as_kernels_take_them_repeated(varlen):
    """A repeated call whose k is expanded (stride 0) and v strided in its last dimension copies them every time (the
    prepared call of ready tensors is never reused for them: ops.run.call.NotReady), and gives the contiguous call's
    output bit for bit; so does the contiguous call after it."""
    h, d = 4, 32
    q = randn(2, 9, h, d, dtype=torch.float16)
    k = randn(2, 11, 1, d, dtype=torch.float16).expand(2, 11, h, d)
    v = randn(2, 11, h, 2 * d, dtype=torch.float16)[..., ::2]
    if varlen:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu_q, cu_k = (torch.tensor([0, 4, n], dtype=torch.int32, device=q.device) for n in (18, 22))
        call = lambda *qkv: flashattn2.flash_attn_varlen_func(*qkv, cu_q, cu_k, 14, 18, causal=True)
    else:
        call = lambda *qkv: flashattn2.flash_attn_func(*qkv, causal=True)
    assert k.stride(-2) == 0 and v.stride(-1) == 2
    expected = call(q, k.contiguous(), v.contiguous())
    for _ in range(2):
        assert torch.equal(call(q, k, v), expected)
    assert torch.equal(call(q, k.contiguous(), v.contiguous()), expected)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_returned_lse_is_the_callers(varlen):
    """A call without return_attn_probs (and no gradient) may write its logsumexp into a buffer such calls share
    (_runtime.output_lse): a logsumexp returned to a caller is never that buffer, so later calls leave it as returned,
    and the outputs are the same with it or without."""

    def call(q, k, v, lse=False):
        if not varlen:
            return flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=lse)
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu = torch.tensor([0, 5, 18], dtype=torch.int32, device=q.device)
        return flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, return_attn_probs=lse)

    qkv = [randn(2, 9, 2, 32, dtype=torch.float16) for _ in range(3)]
    out, lse, _ = call(*qkv, lse=True)
    kept = lse.clone()
    for _ in range(2):
        assert torch.equal(call(*qkv), out)
        other = [randn(2, 9, 2, 32, dtype=torch.float16) for _ in range(3)]
        call(*other)
        _, lse_other, _ = call(*other, lse=True)
        assert torch.equal(lse, kept) and not torch.equal(lse_other, kept)


def test_broadcast_output_gradient():
    """out.sum() sends an expanded (stride-0) dO; the backward must not feed it to TMA as is."""
    q, k, v = make_qkv((2, 130, 130, 4, 2, 64), torch.bfloat16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, torch.ones_like(out), True)


def test_softmax_scale():
    q, k, v = make_qkv((1, 65, 65, 2, 2, 64), torch.float16)
    out = flashattn2.flash_attn_func(q, k, v, softmax_scale=0.37)
    ref, _ = attention_ref(q, k, v, softmax_scale=0.37)
    low, _ = attention_ref(q, k, v, softmax_scale=0.37, upcast=False)
    assert_close("out", out, ref, low, FWD_FACTOR)
    # a scale that changes the result: guards against the argument being ignored
    assert (out.float() - attention_ref(q, k, v)[0]).abs().max() > 1e-2


def test_reference_upcast_never_lowers_float64():
    """The oracle computes float64 inputs in float64 (upcast means at least float32, float64 for fp32 inputs)."""
    q, k, v = (torch.randn(1, 7, 2, 16, dtype=torch.float64) for _ in range(3))
    out, lse = attention_ref(q, k, v, causal=True)
    exact, exact_lse = attention_ref(q, k, v, causal=True, upcast=False)  # float64 throughout
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, exact_lse.double(), rtol=0, atol=1e-6)  # (upcast=False's lse is float32)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", CAUSAL)
def test_zero_softmax_scale(d, causal, monkeypatch):
    """softmax_scale=0 (allowed): every visible key weighs the same, so O is the mean of the visible
    values and lse the log of their count, in every forward (on an H100/H200 each Gluon kernel, the
    launch checked: the persistent one at headdim 64/128, the warp-specialized one at 256; their masked
    blocks must not turn an invisible score's -inf * 0 into NaN) and through the backward. 100 queries
    over 97 keys: causal rows 0-2 see no key (O 0, lse +inf), ragged key blocks, and the persistent
    kernel's causal tiles start before row 0."""
    if not HOPPER and d != 64:
        pytest.skip("elsewhere one kernel (kernels/fwd.py) runs every head dim: d64 checks it")
    launched = spy_launches(monkeypatch)
    sq, sk = 100, 97
    q, k, v = make_qkv((2, sq, sk, 4, 2, d), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    if HOPPER:
        expected = "attn_fwd_ws_kernel" if d == 256 else "attn_fwd_persist_kernel"
    else:
        expected = "attn_fwd_kernel"
    assert launched[0] == expected, launched
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=0.0, causal=causal)
    low, low_lse = attention_ref(q, k, v, softmax_scale=0.0, causal=causal, upcast=False)
    assert_close("out", out, ref, low, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    ref_grads = torch.autograd.grad((ref * do.to(ref.dtype)).sum(), (q, k, v))
    low_grads = torch.autograd.grad((low * do).sum(), (q, k, v))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)
    # the mean of the visible values: row i sees keys j <= i + sk - sq when causal
    rows, cols = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
    seen = (cols <= rows + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    vv = v.float().repeat_interleave(2, dim=2)  # GQA: 4 query heads over 2
    mean = torch.einsum("ij,bjhd->bihd", seen.float(), vv) / seen.sum(1).clamp(min=1)[None, :, None, None]
    assert (out.float() - mean).abs().max() < 2e-2
    blind = sq - sk if causal else 0  # rows that see no key
    assert torch.isposinf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()


@pytest.mark.parametrize("causal", CAUSAL)
def test_deterministic_bitwise(causal):
    """deterministic=True: dQ has its own pass (no atomics), repeated runs give identical bits; and on the
    Triton kernels (force(hopper=False); the CPU's only kernels) deterministic=False gives the same bits as True."""
    shape = (2, 300, 300, 4, 2, 64) if ON_GPU else (1, 97, 97, 2, 1, 32)
    q, k, v = make_qkv(shape, torch.bfloat16)
    do = randn(*q.shape, dtype=q.dtype)

    def run(deterministic, hopper=None):
        with force(hopper=hopper):
            out = flashattn2.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    for first, other in ((run(True), run(True)), (run(True, False), run(False, False))):
        for a, b in zip(first, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="races need a GPU: the interpreter runs programs one at a time")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("causal", CAUSAL)
def test_race_repeated_runs(causal, deterministic):
    """Many runs with fixed inputs give identical out, lse, dq, dk, dv (a moving result is a race).
    deterministic=False (the Gluon backward on an H100/H200) adds dQ in any order: its dQ may move
    by rounding only; dK and dV accumulate in registers and stay identical."""
    q, k, v = make_qkv((4, 2048, 2048, 16, 4, 128), torch.float16)
    do = randn(*q.shape, dtype=q.dtype)
    first = None
    for _ in range(30):
        out, lse, _ = flashattn2.flash_attn_func(
            q, k, v, causal=causal, return_attn_probs=True, deterministic=deterministic
        )
        result = (out, lse, *torch.autograd.grad(out, (q, k, v), do))
        if first is None:
            first = result
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, result):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * first[2].abs().max().item(), msg=name)
            else:
                assert torch.equal(a, b), name


def test_tma_alignment_rule():
    """TMA only for 16-byte aligned bases and leading strides that are nonzero 16-byte multiples."""
    from flashattn2.ops.launch.tma import use_tma

    base = torch.empty(4096, dtype=torch.float16)
    for offset, strides in [
        (0, (512, 64, 1)),
        (8, (512, 64, 1)),
        (1, (512, 64, 1)),
        (0, (520, 64, 1)),
        (0, (512, 4, 1)),
        (0, (0, 64, 1)),
        (16, (64, 0, 1)),
        (0, (1024, 128, 1)),
        (24, (256, 8, 1)),
    ]:
        t = base.as_strided((2, 4, 8), strides, offset)
        es = t.element_size()
        expected = t.data_ptr() % 16 == 0 and all(s and (s * es) % 16 == 0 for s in strides[:-1])
        assert use_tma("sm90", t) == expected, (offset, strides)
        assert not use_tma("sm80", t)


def test_host_descriptor_rule(monkeypatch):
    """Host-built descriptors (on by default) for the TMA path on dense inputs with a
    power-of-two head dim and adjacent heads; descriptors made in the kernel otherwise (varlen,
    other head dims, heads apart, switched off), and none without TMA. Checked where the Triton
    kernels' launchers ask (the Gluon forward off), with the real calls."""

    taken = []
    attention = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")

    def watch(kernel, grid, args, kwargs):
        if kernel.__name__ in attention:
            taken.append(any(type(a) is launcher.HostDesc for a in args))

    def run(q, k, v, varlen=False, **switches):
        taken.clear()
        with force(hopper=False, **switches), launcher.watched(watch):
            if varlen:
                cu = torch.tensor([0, q.shape[0] - 5, q.shape[0]], dtype=torch.int32, device=DEVICE)
                out = flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, q.shape[0] - 5, q.shape[0] - 5)
            else:
                out = flashattn2.flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(out.float().sum(), (q, k, v))
        return list(taken)

    n = 70 if not ON_GPU else 700
    dense = [randn(2, n, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*dense, tma=True, host_desc=True) == [True] * 3  # forward, dK/dV, dQ
    assert run(*dense, tma=True) == [True] * 3  # the default
    assert run(*dense, tma=True, host_desc=False) == [False] * 3
    assert run(*dense, tma=False, host_desc=True) == [False] * 3
    odd = [randn(2, n, 4, 40, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*odd, tma=True, host_desc=True) == [False] * 3
    # heads apart: every other 64-column slice of a 128-wide last dimension
    wide = randn(2, n, 4, 128, dtype=torch.float16)
    apart = [wide[..., :64].detach().requires_grad_() for _ in range(3)]
    assert apart[0].stride(2) == 128 and run(*apart, tma=True, host_desc=True) == [False] * 3
    packed = [randn(n, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*packed, varlen=True, tma=True, host_desc=True) == [False] * 3


def test_arch_override(monkeypatch, fresh_plans):
    """force(arch=...) makes a CUDA device select another architecture's rows and
    load path (the GPU tests run sm80 and sm86 that way); the interpreter ignores it, and a GPU
    without TMA cannot be made to take the sm90 path."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(modes._ARCH, 0, "sm90")  # device 0 is an H200 (its capability is cached)
    tile = lambda: (
        planning.lookup(planning.arch_of(cuda), torch.float16, 128, False, 4096, planning.Features(), "fwd").tile
    )
    fwd = tile()
    assert fwd == T(128, 64, 4, 2)
    with force(arch="sm80"):
        assert planning.arch_of(cuda) == "sm80"
        assert planning.arch_of(torch.device("cpu")) == "interp"
        assert tile() == T(128, 64, 8, 2) != fwd
    with force(arch="sm86"):
        assert planning.arch_of(cuda) == "sm86"
    assert planning.forced().arch is None and planning.arch_of(cuda) == "sm90"
    with pytest.raises(ValueError, match="arch must be one of"):
        with force(arch="sm70"):
            pass
    monkeypatch.setitem(modes._ARCH, 0, "sm80")
    with force(arch="sm90"):
        with pytest.raises(ValueError, match="no TMA"):
            planning.arch_of(cuda)


def test_varlen_tail_rows_get_zero_gradient():
    """Varlen with rows past cu_seqlens[-1]: deterministic=False and True give the same gradients (on the CPU,
    one kernel; on a GPU the Triton kernels either way: the Gluon backward is dense only), and the rows that
    belong to no sequence get a zero gradient."""
    from cases import cu_seqlens

    lengths = [37, 63, 20] if not ON_GPU else [370, 1630, 200]
    total = sum(lengths) + 10
    cu = cu_seqlens(lengths)
    q, k, v = (randn(total, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = randn(total, 4, 64, dtype=torch.bfloat16)
    grads = []
    for deterministic in (False, True):
        out = flashattn2.flash_attn_varlen_func(
            q, k, v, cu, cu, max(lengths), max(lengths), causal=True, deterministic=deterministic
        )
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name
        assert torch.equal(a[sum(lengths) :], torch.zeros_like(a[sum(lengths) :])), name


def test_keys_past_the_end_add_nothing(monkeypatch):
    """Non-causal, seqlen_k not a multiple of the key block, every score strongly negative: the
    zero-filled key rows past seqlen_k get P = exp(-L), huge, and must not reach dQ (inf * 0)
    on the Gluon backward (on an H100/H200; elsewhere the Triton backward runs)."""
    b, s, h, d = 1, 70, 2, 64
    u = torch.randn(d, device=DEVICE, dtype=torch.float32)
    u = u / u.norm() * 32.0  # scores about -|u|^2 / sqrt(d) = -128
    k = (randn(b, 41, h, d, dtype=torch.float32) * 0.1 + u).to(torch.bfloat16).requires_grad_()
    v = randn(b, 41, h, d, dtype=torch.bfloat16, requires_grad=True)
    q = (randn(b, s, h, d, dtype=torch.float32) * 0.1 - u).to(torch.bfloat16).requires_grad_()
    do = randn(b, s, h, d, dtype=torch.bfloat16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True)
    assert lse.max() < -100  # the case: exp(-L) overflows fp32
    grads2 = torch.autograd.grad(out, (q, k, v), do)
    out = flashattn2.flash_attn_func(q, k, v, deterministic=False)
    launched = spy_launches(monkeypatch)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert ("attn_bwd_ws_kernel" in launched) == HOPPER, launched
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads2):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)
