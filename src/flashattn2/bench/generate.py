"""Hugging Face transformers' generate(), tokens per second with attn_implementation="flashattn2" beside "sdpa", in
one run, two ways: "graph", the path real servers take (a static KV cache, the forward compiled fullgraph, so a graph
break fails the run, and replayed as CUDA graphs), and "eager", the way most scripts call it (the default dynamic
cache, no compiling, a left-padded prompt: the padding mask makes flashattn2's integration unpad the prefill, and
every step's host time is the user's).

A Llama-style model of ~1.2B parameters built from its config (random bf16 weights; nothing to download): Llama
3.2 1B's shape, GQA 32/8 at head dim 64. A run times `repeats` calls of generate() for `new_tokens` tokens after a
prompt of `prompt` tokens per sequence (the prefill included), after one warm-up call (that compiles and captures).
Eager prompts are left-padded: sequence i starts with `prompt // 16 >> (i % 4)` padding tokens (32, 16, 8, 4 at 512).
Before timing, the last prompt position's logits of each attention are checked against flashattn2's (bf16: within
5% of their largest value; a mismatch is written in the row's note).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

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
    "left_pad",
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


@dataclass(frozen=True)
class Grid:
    """What bench generate measures: each model of MODELS, way and batch size, with each attention. The ways:
    compiled[i] (False: eager, True: graph) generating new_tokens[i] tokens."""

    models: Sequence[str] = ("llama-1b",)
    batches: Sequence[int] = (1, 16)
    compiled: Sequence[bool] = (False, True)
    new_tokens: Sequence[int] = (64, 256)
    attentions: Sequence[str] = ATTENTIONS


def _model(dims: dict, attention: str, device):
    import transformers

    import flashattn2.integrations.transformers  # noqa: F401  (registers "flashattn2")

    config = transformers.LlamaConfig(**dims)
    torch.manual_seed(0)  # the same weights for every attention
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation(attention)
    return model


def left_pads(batch: int, prompt: int) -> list[int]:
    """Padding tokens at the start of each eager prompt."""
    return [prompt // 16 >> (i % 4) for i in range(batch)]


def prompt_ids(dims, batch: int, prompt: int, padded: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a prompt of `prompt` random tokens per sequence (the same for every attention),
    left-padded by left_pads where padded."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, dims["vocab_size"], (batch, prompt), generator=gen)
    mask = torch.ones_like(ids)
    for i, pad in enumerate(left_pads(batch, prompt) if padded else []):
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids.to(device), mask.to(device)


def measure(dims, attention, batch, prompt, new_tokens, compiled, device="cuda", repeats=3):
    """(ms per generate() call, tokens per second, the last prompt position's logits) of one attention: compiled,
    a static cache and CUDA graphs; else eager, the dynamic cache and a left-padded prompt."""
    from transformers import CompileConfig

    model = _model(dims, attention, device)
    ids, mask = prompt_ids(dims, batch, prompt, not compiled, device)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, -1].float().cpu()
    kw = dict(
        attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    if compiled:
        kw.update(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))
    else:
        kw["disable_compile"] = True
    model.generate(ids, **kw)  # warms up (compiles and captures)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        model.generate(ids, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / repeats
    return ms, batch * new_tokens / (ms * 1e-3), logits


def run(out_csv, grid: Grid = Grid(), prompt=512, device="cuda", dims=None, repeats=3, progress=print):
    """Appends one row per (model, way, batch, attention) of grid to out_csv, after prompts of `prompt` tokens;
    flashattn2 runs first (its logits are the reference). dims: a config's sizes in place of MODELS' (the CPU test's
    tiny model)."""
    import transformers

    meta = dict(run_metadata(None if device == "cuda" else device), transformers=transformers.__version__)
    attentions = ["flashattn2"] + [a for a in grid.attentions if a != "flashattn2"]
    ways = zip(grid.compiled, grid.new_tokens)
    with appending(out_csv, FIELDS) as (writer, fh):
        for name, (way, tokens), batch in itertools.product(grid.models, ways, grid.batches):
            ref = None
            for attention in attentions:
                row = dict(
                    model=name,
                    attention=attention,
                    batch=batch,
                    prompt=prompt,
                    new_tokens=tokens,
                    compiled=int(way),
                    left_pad=0 if way else left_pads(batch, prompt)[0],
                    **meta,
                )
                try:
                    ms, rate, logits = measure(
                        dims or MODELS[name], attention, batch, prompt, tokens, way, device, repeats
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
                progress(
                    f"{name} {'graph' if way else 'eager'} batch {batch} {attention}: {row['tokens_per_s']} tokens/s {row['note']}"
                )


__all__ = ["ATTENTIONS", "FIELDS", "MODELS", "Grid", "left_pads", "measure", "prompt_ids", "run"]
