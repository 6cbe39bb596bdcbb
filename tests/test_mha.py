"""flashattn2.modules.mha: MHA on the kernels against the same module in plain PyTorch (fp32 the
oracle, fp16 the yardstick of the tolerance rule), varlen and padded input, KV-cache decoding
against the full forward, and the errors."""

import copy

import pytest
import torch

from cases import randn
from conftest import DEVICE, ON_GPU
from flashattn2.bert_padding import unpad_input
from flashattn2.modules.mha import MHA, FlashCrossAttention, FlashSelfAttention, get_alibi_slopes
from flashattn2.reference.attention import attention_ref
from flashattn2.reference.tolerance import BWD_FACTOR, FWD_FACTOR
from flashattn2.utils.generation import InferenceParams
from tolerance import assert_close

EMBED, HEADS = (1024, 8) if ON_GPU else (128, 4)
SEQLEN = 300 if ON_GPU else 37
DTYPE = torch.float16


def three_modules(**kwargs):
    """(ours: kernels in fp16, ref: PyTorch in fp32, low: PyTorch in fp16), same weights."""
    ref = MHA(EMBED, HEADS, use_flash_attn=False, device=DEVICE, dtype=torch.float32, **kwargs)
    ours = MHA(EMBED, HEADS, use_flash_attn=True, device=DEVICE, dtype=DTYPE, **kwargs)
    ours.load_state_dict(ref.state_dict())
    low = copy.deepcopy(ref).to(DTYPE)
    return ours, ref, low


def run(module, x, *args, **kwargs):
    x = x.detach().to(module.out_proj.weight.dtype).requires_grad_()
    out = module(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out) / out.shape[-1])
    return out, grad


CONFIGS = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(num_heads_kv=2), id="gqa"),
    pytest.param(dict(num_heads_kv=1, causal=True, rotary_emb_dim=16), id="mqa-causal-rotary"),
    pytest.param(dict(causal=True, rotary_emb_dim=8, rotary_emb_interleaved=True), id="causal-rotary-gptj"),
    pytest.param(dict(cross_attn=True, num_heads_kv=2), id="cross-gqa"),
    pytest.param(dict(causal=True, checkpointing=True), id="causal-checkpointing"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_mha_matches_pytorch(config):
    ours, ref, low = three_modules(**config)
    x = randn(2, SEQLEN, EMBED, dtype=torch.float32)
    extra = {}
    if config.get("cross_attn"):
        extra["x_kv"] = randn(2, SEQLEN + 11, EMBED, dtype=torch.float32)
    outs = [run(m, x, **{k: v.to(m.out_proj.weight.dtype) for k, v in extra.items()}) for m in (ours, ref, low)]
    (out, grad), (ref_out, ref_grad), (low_out, low_grad) = outs
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    assert_close("dx", grad, ref_grad, low_grad, BWD_FACTOR)


@pytest.mark.parametrize("window", [(-1, -1), (9, 0)], ids=["alibi", "alibi-window"])
def test_mha_alibi_and_window(window):
    """ALiBi and the local window exist only on the kernel path: the oracle is the projections
    around the reference attention."""
    mha = MHA(
        EMBED,
        HEADS,
        num_heads_kv=2,
        causal=True,
        use_alibi=True,
        window_size=window,
        use_flash_attn=True,
        device=DEVICE,
        dtype=DTYPE,
    )
    x = randn(2, SEQLEN, EMBED, dtype=DTYPE)
    out = mha(x)
    slopes = torch.tensor(get_alibi_slopes(HEADS), device=DEVICE)

    def manual(dtype, upcast):
        w = {k: v.to(dtype) for k, v in mha.state_dict().items()}
        qkv = torch.nn.functional.linear(x.to(dtype), w["Wqkv.weight"], w["Wqkv.bias"])
        d = EMBED // HEADS
        q, k, v = qkv.split([EMBED, 2 * d, 2 * d], dim=-1)
        q, k, v = q.unflatten(-1, (HEADS, d)), k.unflatten(-1, (2, d)), v.unflatten(-1, (2, d))
        o, _ = attention_ref(q, k, v, causal=True, window_size=window, alibi_slopes=slopes, upcast=upcast)
        return torch.nn.functional.linear(o.to(dtype).flatten(-2), w["out_proj.weight"], w["out_proj.bias"])

    assert_close("out", out, manual(torch.float32, True), manual(DTYPE, False), FWD_FACTOR)


def test_mha_varlen_and_padding():
    """cu_seqlens input, and key_padding_mask on both paths, against each sequence alone."""
    ours, ref, low = three_modules(causal=True, num_heads_kv=2)
    lengths = [SEQLEN, SEQLEN // 3, SEQLEN - 5]
    x = randn(len(lengths), SEQLEN, EMBED, dtype=torch.float32)
    mask = torch.arange(SEQLEN, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    varlen = ours(x_unpad.to(DTYPE), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    padded = ours(x.to(DTYPE), key_padding_mask=mask)
    ref_padded = ref(x, key_padding_mask=mask)
    low_padded = low(x.to(DTYPE), key_padding_mask=mask)
    bias = ours.out_proj.bias.expand_as(padded[~mask])  # padded queries attend to nothing
    assert torch.equal(padded[~mask], bias)
    assert_close("padded", padded[mask], ref_padded[mask], low_padded[mask], FWD_FACTOR)
    assert_close("varlen", varlen, ref_padded[mask], low_padded[mask], FWD_FACTOR)
    for i, n in enumerate(lengths):  # one sequence alone, no padding
        alone = ref(x[i : i + 1, :n])[0]
        assert_close(
            f"seq{i}", varlen[cu_seqlens[i] : cu_seqlens[i + 1]], alone, low(x[i : i + 1, :n].to(DTYPE))[0], FWD_FACTOR
        )


@pytest.mark.parametrize("use_flash_attn", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(num_heads_kv=2, rotary_emb_dim=16), id="gqa-rotary-fused"),
        pytest.param(dict(rotary_emb_dim=8, rotary_emb_interleaved=True), id="rotary-gptj-apart"),
        pytest.param(dict(num_heads_kv=1), id="mqa"),
    ],
)
def test_mha_generation_matches_full_forward(config, use_flash_attn):
    """Prefill, then one token at a time through inference_params: the outputs of every step equal
    the full causal forward over the whole sequence (rotary in the KV-cache kernel when its dim is
    a multiple of 16, applied apart otherwise)."""
    ours, ref, low = three_modules(causal=True, layer_idx=3, **config)
    if not use_flash_attn:
        ours = MHA(EMBED, HEADS, causal=True, layer_idx=3, use_flash_attn=False, device=DEVICE, dtype=DTYPE, **config)
        ours.load_state_dict(ref.state_dict())
    batch, prompt, total = 2, SEQLEN // 2, SEQLEN // 2 + 6
    x = randn(batch, total, EMBED, dtype=torch.float32)
    params = InferenceParams(max_seqlen=total + 3, max_batch_size=batch + 1)
    with torch.no_grad():
        steps = [ours(x[:, :prompt].to(DTYPE), inference_params=params)]
        for t in range(prompt, total):
            params.seqlen_offset = t
            steps.append(ours(x[:, t : t + 1].to(DTYPE), inference_params=params))
        full_ref, full_low = ref(x), low(x.to(DTYPE))
    assert params.key_value_memory_dict[3].shape == (
        batch + 1,
        total + 3,
        2,
        config.get("num_heads_kv", HEADS),
        EMBED // HEADS,
    )
    assert_close("generated", torch.cat(steps, dim=1), full_ref, full_low, FWD_FACTOR)


def test_flash_attention_modules_varlen():
    """FlashSelfAttention on packed qkv and FlashCrossAttention (cu_seqlens_k defaulting to
    cu_seqlens) agree with each other and with the reference on one sequence."""
    d, h = EMBED // HEADS, HEADS
    lengths = [SEQLEN, SEQLEN // 2]
    cu = torch.tensor([0, lengths[0], sum(lengths)], device=DEVICE, dtype=torch.int32)
    qkv = randn(sum(lengths), 3, h, d, dtype=DTYPE)
    self_out = FlashSelfAttention(causal=True)(qkv, cu_seqlens=cu, max_seqlen=max(lengths))
    cross_out = FlashCrossAttention(causal=True)(qkv[:, 0], qkv[:, 1:], cu_seqlens=cu, max_seqlen=max(lengths))
    torch.testing.assert_close(self_out, cross_out, rtol=0, atol=0)
    q, k, v = (t[: lengths[0]].unsqueeze(0) for t in qkv.unbind(1))
    ref, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close("out", self_out[: lengths[0]].unsqueeze(0), ref, low, FWD_FACTOR)


def test_mha_return_residual_and_slopes():
    mha = MHA(EMBED, HEADS, return_residual=True, use_flash_attn=True, device=DEVICE, dtype=DTYPE)
    x = randn(1, 5, EMBED, dtype=DTYPE)
    out, residual = mha(x)
    assert residual is x and out.shape == x.shape
    assert get_alibi_slopes(8) == [2 ** -(i + 1) for i in range(8)]
    assert len(get_alibi_slopes(12)) == 12 and get_alibi_slopes(12)[:8] == get_alibi_slopes(8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_heads_kv=3), ValueError, "multiple of num_heads_kv"),
        (dict(rotary_emb_dim=EMBED // HEADS + 2), ValueError, "rotary_emb_dim"),
        (dict(rotary_emb_dim=7), ValueError, "rotary_emb_dim"),
        (dict(dwconv=True), NotImplementedError, "dwconv"),
        (dict(use_alibi=True, use_flash_attn=False), ValueError, "use_flash_attn"),
        (dict(rotary_emb_scale_base=512.0, rotary_emb_dim=8), NotImplementedError, "XPos"),
    ],
)
def test_mha_bad_configurations(kwargs, error, match):
    with pytest.raises(error, match=match):
        MHA(EMBED, HEADS, **kwargs)


def test_mha_bad_calls():
    mha = MHA(EMBED, HEADS, use_flash_attn=False, causal=True, device=DEVICE, dtype=DTYPE)
    x = randn(2, 6, EMBED, dtype=DTYPE)
    cu = torch.tensor([0, 6, 12], device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="use_flash_attn"):
        mha(x.flatten(0, 1), cu_seqlens=cu, max_seqlen=6)
    with pytest.raises(ValueError, match="layer_idx"):
        mha(x, inference_params=InferenceParams(max_seqlen=8, max_batch_size=2))
    with pytest.raises(ValueError, match="cross_attn"):
        mha(x, x_kv=x)
    flash = MHA(EMBED, HEADS, use_flash_attn=True, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        flash(x, key_padding_mask=torch.ones(2, 6, device=DEVICE))


def test_flash_cross_attention_positional_order():
    """FlashCrossAttention's positional order is flash_attn's (causal, softmax_scale,
    attention_dropout, alibi_slopes, window_size, deterministic), unlike FlashSelfAttention's
    (window_size before alibi_slopes): a positional call puts the slopes into alibi_slopes."""
    d, h = 32, HEADS
    q, k, v = (randn(2, 19, h, d, dtype=DTYPE) for _ in range(3))
    kv = torch.stack((k, v), dim=2)
    slopes = torch.tensor(get_alibi_slopes(h), device=DEVICE)
    positional = FlashCrossAttention(True, None, 0.0, slopes)
    assert positional.alibi_slopes is slopes and positional.window_size == (-1, -1)
    out = positional(q, kv)
    torch.testing.assert_close(out, FlashCrossAttention(causal=True, alibi_slopes=slopes)(q, kv), rtol=0, atol=0)
    ref, _ = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)
    low, _ = attention_ref(q, k, v, causal=True, alibi_slopes=slopes, upcast=False)
    assert_close("alibi", out, ref, low, FWD_FACTOR)
    no_alibi, _ = attention_ref(q, k, v, causal=True)
    assert (out.float() - no_alibi.float()).abs().max() > 10 * (ref.float() - low.float()).abs().max()
    # the fifth slot is the window, the sixth deterministic
    windowed = FlashCrossAttention(False, None, 0.0, None, (3, 0), True)
    assert windowed.alibi_slopes is None and windowed.window_size == (3, 0) and windowed.deterministic
    ref, _ = attention_ref(q, k, v, window_size=(3, 0))
    low, _ = attention_ref(q, k, v, window_size=(3, 0), upcast=False)
    assert_close("window", windowed(q, kv), ref, low, FWD_FACTOR)
    # FlashSelfAttention keeps flash_attn's own order: window_size, then alibi_slopes
    self_attn = FlashSelfAttention(True, None, 0.0, (-1, -1), slopes)
    assert self_attn.alibi_slopes is slopes and self_attn.window_size == (-1, -1)
    torch.testing.assert_close(self_attn(torch.stack((q, k, v), dim=2)), out, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [FlashSelfAttention, FlashCrossAttention])
def test_flash_attention_modules_argument_types(cls):
    """Slopes in the window's slot (the other module's order), or a window in the slopes' slot,
    are caught at construction instead of failing at the first forward."""
    slopes = torch.tensor(get_alibi_slopes(HEADS), device=DEVICE)
    with pytest.raises(TypeError, match="window_size"):
        cls(window_size=slopes)
    with pytest.raises(TypeError, match="alibi_slopes"):
        cls(alibi_slopes=(-1, -1))


def test_mha_cross_attn_return_residual_is_x():
    """As flash_attn: with return_residual the residual is the input x, also with x_kv and
    mixer_subset."""
    mha = MHA(EMBED, HEADS, cross_attn=True, return_residual=True, use_flash_attn=True, device=DEVICE, dtype=DTYPE)
    x, x_kv = randn(2, 7, EMBED, dtype=DTYPE), randn(2, 9, EMBED, dtype=DTYPE)
    for kwargs in (dict(), dict(x_kv=x_kv), dict(x_kv=x_kv, mixer_subset=slice(0, 1))):
        out, residual = mha(x, **kwargs)
        assert residual is x
    assert out.shape == (2, 1, EMBED)


def test_mha_learnable_sink():
    """MHA(learnable_sink=True): an fp32 parameter per head that reaches the kernels in training (its gradient
    that of the reference attention with the sink), with padding, and in decoding (the steps equal the full
    forward)."""
    torch.manual_seed(0)
    mha = MHA(EMBED, HEADS, num_heads_kv=2, causal=True, layer_idx=0, use_flash_attn=True, learnable_sink=True,
              device=DEVICE, dtype=torch.float32)  # fmt: skip
    assert mha.learnable_sink.dtype == torch.float32 and mha.learnable_sink.shape == (HEADS,)
    with torch.no_grad():
        mha.learnable_sink.copy_(torch.randn(HEADS) * 2)
    x = randn(2, SEQLEN, EMBED, dtype=torch.float32)
    out = mha(x)
    (dsink,) = torch.autograd.grad(out.square().sum(), (mha.learnable_sink,))
    # the same layer by hand: its projections, the reference attention with the sink, its output projection
    q, kv = mha._project(x, None, None, None)
    context, _ = attention_ref(q, kv[:, :, 0], kv[:, :, 1], causal=True, learnable_sink=mha.learnable_sink)
    ref = mha.out_proj(context.float().flatten(-2))
    (ref_dsink,) = torch.autograd.grad(ref.square().sum(), (mha.learnable_sink,))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dsink, ref_dsink, rtol=1e-3, atol=1e-3)
    # padding: the kept tokens' rows as the call without the padded tail
    mask = torch.ones(2, SEQLEN, dtype=torch.bool, device=DEVICE)
    mask[1, SEQLEN // 2 :] = False
    padded = mha(x, key_padding_mask=mask)
    torch.testing.assert_close(padded[1, : SEQLEN // 2], mha(x[1:, : SEQLEN // 2])[0], rtol=1e-4, atol=1e-4)
    # decoding through inference_params against the full causal forward
    params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=2)
    prompt = SEQLEN - 4
    with torch.no_grad():
        steps = [mha(x[:, :prompt], inference_params=params)]
        for t in range(prompt, SEQLEN):
            params.seqlen_offset = t
            steps.append(mha(x[:, t : t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(steps, dim=1), out.detach(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="learnable_sink need use_flash_attn=True"):
        MHA(EMBED, HEADS, learnable_sink=True, device=DEVICE)
