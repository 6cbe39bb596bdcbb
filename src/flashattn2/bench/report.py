"""Tables (TFLOP/s, and flashattn2's ratio to each peer) and the paper-style bar plots from the
bench CSV. The last row for a (provider, dtype, headdim, causal, seqlen, mode) wins."""
from __future__ import annotations

import csv
import math
import os
from collections import OrderedDict

PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive")
ORDER = ("flashattn2",) + PEERS


def load(path: str) -> dict:
    latest = OrderedDict()
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (row["dtype"], int(row["headdim"]), int(row["causal"]), row["mode"], int(row["seqlen"]),
                   row["provider"])
            latest[key] = row
    return latest


def _tflops(row) -> float:
    return float(row["tflops"]) if row else math.nan


def groups(latest):
    """{(dtype, headdim, causal, mode): {seqlen: {provider: tflops}}}"""
    out = {}
    for (dtype, d, causal, mode, seqlen, provider), row in latest.items():
        out.setdefault((dtype, d, causal, mode), {}).setdefault(seqlen, {})[provider] = _tflops(row)
    return out


def markdown(latest) -> str:
    lines = []
    meta = next(iter(latest.values()), None)
    if meta:
        lines.append(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
                     f"git {meta['git_sha']}. TFLOP/s (FLOPs as the FlashAttention-2 paper counts them); "
                     "x = flashattn2's speed over the peer's. A table whose rows come from several runs lists them: "
                     "a ratio against a peer that was not re-measured in flashattn2's run is across runs.\n")
    for (dtype, d, causal, mode), by_len in sorted(groups(latest).items()):
        present = [p for p in ORDER if any(p in v for v in by_len.values())]
        peers = [p for p in present if p != "flashattn2"]
        shas = sorted({row["git_sha"] for (dt, hd, c, md, _, _), row in latest.items()
                       if (dt, hd, c, md) == (dtype, d, causal, mode)})
        runs = f" (runs: git {', '.join(shas)})" if len(shas) > 1 else ""
        lines.append(f"### {dtype}, headdim {d}, {'causal' if causal else 'non-causal'}, {mode}{runs}\n")
        head = ["seqlen"] + present + [f"x {p}" for p in peers if "flashattn2" in present]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for seqlen in sorted(by_len):
            vals = by_len[seqlen]
            cells = [str(seqlen)] + [_fmt(vals.get(p, math.nan)) for p in present]
            if "flashattn2" in present:
                cells += [_ratio(vals.get("flashattn2", math.nan), vals.get(p, math.nan)) for p in peers]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.0f}"


def _ratio(a: float, b: float) -> str:
    return "–" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}"


def plot(latest, out_dir: str) -> list[str]:
    """One PNG per dtype x headdim x causal x mode: TFLOP/s against seqlen, a bar per provider."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install flashattn2[bench]): no plots")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for (dtype, d, causal, mode), by_len in sorted(groups(latest).items()):
        seqlens = sorted(by_len)
        present = [p for p in ORDER if any(p in v for v in by_len.values())]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(present)
        for i, provider in enumerate(present):
            ys = [by_len[s].get(provider, math.nan) for s in seqlens]
            xs = [j + i * width for j in range(len(seqlens))]
            bars = ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=provider)
            for bar, y in zip(bars, ys):
                if not math.isnan(y):
                    ax.annotate(f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center",
                                va="bottom", fontsize=6)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqlens))])
        ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_xlabel("sequence length (batch x seqlen = 16k tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode}, headdim {d}, {'causal' if causal else 'non-causal'}, {dtype}")
        ax.legend(fontsize=7, ncol=len(present))
        fig.tight_layout()
        path = os.path.join(out_dir, f"{dtype}-d{d}-{'causal' if causal else 'full'}-{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
