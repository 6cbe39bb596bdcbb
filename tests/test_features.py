"""Sliding window, softcap and ALiBi, alone and combined, forward and backward, by flash_attn's rule."""

import pytest
import torch

import flashattn2
from cases import cu_seqlens, make_qkv
from conftest import DEVICE, ON_GPU
from flashattn2.ops import planning
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

T = planning.TileConfig
if ON_GPU:
    SHAPES = [(2, 1000, 1500, 8, 2, 59), (1, 2049, 1023, 4, 1, 128), (2, 777, 777, 4, 4, 256)]
    PATHS = [
        pytest.param({}, id="table"),
        pytest.param({"tma": False}, id="no-tma"),
        pytest.param({"host_desc": False}, id="kernel-desc"),
    ]
else:
    SHAPES = [(2, 97, 131, 4, 2, 64), (1, 131, 97, 2, 1, 40)]
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

# (causal, window_size, softcap, alibi): alibi None, "h" for (nheads,), "bh" for (batch, nheads)
FEATURES = [
    pytest.param(False, (0, 0), 0.0, None, id="window-0-0"),
    pytest.param(False, (5, -1), 0.0, None, id="window-5-inf"),
    pytest.param(False, (-1, 7), 0.0, None, id="window-inf-7"),
    pytest.param(False, (20, 3), 0.0, None, id="window-20-3"),
    pytest.param(False, (-1, 0), 0.0, None, id="window-inf-0-is-causal"),
    pytest.param(True, (10, -1), 0.0, None, id="causal-window-10"),
    pytest.param(True, (3, 5), 0.0, None, id="causal-window-3-right-ignored"),
    pytest.param(False, (-1, -1), 1.0, None, id="softcap"),
    pytest.param(True, (-1, -1), 2.5, None, id="causal-softcap"),
    pytest.param(False, (-1, -1), 0.0, "h", id="alibi-h"),
    pytest.param(True, (-1, -1), 0.0, "bh", id="causal-alibi-bh"),
    pytest.param(True, (33, -1), 1.5, "bh", id="causal-window-softcap-alibi"),
    pytest.param(False, (9, 12), 3.0, "h", id="window-softcap-alibi"),
]


def slopes(kind, batch, nheads):
    if kind is None:
        return None
    shape = (nheads,) if kind == "h" else (batch, nheads)
    return (torch.rand(shape, device=DEVICE) * 0.5).float()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal, window, softcap, alibi", FEATURES)
@pytest.mark.parametrize("shape", [pytest.param(s, id="b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*s)) for s in SHAPES])
def test_features(shape, causal, window, softcap, alibi, path):
    dtype = torch.float16
    q, k, v = make_qkv(shape, dtype)
    alibi_slopes = slopes(alibi, shape[0], shape[3])
    opts = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)
    with planning.force(**path):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    ref_out, ref_lse = attention_ref(q, k, v, **opts)
    low_out, low_lse = attention_ref(q, k, v, upcast=False, **opts)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "rows without keys must have lse=+inf"
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo, BWD_FACTOR)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_features_other_dtypes(dtype):
    shape = (2, 70, 90, 4, 2, 32)
    q, k, v = make_qkv(shape, dtype)
    opts = dict(causal=True, window_size=(17, -1), softcap=2.0, alibi_slopes=slopes("h", 2, 4))
    out = flashattn2.flash_attn_func(q, k, v, **opts)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_out, _ = attention_ref(q, k, v, **opts)
    low_out, _ = attention_ref(q, k, v, upcast=False, **opts)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo, BWD_FACTOR)


def test_features_change_the_result():
    """Guards against an option being silently ignored."""
    q, k, v = make_qkv((1, 64, 64, 2, 2, 32), torch.float16, requires_grad=False)
    base = flashattn2.flash_attn_func(q, k, v)
    for opts in (dict(window_size=(4, 4)), dict(softcap=0.5), dict(alibi_slopes=slopes("h", 1, 2) + 0.5)):
        assert (flashattn2.flash_attn_func(q, k, v, **opts).float() - base.float()).abs().max() > 1e-2, opts


def test_packed_with_features():
    qkv = torch.randn(2, 50, 3, 4, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    opts = dict(causal=True, window_size=(7, -1), softcap=1.0, alibi_slopes=slopes("bh", 2, 4))
    out = flashattn2.flash_attn_qkvpacked_func(qkv, **opts)
    do = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = flashattn2.flash_attn_func(q, k, v, **opts)
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), do), dim=2))


BIG = 2**31 - 1


@pytest.mark.parametrize("path", ["dense", "varlen", "paged", "invariant", "private", "private-varlen"])
def test_window_edges_at_or_past_the_keys_are_none(path):
    """flash_attn 2.8's rule: a window edge at or past seqlen_k (max_seqlen_k in varlen) is no edge. Edges near 2**31
    neither overflow the kernels' position sums (the output was zeros, LSE +inf, gradients zero) nor differ from -1:
    the same kernels run, so outputs, LSEs and gradients are bit-identical to no window. With seqlen_q > seqlen_k + 1
    the rule is not the literal window (a right edge of seqlen_k would hide every key from the first rows); an edge
    below seqlen_k stays an edge."""
    from flashattn2 import flash_attn_interface as fai

    sq, sk = 13, 5
    q, k, v = make_qkv((2, sq, sk, 2, 1, 16), torch.float16)
    lengths = [sq, sq - 4], [sk, sk - 1]
    cu_q, cu_k = cu_seqlens(lengths[0]), cu_seqlens(lengths[1])
    packed = [
        torch.cat([t[0, :n], t[1, :m]]).detach().requires_grad_()
        for t, n, m in zip((q, k, v), (sq, sk, sk), (sq - 4, sk - 1, sk - 1))
    ]

    def run(window):
        if path in ("dense", "invariant"):
            inputs = (q, k, v)
            with flashattn2.batch_invariant(path == "invariant"):
                out, lse, _ = flashattn2.flash_attn_func(*inputs, window_size=window, return_attn_probs=True)
        elif path == "varlen":
            inputs = packed
            out, lse, _ = flashattn2.flash_attn_varlen_func(
                *inputs, cu_q, cu_k, sq, sk, window_size=window, return_attn_probs=True
            )
        elif path == "paged":  # forward only: one 8-token page a sequence
            pages = [torch.zeros(2, 8, *t.shape[2:], device=DEVICE, dtype=t.dtype) for t in (k, v)]
            for page, t in zip(pages, (k, v)):
                page[0, :sk], page[1, : sk - 1] = t[0].detach(), t[1, : sk - 1].detach()
            table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
            inputs = (packed[0].detach(),)
            out, lse, _ = flashattn2.flash_attn_varlen_func(
                *inputs, *pages, cu_q, cu_k, sq, sk, window_size=window, block_table=table, return_attn_probs=True
            )
        elif path == "private":
            inputs = (q, k, v)
            out, lse = fai._flash_attn_forward(*inputs, 0.0, None, False, *window, 0.0, None, False)[:2]
        else:
            inputs = packed
            out, lse = fai._flash_attn_varlen_forward(*inputs, cu_q, cu_k, sq, sk, 0.0, None, False, *window)[:2]
        grads = torch.autograd.grad(out.float().sum(), inputs) if out.requires_grad else ()
        return out, lse, grads

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(map(torch.equal, a[2], b[2]))

    none = run((-1, -1))
    assert not none[0].isnan().any() and none[0].abs().amax() > 0
    for window in [(-1, BIG), (BIG, -1), (BIG, BIG), (-1, sk), (sk, sk), (BIG - 15, BIG - 15)]:
        assert same(run(window), none), window
    assert same(run((3, BIG)), run((3, -1)))
    assert not torch.equal(run((-1, sk - 1))[0], none[0])  # below seqlen_k: an edge
