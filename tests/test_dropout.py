"""Dropout: Philox mask from torch's generator, replayed in the backward, visible through S_dmask."""

import pytest
import torch

import flashattn2
from cases import make_qkv
from conftest import DEVICE, ON_GPU
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

SHAPES = (
    [(2, 1000, 1200, 8, 2, 64), (1, 777, 500, 4, 4, 128)] if ON_GPU else [(2, 97, 131, 4, 2, 64), (1, 77, 50, 2, 2, 40)]
)
OPTIONS = [
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window_size=(20, -1), alibi="h"), id="causal-window-alibi"),
]


def resolve(opts, nheads):
    opts = dict(opts)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(nheads, device=DEVICE) * 0.5
    return opts


def mask_from(s_dmask, seqlen_q, seqlen_k):
    """The kept entries, recovered from S_dmask's signs (its valid region)."""
    return s_dmask[:, :, :seqlen_q, :seqlen_k] >= 0


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*s))
def test_dropout_matches_reference_with_recovered_mask(shape, opts):
    p = 0.17
    q, k, v = make_qkv(shape, torch.float16)
    opts = resolve(opts, shape[3])
    out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **opts)
    round128 = lambda n: -(-n // 128) * 128
    assert s_dmask.shape == (shape[0], shape[3], round128(shape[1]), round128(shape[2]))
    assert torch.all(s_dmask[:, :, shape[1] :] == 0) and torch.all(s_dmask[:, :, :, shape[2] :] == 0)
    keep = mask_from(s_dmask, shape[1], shape[2])
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_out, ref_lse = attention_ref(q, k, v, dropout_mask=keep, dropout_p=p, **opts)
    low_out, _ = attention_ref(q, k, v, upcast=False, dropout_mask=keep, dropout_p=p, **opts)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo, BWD_FACTOR)
    # |S_dmask| = exp(score - rowmax) on visible entries: P * exp(lse - rowmax)
    probs = torch.softmax(attention_scores(q, k, **opts), dim=-1)
    rowmax_shift = torch.exp(ref_lse - attention_scores(q, k, **opts).amax(-1))[..., None]
    visible = torch.isfinite(attention_scores(q, k, **opts))
    magnitude = s_dmask[:, :, : shape[1], : shape[2]].abs().float()
    expected = (probs * rowmax_shift).masked_fill(~visible, 0).float()
    assert (magnitude - expected).abs().max() < 2e-2


def attention_scores(q, k, causal=False, window_size=(-1, -1), alibi_slopes=None, softcap=0.0):
    """Scaled scores (batch, nheads, seqlen_q, seqlen_k) in fp32 with the mask as -inf."""
    from flashattn2.reference.attention import local_mask

    qf, kf = q.float(), k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf * q.shape[-1] ** -0.5, kf)
    sq, sk = q.shape[1], k.shape[1]
    if alibi_slopes is not None:
        dist = (torch.arange(sq, device=q.device)[:, None] + sk - sq - torch.arange(sk, device=q.device)[None]).abs()
        s = s - alibi_slopes.reshape(-1, q.shape[2])[:, :, None, None] * dist
    if causal or window_size != (-1, -1):
        s = s.masked_fill(~local_mask(sq, sk, window_size, causal, q.device), float("-inf"))
    return s


def test_kept_fraction():
    p = 0.3
    q, k, v = make_qkv((2, 256, 256, 4, 4, 32), torch.float16, requires_grad=False)
    _, _, s_dmask = flashattn2.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    kept = (s_dmask[:, :, :256, :256] > 0).float().mean().item()
    assert abs(kept - (1 - p)) < 0.01, kept


def test_same_seed_same_bits_other_seed_other_mask():
    q, k, v = make_qkv((1, 90, 90, 2, 2, 32), torch.bfloat16)
    do = torch.randn(1, 90, 2, 32, device=DEVICE, dtype=torch.bfloat16)

    def run(seed):
        torch.manual_seed(seed)
        out = flashattn2.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    first, again, other = run(7), run(7), run(8)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


def test_varlen_dropout():
    lengths = [40, 0, 77]
    cu = torch.tensor([0, 40, 40, 117], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(117, h, 32, device=DEVICE, dtype=torch.float16, requires_grad=True) for h in (4, 2, 2))
    out, lse, s_dmask = flashattn2.flash_attn_varlen_func(
        q, k, v, cu, cu, 77, 77, dropout_p=0.2, causal=True, return_attn_probs=True
    )
    assert s_dmask.shape == (3, 4, 128, 128)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(cu[b], cu[b + 1])
        qb, kb, vb = (t.detach()[rows][None].requires_grad_() for t in (q, k, v))
        keep = mask_from(s_dmask[b : b + 1], n, n)
        ref_out, _ = attention_ref(qb, kb, vb, causal=True, dropout_mask=keep, dropout_p=0.2)
        low_out, _ = attention_ref(qb, kb, vb, causal=True, dropout_mask=keep, dropout_p=0.2, upcast=False)
        assert_close(f"out[{b}]", out[rows][None], ref_out, low_out, FWD_FACTOR)
        ref_grads = torch.autograd.grad(ref_out, (qb, kb, vb), do[rows][None].float())
        low_grads = torch.autograd.grad(low_out, (qb, kb, vb), do[rows][None])
        for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
            assert_close(f"{name}[{b}]", g[rows][None], r, lo, BWD_FACTOR)
