"""qkv- and kv-packed adapters: same results as flash_attn_func, one packed gradient."""

import pytest
import torch

import flashattn2
from cases import CAUSAL, randn


@pytest.mark.parametrize("causal", CAUSAL)
def test_qkvpacked_matches_unpacked(causal):
    qkv = randn(2, 77, 3, 4, 64, dtype=torch.float16, requires_grad=True)
    # deterministic: the default backward of an H100/H200 adds dQ in any order (bits may differ)
    out, lse, _ = flashattn2.flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True, deterministic=True)
    do = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = flashattn2.flash_attn_func(q, k, v, causal=causal, deterministic=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    assert torch.equal(out, ref)
    assert dqkv.shape == qkv.shape
    assert torch.equal(dqkv, torch.stack(ref_grads, dim=2))


@pytest.mark.parametrize("causal", CAUSAL)
def test_kvpacked_matches_unpacked_gqa(causal):
    q = randn(2, 50, 6, 32, dtype=torch.bfloat16, requires_grad=True)
    kv = randn(2, 90, 2, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    out = flashattn2.flash_attn_kvpacked_func(q, kv, causal=causal)
    do = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), do)
    q2 = q.detach().clone().requires_grad_()
    k, v = (t.detach().clone().requires_grad_() for t in kv.unbind(2))
    ref = flashattn2.flash_attn_func(q2, k, v, causal=causal)
    rq, rk, rv = torch.autograd.grad(ref, (q2, k, v), do)
    assert torch.equal(out, ref)
    assert torch.equal(dq, rq) and torch.equal(dkv, torch.stack((rk, rv), dim=2))


def test_packed_shape_errors():
    with pytest.raises(ValueError, match="qkv"):
        flashattn2.flash_attn_qkvpacked_func(randn(1, 8, 2, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="kv"):
        flashattn2.flash_attn_kvpacked_func(
            randn(1, 8, 2, 16, dtype=torch.float16), randn(1, 8, 3, 2, 16, dtype=torch.float16)
        )
