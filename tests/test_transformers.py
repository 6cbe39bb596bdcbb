"""Hugging Face transformers with attn_implementation="flashattn2": a tiny random Llama (MHA and
GQA) built from a config, no download. Logits and gradients against the same model on "sdpa"
(fp32 the oracle, fp16 the yardstick), greedy generate() token for token, from_pretrained, packed
sequences."""

import pytest
import torch

from conftest import DEVICE, ON_GPU
from flashattn2.ops.launch import launcher
from flashattn2.reference.tolerance import BWD_FACTOR, FWD_FACTOR
from tolerance import assert_close

transformers = pytest.importorskip("transformers")
integration = pytest.importorskip("flashattn2.integrations.transformers")

HIDDEN, HEADS, SEQLEN = (256, 4, 200) if ON_GPU else (64, 4, 13)
VOCAB = 97
KV_HEADS = [pytest.param(HEADS, id="mha"), pytest.param(2, id="gqa")]


def tiny_llama(kv_heads, dtype, attn):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4 * SEQLEN,
    )
    torch.manual_seed(1234)  # the same weights for every copy
    model = transformers.LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype)
    model.set_attn_implementation(attn)
    return model


def padded_batch():
    ids = torch.randint(0, VOCAB, (2, SEQLEN), device=DEVICE)
    mask = torch.ones(2, SEQLEN, dtype=torch.long, device=DEVICE)
    mask[1, : SEQLEN // 3] = 0  # left padding, as generate() wants
    return ids, mask


def logits_and_grads(model, ids, mask, weights):
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    (logits.float()[keep] * weights).sum().backward()
    grads = {
        name: p.grad for name, p in model.named_parameters() if "layers.0.self_attn" in name or "embed_tokens" in name
    }
    return logits[keep], grads


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_logits_and_gradients_match_sdpa(kv_heads):
    ids, mask = padded_batch()
    weights = torch.randn(int(mask.sum()), VOCAB, device=DEVICE) / VOCAB
    launched = []
    with launcher.watched(lambda kernel, grid, args, kwargs: launched.append(kernel.__name__)):
        ours = logits_and_grads(tiny_llama(kv_heads, torch.float16, "flashattn2"), ids, mask, weights)
    assert "attn_fwd_kernel" in launched and "attn_bwd_dkdv_kernel" in launched  # the kernels ran
    ref = logits_and_grads(tiny_llama(kv_heads, torch.float32, "sdpa"), ids, mask, weights)
    low = logits_and_grads(tiny_llama(kv_heads, torch.float16, "sdpa"), ids, mask, weights)
    assert_close("logits", ours[0], ref[0], low[0], FWD_FACTOR)
    for name in ref[1]:
        assert_close(name, ours[1][name], ref[1][name], low[1][name], BWD_FACTOR)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_greedy_generate_matches_sdpa(kv_heads, cache):
    """fp32 (the kernels' full-precision path): the same tokens as SDPA, left-padded batch; a
    static cache's keys run past the padding mask (empty slots)."""
    ids, mask = padded_batch()
    tokens = []
    for attn in ("flashattn2", "sdpa"):
        model = tiny_llama(kv_heads, torch.float32, attn).eval()
        tokens.append(
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
                cache_implementation=cache,
                disable_compile=True,
            )[:, SEQLEN:]
        )
    assert torch.equal(tokens[0], tokens[1]), tokens


def test_from_pretrained_and_packed_sequences(tmp_path):
    """from_pretrained(attn_implementation="flashattn2") loads a saved model onto the kernels;
    two sequences packed in one row (position ids restart, no mask) attend within their own."""
    tiny_llama(2, torch.float32, "sdpa").save_pretrained(tmp_path)
    model = (
        transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="flashattn2", dtype=torch.float32)
        .to(DEVICE)
        .eval()
    )
    assert model.config._attn_implementation == "flashattn2"
    ref = tiny_llama(2, torch.float32, "sdpa").eval()
    a, b = SEQLEN, SEQLEN // 2 + 1
    ids = torch.randint(0, VOCAB, (1, a + b), device=DEVICE)
    position_ids = torch.cat([torch.arange(a), torch.arange(b)]).to(DEVICE)[None]
    cu = torch.tensor([0, a, a + b], device=DEVICE, dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits[0]
        # a padding-free collator's explicit boundaries (transformers' DataCollatorWithFlattening)
        collated = model(
            ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=a, max_length_k=a
        ).logits[0]
        apart = torch.cat([ref(ids[:, :a]).logits[0], ref(ids[:, a:]).logits[0]])
    torch.testing.assert_close(packed, apart, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(collated, apart, rtol=1e-4, atol=1e-4)


def test_attention_function_errors():
    q = torch.randn(1, 2, 5, 16, device=DEVICE, dtype=torch.float16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="2-D padding mask"):
        integration.attention_forward(module, q, q, q, torch.ones(1, 1, 5, 5, device=DEVICE, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        integration.attention_forward(module, q, q, q, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="head_mask"):
        integration.attention_forward(module, q, q, q, None, head_mask=torch.zeros(2, device=DEVICE))


def _masked_attention(q, k, v, mask):
    """fp64 attention of one query per sequence over the keys mask keeps: q (batch, heads, 1, d), k and v (batch, kv
    heads, keys, d) -> (batch, 1, heads, d)."""
    rows = []
    for b in range(q.shape[0]):
        keep = mask[b].bool()
        ks, vs = (t[b][:, keep].double().repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (k, v))
        p = torch.softmax(q[b].double() @ ks.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
        rows.append((p @ vs).transpose(0, 1))
    return torch.stack(rows)


def test_decode_step_over_padding_masks(monkeypatch):
    """A decoding query over a padding mask, three layers of one step: a left-padded mask (generate()'s) reads the
    cache in place (flash_attn_with_kvcache from each sequence's padding on, no gather of K and V), the padding found
    once for the mask, not per layer; a mask with a hole takes the varlen path, its rows found once too; a mask
    changed in place is looked at again. Each equals the attention over the kept keys."""
    batch, keys, d = 3, 19, 16
    q = torch.randn(batch, HEADS, 1, d, device=DEVICE)
    k, v = (torch.randn(batch, 2, keys, d, device=DEVICE) for _ in range(2))
    left = torch.ones(batch, keys, dtype=torch.long, device=DEVICE)
    left[0, :5] = 0
    left[2, :11] = 0
    holed = left.clone()
    holed[1, 7] = 0
    module = torch.nn.Module()
    seen = []
    for name in ("flash_attn_with_kvcache", "flash_attn_varlen_func", "_left_pads", "_rows"):
        fn = getattr(integration, name)
        monkeypatch.setattr(integration, name, lambda *a, _fn=fn, _name=name, **kw: seen.append(_name) or _fn(*a, **kw))
    for mask, path in ((left, "flash_attn_with_kvcache"), (holed, "flash_attn_varlen_func")):
        seen.clear()
        for _ in range(3):
            out, _ = integration.attention_forward(module, q, k, v, mask)
            torch.testing.assert_close(out.double(), _masked_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)
        found = ["_left_pads"] + (["_rows"] if path == "flash_attn_varlen_func" else [])
        assert seen == found + [path] * 3, seen
    holed[1, 7] = 1  # in place: the same tensor, a new version, left padding now
    seen.clear()
    out, _ = integration.attention_forward(module, q, k, v, holed)
    assert seen == ["_left_pads", "flash_attn_with_kvcache"], seen
    torch.testing.assert_close(out.double(), _masked_attention(q, k, v, holed), rtol=1e-4, atol=1e-4)


def tiny_gpt_oss(attn):
    """gpt-oss from a config: attention sinks (s_aux), sliding-window layers alternating with full ones, GQA; the
    sinks drawn large enough to matter (the config's initialization leaves them near 0)."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4 * SEQLEN,
    )
    torch.manual_seed(1234)
    model = transformers.GptOssForCausalLM(config).to(DEVICE)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(HEADS) * 2)
    model.set_attn_implementation(attn)
    return model


def tiny_deepseek_v3(attn):
    """DeepSeek-V3 from a config: MLA with q/k head dim (nope + rope) 48 and v's 32 (the real model's 192/128 in
    miniature), q through a LoRA, one dense and one MoE layer."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN,
        moe_intermediate_size=HIDDEN // 2,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=4 * SEQLEN,
    )
    torch.manual_seed(1234)
    model = transformers.DeepseekV3ForCausalLM(config).to(DEVICE)
    model.set_attn_implementation(attn)
    return model


def test_deepseek_v3_value_head_dim_matches_eager(monkeypatch):
    """v's head dim (32) differs from q's (48): the kernels take v as it is (transformers passes it unpadded), and
    fp32 logits, gradients and greedy generate() equal the eager implementation's on a left-padded batch."""
    ids, mask = padded_batch()
    keep = mask.bool()
    weights = torch.randn(int(mask.sum()), VOCAB, device=DEVICE) / VOCAB
    widths = []
    real_forward = integration.attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        widths.append((query.shape[-1], value.shape[-1]))
        return real_forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(integration, "attention_forward", spy)
    transformers.AttentionInterface.register("flashattn2", spy)
    try:
        results = []
        for attn in ("flashattn2", "eager"):
            model = tiny_deepseek_v3(attn)
            logits = model(ids, attention_mask=mask).logits
            (logits[keep] * weights).sum().backward()
            grads = [model.model.layers[i].self_attn.kv_b_proj.weight.grad for i in range(2)]
            with torch.no_grad():
                tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            results.append((logits[keep], grads, tokens))
    finally:
        transformers.AttentionInterface.register("flashattn2", real_forward)
    assert widths and set(widths) == {(48, 32)}  # the unpadded value reached the integration
    ours, eager = results
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-4, atol=1e-4)
    for g, e in zip(ours[1], eager[1]):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[2], eager[2])


def test_gpt_oss_sinks_match_eager():
    """s_aux reaches the kernels as learnable_sink: fp32 logits and gradients (the sinks' included) equal the eager
    implementation's on a left-padded batch, and greedy generate() gives the same tokens. (transformers would swap
    a "flash" implementation gpt-oss does not list for one it does: the integration lists flashattn2.)"""
    ids, mask = padded_batch()
    keep = mask.bool()
    weights = torch.randn(int(mask.sum()), VOCAB, device=DEVICE) / VOCAB
    launched = []
    results = []
    for attn in ("flashattn2", "eager"):
        model = tiny_gpt_oss(attn)
        assert model.config._attn_implementation == attn
        with launcher.watched(lambda kernel, grid, args, kwargs: launched.append(kernel.__name__)):
            logits = model(ids, attention_mask=mask).logits
            (logits[keep] * weights).sum().backward()
        sinks = [layer.self_attn.sinks.grad for layer in model.model.layers]
        q_proj = model.model.layers[0].self_attn.q_proj.weight.grad
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        results.append((logits[keep], sinks, q_proj, tokens))
    ours, eager = results
    assert "attn_fwd_kernel" in launched and "attn_bwd_dkdv_kernel" in launched  # flashattn2's kernels ran
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-4, atol=1e-4)
    for g, e in zip(ours[1], eager[1]):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours[2], eager[2], rtol=1e-4, atol=1e-4)
    assert torch.equal(ours[3], eager[3])


@pytest.mark.parametrize(
    "family, options",
    [
        pytest.param("Mistral", dict(sliding_window=6), id="mistral-sliding-window"),
        pytest.param("Gemma2", dict(sliding_window=6, attn_logit_softcapping=5.0), id="gemma2-window-softcap"),
    ],
)
def test_window_and_softcap_models_match_eager(family, options):
    """A sliding window and a logit softcap reach the kernels as window_size and softcap: fp32
    logits equal the eager implementation's on a left-padded batch."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=4 * SEQLEN,
        **options,
    )
    ids, mask = padded_batch()
    logits = []
    for attn in ("flashattn2", "eager"):
        torch.manual_seed(1234)
        model = getattr(transformers, f"{family}ForCausalLM")(config).to(DEVICE).eval()
        model.set_attn_implementation(attn)
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask).logits[mask.bool()])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_static_cache_decode_step_compiles_fullgraph():
    """The graph path servers use: a decode step over transformers' StaticCache compiles with fullgraph=True (no
    graph break; CUDA graphs capture it on the GPU) and gives the eager step's logits."""
    model = tiny_llama(2, torch.float32, "flashattn2").eval()
    ids = torch.randint(0, VOCAB, (2, SEQLEN), device=DEVICE)
    logits = []
    for compiled in (False, True):
        cache = transformers.StaticCache(config=model.config, max_cache_len=2 * SEQLEN)
        with torch.no_grad():
            prompt = model(
                ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(SEQLEN, device=DEVICE)
            )
            token = prompt.logits[:, -1:].argmax(-1)
            step = lambda i, p: model(i, past_key_values=cache, use_cache=True, cache_position=p).logits  # noqa: E731
            if compiled:
                step = torch.compile(step, fullgraph=True, backend="aot_eager" if not ON_GPU else "inductor")
            logits.append(step(token, torch.tensor([SEQLEN], device=DEVICE)))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="SDPA's flash backend runs on CUDA tensors only (torch's CPU kernel on a CPU)")
def test_sdpa_model_runs_flashattn2_kernels():
    """An unmodified attn_implementation="sdpa" model: once flashattn2 is activated, its forward and backward run
    flashattn2's kernels (the profiler's kernel names), not cuDNN's or torch's flash kernels -- torch tries cuDNN first
    on Hopper, so activation has to put the flash backend first -- and after restoring, not flashattn2's."""
    attention = torch.nn.attention
    model = tiny_llama(2, torch.bfloat16, "sdpa")
    ids = torch.randint(0, VOCAB, (2, SEQLEN), device=DEVICE)  # no padding: SDPA gets is_causal, no mask

    def kernels():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.zero_grad()
            model(ids).logits.float().square().mean().backward()
            torch.cuda.synchronize()
        return [e.key for e in prof.key_averages()]

    ours = lambda names, step: [n for n in names if n.startswith(f"attn_{step}")]  # noqa: E731
    theirs = lambda names: [
        n for n in names if any(s in n.lower() for s in ("cudnn", "flash_fwd", "flash_bwd", "fmha"))
    ]  # noqa: E731
    previous = attention.current_flash_attention_impl()
    attention.activate_flash_attention_impl("flashattn2")
    try:
        names = kernels()
    finally:
        attention.restore_flash_attention_impl()
        if previous is not None:
            attention.activate_flash_attention_impl(previous)
    assert ours(names, "fwd") and ours(names, "bwd") and not theirs(names), names
    if previous is None:
        names = kernels()
        assert not ours(names, "fwd") and not ours(names, "bwd") and theirs(names), names
