"""The path real servers take: Hugging Face transformers' generate() with a static KV cache, its forward compiled
(fullgraph, so a graph break fails the run; "reduce-overhead": replayed as CUDA graphs), tokens per second with
attn_implementation="flashattn2" beside "sdpa", in one run.

A Llama-style model of ~1.2B parameters built from its config (random bf16 weights; nothing to download): Llama
3.2 1B's shape, GQA 32/8 at head dim 64. A run times `repeats` calls of generate() for `new_tokens` tokens after a
prompt of `prompt` tokens per sequence (the prefill included), after one warm-up call that compiles and captures.
Before timing, the last prompt position's logits of each attention are checked against flashattn2's (bf16: within
5% of their largest value; a mismatch is written in the row's note).
"""

from __future__ import annotations

import time

import torch

from .kernels import run_metadata
from .results import appending

MODELS = {
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
ATTENTIONS = ("flashattn2", "sdpa")
FIELDS = [
    "model",
    "attention",
    "batch",
    "prompt",
    "new_tokens",
    "compiled",
    "ms",
    "tokens_per_s",
    "note",
    "gpu",
    "torch",
    "triton",
    "transformers",
    "date",
    "git_sha",
]


def _model(dims: dict, attention: str, device):
    import transformers

    import flashattn2.integrations.transformers  # noqa: F401  (registers "flashattn2")

    config = transformers.LlamaConfig(**dims)
    torch.manual_seed(0)  # the same weights for every attention
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation(attention)
    return model


def measure(dims, attention, batch, prompt, new_tokens, compiled, device="cuda", repeats=3):
    """(ms per generate() call, tokens per second, the last prompt position's logits) of one attention."""
    from transformers import CompileConfig

    model = _model(dims, attention, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, dims["vocab_size"], (batch, prompt), generator=gen).to(device)
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float().cpu()
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    if compiled:
        kw["compile_config"] = CompileConfig(fullgraph=True)
    else:
        kw["disable_compile"] = True
    model.generate(ids, **kw)  # compiles and captures
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        model.generate(ids, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / repeats
    return ms, batch * new_tokens / (ms * 1e-3), logits


def run(
    out_csv,
    models=("llama-1b",),
    batches=(1, 16),
    prompt=512,
    new_tokens=256,
    attentions=ATTENTIONS,
    compiled=True,
    device="cuda",
    dims=None,
    repeats=3,
    progress=print,
):
    """Appends one row per (model, batch, attention) to out_csv; flashattn2 runs first (its logits are the
    reference). dims: a config's sizes in place of MODELS' (the CPU test's tiny model)."""
    import transformers

    meta = dict(run_metadata(None if device == "cuda" else device), transformers=transformers.__version__)
    attentions = ["flashattn2"] + [a for a in attentions if a != "flashattn2"]
    with appending(out_csv, FIELDS) as (writer, fh):
        for name in models:
            for batch in batches:
                ref = None
                for attention in attentions:
                    row = dict(
                        model=name,
                        attention=attention,
                        batch=batch,
                        prompt=prompt,
                        new_tokens=new_tokens,
                        compiled=int(compiled),
                        **meta,
                    )
                    try:
                        ms, rate, logits = measure(
                            dims or MODELS[name], attention, batch, prompt, new_tokens, compiled, device, repeats
                        )
                    except torch.OutOfMemoryError:
                        row.update(note="out of memory", ms="nan", tokens_per_s="nan")
                    else:
                        ref = logits if ref is None else ref
                        err = float((logits - ref).abs().max() / ref.abs().max())
                        note = f"logits differ from flashattn2's by {err:.2g} (relative)" if err > 0.05 else ""
                        row.update(ms=f"{ms:.2f}", tokens_per_s=f"{rate:.1f}", note=note)
                    finally:
                        if device == "cuda":
                            torch.cuda.empty_cache()
                    writer.writerow(row)
                    fh.flush()
                    progress(f"{name} batch {batch} {attention}: {row['tokens_per_s']} tokens/s {row['note']}")


__all__ = ["ATTENTIONS", "FIELDS", "MODELS", "measure", "run"]
