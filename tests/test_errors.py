"""Bad input raises a clear error naming the argument; options not implemented yet are refused."""
import pytest
import torch

import flashattn2
from cases import randn
from conftest import DEVICE, ON_GPU

f16 = torch.float16


def qkv(b=1, sq=16, sk=16, h=2, hk=2, d=32, dtype=f16):
    make = lambda s, n: randn(b, s, n, d, dtype=torch.float32).to(dtype)
    return make(sq, h), make(sk, hk), make(sk, hk)


@pytest.mark.parametrize("case, exc, match", [
    pytest.param(lambda: (randn(16, 2, 32, dtype=f16), *qkv()[1:]), ValueError, "q must have 4 dimensions", id="q-ndim"),
    pytest.param(lambda: (qkv()[0], randn(1, 16, 2, dtype=f16), qkv()[2]), ValueError, "k must have 4", id="k-ndim"),
    pytest.param(lambda: (qkv()[0].tolist(), *qkv()[1:]), TypeError, "q must be a torch.Tensor", id="q-type"),
    pytest.param(lambda: qkv(dtype=torch.int32), TypeError, "dtype", id="int-dtype"),
    pytest.param(lambda: qkv(dtype=torch.float64), TypeError, "dtype", id="fp64"),
    pytest.param(lambda: (qkv()[0], qkv(dtype=torch.bfloat16)[1], qkv()[2]), TypeError, "one dtype", id="mixed-dtype"),
    pytest.param(lambda: (qkv()[0], qkv(b=2)[1], qkv(b=2)[2]), ValueError, "batch", id="batch-mismatch"),
    pytest.param(lambda: (qkv()[0], qkv(d=64)[1], qkv(d=64)[2]), ValueError, "headdim", id="headdim-mismatch"),
    pytest.param(lambda: (qkv()[0], qkv(sk=9)[1], qkv()[2]), ValueError, "same shape", id="kv-shape"),
    pytest.param(lambda: qkv(h=6, hk=4), ValueError, "multiple of nheads", id="gqa-ratio"),
    pytest.param(lambda: qkv(d=264), NotImplementedError, "headdim 264", id="headdim-264"),
    pytest.param(lambda: qkv(sk=0), ValueError, ">= 1", id="empty-seqlen"),
])
def test_bad_inputs(case, exc, match):
    with pytest.raises(exc, match=match):
        flashattn2.flash_attn_func(*case())


@pytest.mark.parametrize("kwargs, exc, match", [
    pytest.param(dict(dropout_p=0.1, softcap=5.0), NotImplementedError, "softcap", id="dropout-softcap"),
    pytest.param(dict(dropout_p=1.0), ValueError, "dropout_p", id="dropout-range"),
    pytest.param(dict(window_size=(-2, 0)), ValueError, "window_size", id="window-range"),
    pytest.param(dict(window_size=(1.5, 0)), ValueError, "window_size", id="window-float"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
    pytest.param(dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "alibi_slopes", id="alibi-dtype"),
    pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes", id="alibi-shape"),
    pytest.param(dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes", id="alibi-type"),
    pytest.param(dict(softmax_scale=-0.1), NotImplementedError, "softmax_scale", id="negative-scale"),
])
def test_unsupported_options(kwargs, exc, match):
    if isinstance(kwargs.get("alibi_slopes"), torch.Tensor):
        kwargs = dict(kwargs, alibi_slopes=kwargs["alibi_slopes"].to(DEVICE))
    for fn, args in ((flashattn2.flash_attn_func, qkv()),
                     (flashattn2.flash_attn_qkvpacked_func, (torch.stack(qkv(), dim=2),)),
                     (flashattn2.flash_attn_kvpacked_func, (qkv()[0], torch.stack(qkv()[1:], dim=2)))):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device beside the CPU")
def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flashattn2.flash_attn_func(q, k.cpu(), v)


def test_cpu_tensor_without_interpreter(monkeypatch):
    from flashattn2.ops import _runtime
    monkeypatch.setattr(_runtime, "interpreted", lambda: False)
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flashattn2.flash_attn_func(q, k, v)


def test_empty_batch():
    q, k, v = qkv(b=0)
    out = flashattn2.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.device.type == DEVICE
