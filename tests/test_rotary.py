"""flashattn2.layers.rotary against the plain-PyTorch rotary reference."""

import pytest
import torch

from cases import DTYPES, cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2.layers.rotary import (
    ApplyRotaryEmb,
    ApplyRotaryEmbKV_,
    ApplyRotaryEmbQKV_,
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
    rotate_half,
)
from flashattn2.reference.rotary import rotary_ref

TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}
SEQ = 700 if ON_GPU else 37


def cos_sin(seqlen_ro, rotary_dim, dtype):
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device=DEVICE) * 6.28
    return angle.cos().to(dtype), angle.sin().to(dtype)


def close(ours, ref):
    tol = TOL[ours.dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim,headdim", [(64, 64), (32, 80), (16, 40)])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_apply_rotary_emb(dtype, interleaved, rotary_dim, headdim, offsets):
    batch, nheads = 2, 3
    x = randn(batch, SEQ, nheads, headdim, dtype=dtype, requires_grad=True)
    offs = {"zero": 0, "int": 5, "tensor": torch.tensor([0, 9], device=DEVICE, dtype=torch.int32)}[offsets]
    cos, sin = cos_sin(SEQ + 9, rotary_dim, dtype)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offs)
    ref = rotary_ref(x.detach(), cos, sin, interleaved, offs)
    close(out, ref)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    close(dx, rotary_ref(g, cos, sin, interleaved, offs, conjugate=True))


@pytest.mark.parametrize("offs", ["tensor", "int"])
def test_positions_past_cos_are_left_alone(offs):
    """flash_attn's rule: only seqlen <= seqlen_ro is required; positions past the table stay."""
    x = randn(1, 10, 2, 32, dtype=torch.float32)
    cos, sin = cos_sin(12, 32, torch.float32)
    offs = torch.tensor([6], device=DEVICE, dtype=torch.int32) if offs == "tensor" else 6  # positions 6..15
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offs)
    close(out, rotary_ref(x, cos, sin, False, offs))
    assert torch.equal(out[:, 6:], x[:, 6:])


def test_strided_offsets_and_gradient():
    x = randn(3, 9, 2, 32, dtype=torch.float32, requires_grad=True)
    cos, sin = cos_sin(20, 32, torch.float32)
    offs = torch.arange(0, 12, device=DEVICE, dtype=torch.int64)[::4]  # 0, 4, 8: a strided tensor
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offs)
    close(out, rotary_ref(x.detach(), cos, sin, False, offs.contiguous()))
    g = torch.randn(3, 9, 1, 32, device=DEVICE).expand(3, 9, 2, 32)  # a stride-0 head dimension
    (dx,) = torch.autograd.grad(out, x, g)
    close(dx, rotary_ref(g.contiguous(), cos, sin, False, offs.contiguous(), conjugate=True))


def test_inplace_and_varlen():
    lengths = [5, 0, SEQ]
    cu = cu_seqlens(lengths)
    x = randn(sum(lengths), 2, 64, dtype=torch.float16)
    cos, sin = cos_sin(SEQ + 3, 48, torch.float16)
    offs = torch.tensor([3, 1, 0], device=DEVICE, dtype=torch.int32)
    ref = rotary_ref(x, cos, sin, True, offs, cu_seqlens=cu)
    y = x.clone()
    out = apply_rotary_emb(
        y, cos, sin, interleaved=True, inplace=True, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=max(lengths)
    )
    assert out.data_ptr() == y.data_ptr()
    close(y, ref)


@pytest.mark.parametrize("layout", ["5d", "gqa-4d"])
def test_qkv_and_kv_in_place(layout):
    b, s, h, d = 2, SEQ, 4, 64
    cos, sin = cos_sin(s + 2, 32, torch.float32)
    if layout == "5d":
        qkv = randn(b, s, 3, h, d, dtype=torch.float32)
        q_ref = rotary_ref(qkv[:, :, 0], cos, sin, False, 2)
        k_ref = rotary_ref(qkv[:, :, 1], cos, sin, False, 2)
        v_ref = qkv[:, :, 2].clone()
        out = apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=2)
        q, k, v = out[:, :, 0], out[:, :, 1], out[:, :, 2]
    else:
        hq, hk = 4, 2
        qkv = randn(b, s, hq + 2 * hk, d, dtype=torch.float32)
        q_ref = rotary_ref(qkv[:, :, :hq], cos, sin, False, 2)
        k_ref = rotary_ref(qkv[:, :, hq : hq + hk], cos, sin, False, 2)
        v_ref = qkv[:, :, hq + hk :].clone()
        out = apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=2, num_heads_q=hq)
        q, k, v = out[:, :, :hq], out[:, :, hq : hq + hk], out[:, :, hq + hk :]
    assert out.data_ptr() == qkv.data_ptr()
    close(q, q_ref), close(k, k_ref)
    assert torch.equal(v, v_ref)
    kv = randn(b, s, 2, 2, d, dtype=torch.float32)
    k_ref, v_ref = rotary_ref(kv[:, :, 0], cos, sin, False, 0), kv[:, :, 1].clone()
    apply_rotary_emb_kv_(kv, cos, sin)
    close(kv[:, :, 0], k_ref)
    assert torch.equal(kv[:, :, 1], v_ref)


def test_qkv_in_place_backward():
    qkv = randn(1, SEQ, 3, 2, 32, dtype=torch.float32, requires_grad=True)
    cos, sin = cos_sin(SEQ, 32, torch.float32)
    out = apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    close(dqkv[:, :, 0], rotary_ref(g[:, :, 0], cos, sin, False, conjugate=True))
    close(dqkv[:, :, 1], rotary_ref(g[:, :, 1], cos, sin, False, conjugate=True))
    assert torch.equal(dqkv[:, :, 2], g[:, :, 2])


def test_rotary_embedding_module():
    rope = RotaryEmbedding(32, base=10000.0, interleaved=False, device=DEVICE)
    qkv = randn(2, SEQ, 3, 2, 64, dtype=torch.float32)
    t = torch.arange(SEQ + 4, device=DEVICE, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device=DEVICE, dtype=torch.float32) / 32)))
    q_ref = rotary_ref(qkv[:, :, 0], freqs.cos(), freqs.sin(), False, 4)
    out = rope(qkv.clone(), seqlen_offset=4)
    close(out[:, :, 0], q_ref)
    q, kv = randn(2, SEQ, 2, 64, dtype=torch.float32), randn(2, SEQ, 2, 2, 64, dtype=torch.float32)
    q_ref = rotary_ref(q, freqs.cos(), freqs.sin(), False, 4)
    q2, kv2 = rope(q.clone(), kv.clone(), seqlen_offset=4)
    close(q2, q_ref)


def test_bad_arguments():
    x = randn(1, 8, 2, 32, dtype=torch.float16)
    cos, sin = cos_sin(8, 32, torch.float16)
    with pytest.raises(ValueError, match="rotary_dim 64"):
        apply_rotary_emb(x, *cos_sin(8, 64, torch.float16))
    with pytest.raises(TypeError, match="dtype"):
        apply_rotary_emb(x, cos.float(), sin.float())
    with pytest.raises(ValueError, match="seqlen 8 exceeds the 6 positions"):
        apply_rotary_emb(x, cos[:6], sin[:6])
    with pytest.raises(ValueError, match="seqlen_offsets must be >= 0"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=-1)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(NotImplementedError, match="XPos"):
        RotaryEmbedding(32, scale_base=512)


def test_rotary_embedding_positional_order():
    """flash_attn's order (dim, base, interleaved, scale_base, device): the fifth positional
    argument is the device; pos_idx_in_fp32 (flashattn2's) is keyword-only."""
    rope = RotaryEmbedding(32, 500.0, True, None, "meta")
    assert rope.inv_freq.device.type == "meta" and rope.base == 500.0 and rope.interleaved
    assert rope.pos_idx_in_fp32 is True
    assert RotaryEmbedding(32, device="meta", pos_idx_in_fp32=False).pos_idx_in_fp32 is False
    rope = RotaryEmbedding(32, 500.0, True, None, DEVICE)
    q, kv = randn(2, SEQ, 2, 64, dtype=torch.float32), randn(2, SEQ, 2, 2, 64, dtype=torch.float32)
    freqs = torch.outer(
        torch.arange(SEQ, device=DEVICE, dtype=torch.float32),
        1.0 / (500.0 ** (torch.arange(0, 32, 2, device=DEVICE, dtype=torch.float32) / 32)),
    )
    q2, kv2 = rope(q.clone(), kv.clone())
    close(q2, rotary_ref(q, freqs.cos(), freqs.sin(), True))
    close(kv2[:, :, 0], rotary_ref(kv[:, :, 0], freqs.cos(), freqs.sin(), True))


def test_rotary_embedding_recomputes_low_precision_inv_freq():
    """After module.half(), the tables come from inv_freq recomputed in fp32 (as flash_attn)."""
    full, half = RotaryEmbedding(32, device=DEVICE), RotaryEmbedding(32, device=DEVICE).half()
    assert half.inv_freq.dtype == torch.float16
    full._update_cos_sin_cache(64, device=torch.device(DEVICE), dtype=torch.float32)
    half._update_cos_sin_cache(64, device=torch.device(DEVICE), dtype=torch.float32)
    assert torch.equal(full._cos_cached, half._cos_cached) and torch.equal(full._sin_cached, half._sin_cached)


def test_rotate_half():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]))
    assert torch.equal(rotate_half(x, interleaved=True), torch.tensor([-2.0, 1.0, -4.0, 3.0, -6.0, 5.0]))
    x2 = x.expand(3, 2, 6)
    assert torch.equal(rotate_half(x2, True), rotate_half(x, True).expand(3, 2, 6))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim,headdim", [(32, 32), (16, 40)])
def test_apply_rotary_emb_torch(interleaved, rotary_dim, headdim):
    """The PyTorch reference against the kernel: cos/sin (seqlen, rotary_dim / 2), and
    per-sequence tables (batch, seqlen, rotary_dim / 2) against a (batch,) seqlen_offsets."""
    x = randn(3, SEQ, 2, headdim, dtype=torch.float32)
    cos, sin = cos_sin(SEQ + 9, rotary_dim, torch.float32)
    out = apply_rotary_emb_torch(x, cos[:SEQ], sin[:SEQ], interleaved)
    close(out, apply_rotary_emb(x, cos, sin, interleaved))
    close(out, rotary_ref(x, cos, sin, interleaved))
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    offsets = torch.tensor([0, 4, 9], device=DEVICE, dtype=torch.int32)
    rows = offsets[:, None].long() + torch.arange(SEQ, device=DEVICE)[None, :]
    out = apply_rotary_emb_torch(x, cos[rows], sin[rows], interleaved=interleaved)
    close(out, apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets))
    assert apply_rotary_emb_func is apply_rotary_emb
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb_torch(x, *cos_sin(SEQ, 2 * headdim, torch.float32))


def test_autograd_functions_called_directly():
    """ApplyRotaryEmb / ApplyRotaryEmbQKV_ / ApplyRotaryEmbKV_.apply with flash_attn's positional
    arguments and defaults, gradients included."""
    cos, sin = cos_sin(SEQ, 32, torch.float32)
    x = randn(2, SEQ, 2, 48, dtype=torch.float32, requires_grad=True)
    out = ApplyRotaryEmb.apply(x, cos, sin)
    close(out, rotary_ref(x.detach(), cos, sin))
    g = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, g)
    close(dx, rotary_ref(g, cos, sin, conjugate=True))
    qkv = randn(2, SEQ, 3, 2, 48, dtype=torch.float32, requires_grad=True)
    cos_k, sin_k = cos_sin(SEQ, 32, torch.float32)
    out = ApplyRotaryEmbQKV_.apply(qkv.clone(), cos, sin, cos_k * 0.5, sin_k * 0.5, True)
    close(out[:, :, 0], rotary_ref(qkv[:, :, 0].detach(), cos, sin, True))
    close(out[:, :, 1], rotary_ref(qkv[:, :, 1].detach(), cos_k * 0.5, sin_k * 0.5, True))
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    close(dqkv[:, :, 1], rotary_ref(g[:, :, 1], cos_k * 0.5, sin_k * 0.5, True, conjugate=True))
    assert torch.equal(dqkv[:, :, 2], g[:, :, 2])
    kv = randn(2, SEQ, 2, 2, 48, dtype=torch.float32)
    k_ref = rotary_ref(kv[:, :, 0], cos, sin, False, 3)
    assert ApplyRotaryEmbKV_.apply(kv, cos, sin, False, 3) is kv
    close(kv[:, :, 0], k_ref)
