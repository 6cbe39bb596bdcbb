"""The FP8 forward beside the bf16 one: TFLOP/s of flashattn2 on float8_e4m3fn q, k, v (FA3's descales, one per
(batch, kv head): the amax over it / 448, as FA3's users quantize) and on the same values in bf16, and cuDNN's bf16
forward, in one run, the providers alternated over rounds; "flashattn2-fp8-triton" is the FP8 forward held to the
Triton kernel (force(hopper=False)), where the plan picks the Gluon one: the same-run A/B behind the table's FP8
rows. The FLOPs counted are the bf16 forward's (4·b·h·n²·d,
halved when causal). Before each point is timed, the FP8 forward at its head dim and mask is checked on a small
odd-sized problem (2 x 511 tokens) against the fp64 reference on the dequantized inputs (README "FP8": at most 2x the
error of PyTorch doing the same rounding, plus a bf16 ulp); a point whose check fails is written with its note and not
timed."""

from __future__ import annotations

import itertools

import torch

from ..reference import FWD_FACTOR, attention_ref, tolerance
from ..reference.fp8 import E4M3, dequantize, quantize
from .kernels import run_metadata
from .providers import attention_flops
from .results import appending

FIELDS = ["provider", "headdim", "causal", "seqlen", "batch", "nheads", "ms", "tflops", "speedup_vs_bf16", "note"]
FIELDS += ["gpu", "torch", "triton", "date", "git_sha"]


def quantized(x: torch.Tensor, nheads_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seqlen, nheads, d) as e4m3 codes and its descale (batch, nheads_k): amax over each kv head's
    group / 448."""
    b, s, h, d = x.shape
    amax = x.float().abs().reshape(b, s, nheads_k, (h // nheads_k) * d).amax(dim=(1, 3))
    descale = (amax / 448.0).clamp(min=1e-12)
    return quantize(x, descale), descale


def check(headdim: int, causal: bool) -> str:
    """'' when the FP8 forward obeys the rule on a small odd-sized problem on this GPU, else why not."""
    import flashattn2

    x = [torch.randn(2, 511, h, headdim, device="cuda") for h in (4, 2, 2)]
    (q, qd), (k, kd), (v, vd) = (quantized(t, 2) for t in x)
    deq = [dequantize(t, d) for t, d in ((q, qd), (k, kd), (v, vd))]
    out = flashattn2.flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    ref, _ = attention_ref(*deq, causal=causal)
    dots = torch.cuda.get_device_capability() >= (8, 9)
    low, _ = attention_ref(*(t.float() for t in deq), causal=causal, p_dtype=E4M3 if dots else torch.float32)
    ok, err, bound = tolerance.check(out, ref, low.to(torch.bfloat16), FWD_FACTOR)
    return "" if ok else f"out error {err:.2e} > {bound:.2e}"


def _held_to_triton(call):
    """call with the Gluon kernels off (the Triton forward runs the FP8 point)."""
    from ..ops.request.modes import force

    def held():
        with force(hopper=False):
            return call()

    return held


def run(path, headdims, seqlens, causals, rounds=3, tokens=16384, hidden=2048) -> list[dict]:
    """The grid into path (appended); returns its rows."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flashattn2

    meta = run_metadata()
    rows = []
    with appending(path, FIELDS) as (writer, fh):
        for headdim, causal, seqlen in itertools.product(headdims, causals, seqlens):
            batch, nheads = max(1, tokens // seqlen), hidden // headdim
            note = check(headdim, causal)
            x = [torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            (q8, qd), (k8, kd), (v8, vd) = (quantized(t, nheads) for t in x)
            q, k, v = x
            qt, kt, vt = (t.transpose(1, 2) for t in x)
            fp8 = lambda: flashattn2.flash_attn_func(
                q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd
            )
            calls = {
                "flashattn2-fp8": fp8,
                "flashattn2-fp8-triton": _held_to_triton(fp8),
                "flashattn2-bf16": lambda: flashattn2.flash_attn_func(q, k, v, causal=causal),
                "sdpa_cudnn-bf16": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
            }
            times = {name: [] for name in calls}
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for r in range(rounds if not note else 0):
                    for name in calls if r % 2 == 0 else list(calls)[::-1]:
                        calls[name]()
                        times[name].append(do_bench(calls[name], warmup=10, rep=60, return_mode="median"))
            flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, "fwd")
            median = {n: sorted(t)[len(t) // 2] if t else float("nan") for n, t in times.items()}
            for name, ms in median.items():
                row = dict(provider=name, headdim=headdim, causal=causal, seqlen=seqlen, batch=batch, nheads=nheads)
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), note=note if "fp8" in name else "")
                row["speedup_vs_bf16"] = round(median["flashattn2-bf16"] / ms, 3)
                row.update(meta)
                writer.writerow(row)
                fh.flush()
                rows.append(row)
                print(f"d{headdim} causal={causal} {seqlen}: {name} {row['tflops']} TFLOP/s {note}", flush=True)
    return rows


def markdown(path) -> str:
    """The CSV as a table: one line per point, each provider's TFLOP/s and FP8 over our bf16."""
    import csv

    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    points: dict = {}
    for r in rows:
        points.setdefault((r["gpu"], r["git_sha"], int(r["headdim"]), r["causal"], int(r["seqlen"])), {})[
            r["provider"]
        ] = r
    lines = [
        "# FP8 forward beside bf16 (`python -m flashattn2 bench fp8`)",
        "",
        "TFLOP/s counting the bf16 forward's FLOPs; the FP8 point is checked against the fp64 reference first.",
        "",
        "| gpu | sha | d | causal | seqlen | fp8 | fp8 (Triton kernel) | bf16 | cuDNN bf16 | fp8 / bf16 | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (gpu, sha, d, causal, n), by in sorted(points.items()):
        fp8, triton_fp8, bf16, cudnn = (
            by.get(p, {}) for p in ("flashattn2-fp8", "flashattn2-fp8-triton", "flashattn2-bf16", "sdpa_cudnn-bf16")
        )
        lines.append(
            f"| {gpu} | {sha} | {d} | {causal} | {n} | {fp8.get('tflops', '')} | {triton_fp8.get('tflops', '')} | "
            f"{bf16.get('tflops', '')} | {cudnn.get('tflops', '')} | {fp8.get('speedup_vs_bf16', '')} | "
            f"{fp8.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"
