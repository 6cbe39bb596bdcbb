"""The FlashAttention-2 paper's end-to-end table: training-step throughput of GPT3-1.3B and
GPT3-2.7B shapes (headdim 128) at 2k and 8k context on one GPU, with the attention run by plain
PyTorch ("naive"), SDPA's flash and cuDNN kernels, and flashattn2.

A step: forward, backward and a fused AdamW update of a bf16 model (no compile) on `tokens`
tokens (batch = tokens / context). TFLOP/s by the paper's count per sequence,
6 * seqlen * params + 12 * layers * hidden * seqlen^2, params counted once (tied embeddings).
Before timing, each attention's output in the first layer is checked against flashattn2's on the
same weights and batch. Peak memory of a step is reported beside it.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.gpt import GPT, GPTConfig
from .kernels import run_metadata
from .results import appending

MODELS = {  # name: (layers, hidden, heads); headdim 128, GPT-3's vocabulary
    "gpt3-1.3b": (24, 2048, 16),
    "gpt3-2.7b": (32, 2560, 20),
}
VOCAB = 50257
FIELDS = [
    "model",
    "attention",
    "context",
    "batch",
    "params",
    "ms",
    "tflops",
    "peak_gib",
    "loss",
    "note",
    "gpu",
    "torch",
    "triton",
    "date",
    "git_sha",
]


@dataclass(frozen=True)
class Grid:
    """What bench gpt measures: each model of MODELS at each context length, trained with each attention."""

    models: Sequence[str] = ("gpt3-1.3b", "gpt3-2.7b")
    contexts: Sequence[int] = (2048, 8192)
    attentions: Sequence[str] = ("flashattn2", "sdpa_flash", "sdpa_cudnn", "naive")


def step_flops(params: int, layers: int, hidden: int, seqlen: int, batch: int) -> float:
    return batch * (6 * seqlen * params + 12 * layers * hidden * seqlen**2)


def _model(name, context, attention, device, dims=None):
    layers, hidden, heads = dims or MODELS[name]
    config = GPTConfig(
        vocab_size=VOCAB if dims is None else 97,
        block_size=context,
        n_layer=layers,
        n_head=heads,
        n_embd=hidden,
        attention=attention,
    )
    torch.manual_seed(0)  # the same weights for every attention
    with torch.device(device):  # initialised where it runs: a 2.7B model's CPU init takes longer than its steps
        return GPT(config).to(dtype=torch.bfloat16)


def measure(name, context, attention, tokens, steps, warmup, device="cuda", dims=None):
    """(ms per step, peak GiB, first loss, params, batch, probe: the first layer's attention output
    on the first sequence) of training steps; raises torch.OutOfMemoryError."""
    model = _model(name, context, attention, device, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batch = max(1, tokens // context)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = torch.randint(0, model.config.vocab_size, (batch, context + 1), generator=gen).to(device)

    def step():
        _, loss = model(data[:, :-1], targets=data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    with torch.no_grad():  # what the check compares: the first layer's attention on the first sequence
        probe = model.blocks[0].attn(model.blocks[0].ln_1(model.wte(data[:1, :-1]))).float().cpu()
    first = step().item()
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms, peak = (time.perf_counter() - t0) * 1e3 / steps, float("nan")
    return ms, peak, first, model.num_params(non_embedding=False), batch, probe


def run(out_csv, grid: Grid = Grid(), tokens=16384, steps=10, warmup=3, device="cuda", dims=None, progress=print):
    """Appends one row per (model, context, attention) of grid to out_csv. flashattn2 runs first: its
    first layer's attention output is what the others' must match (bf16: within 5% of its
    largest value; a mismatch is written in the row's note)."""
    meta = run_metadata(None if device == "cuda" else device)
    attentions = ["flashattn2"] + [a for a in grid.attentions if a != "flashattn2"]
    with appending(out_csv, FIELDS) as (writer, fh):
        for name in grid.models:
            layers, hidden, _ = dims or MODELS[name]
            for context in grid.contexts:
                ref = None
                for attention in attentions:
                    row = dict(model=name, attention=attention, context=context, **meta)
                    try:
                        ms, peak, loss, params, batch, probe = measure(
                            name, context, attention, tokens, steps, warmup, device, dims
                        )
                    except torch.OutOfMemoryError:
                        row.update(note="out of memory", ms="nan", tflops="nan")
                    else:
                        ref = probe if attention == "flashattn2" else ref
                        note = ""
                        err = float((probe - ref).abs().max() / ref.abs().max()) if ref is not None else 0.0
                        if err > 0.05:  # bf16 against bf16: a few ulps; a wrong mask is O(1)
                            note = f"attention output differs from flashattn2's by {err:.2g} (relative)"
                        tflops = step_flops(params, layers, hidden, context, batch) / ms * 1e-9
                        row.update(
                            batch=batch,
                            params=params,
                            ms=f"{ms:.2f}",
                            tflops=f"{tflops:.4g}",
                            peak_gib=f"{peak:.2f}",
                            loss=f"{loss:.4f}",
                            note=note,
                        )
                    finally:
                        if device == "cuda":
                            torch.cuda.empty_cache()
                    writer.writerow(row)
                    fh.flush()
                    progress(
                        f"{name} context {context} {attention}: {row.get('tflops')} TFLOP/s "
                        f"{row.get('peak_gib', '')} GiB {row.get('note', '')}"
                    )


def markdown(path) -> str:
    """Per model and context: TFLOP/s and peak memory of each attention, and flashattn2's ratio to
    each peer in the same run. The last row of a point wins."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return "no rows"
    latest = {(r["model"], int(r["context"]), r["attention"]): r for r in rows}
    meta = rows[-1]
    shas = ", ".join(sorted({r["git_sha"] for r in latest.values()}))
    attentions = [a for a in ("flashattn2", "sdpa_flash", "sdpa_cudnn", "naive") if any(k[2] == a for k in latest)]
    lines = [
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, git {shas}. "
        "Training step of a bf16 GPT (fused AdamW, no compile), TFLOP/s per GPU by the FlashAttention-2 "
        "paper's count (6 * seqlen * params + 12 * layers * hidden * seqlen^2 per sequence), peak memory in "
        "GiB; x = flashattn2 over the peer, same run.\n",
        "| model | context | "
        + " | ".join(f"{a} TFLOP/s (GiB)" for a in attentions)
        + " | "
        + " | ".join(f"x {a}" for a in attentions[1:])
        + " |",
        "|---|---|" + "---|" * (2 * len(attentions) - 1),
    ]
    for model, context in sorted({(k[0], k[1]) for k in latest}):
        cells, speeds = [], {}
        for a in attentions:
            r = latest.get((model, context, a))
            if r is None:
                cells.append("–")
                continue
            if r["note"] == "out of memory":
                cells.append("out of memory")
                continue
            speeds[a] = float(r["tflops"])
            cells.append(f"{speeds[a]:.0f} ({float(r['peak_gib']):.1f})" + (f" [{r['note']}]" if r["note"] else ""))
        ours = speeds.get("flashattn2")
        ratios = [f"{ours / speeds[a]:.2f}" if ours and a in speeds else "–" for a in attentions[1:]]
        lines.append(f"| {model} | {context} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


__all__ = ["MODELS", "Grid", "markdown", "measure", "run", "step_flops"]
