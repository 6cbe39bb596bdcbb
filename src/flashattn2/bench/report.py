"""Tables (TFLOP/s, and flashattn2's ratio to each peer), peak memory of forward + backward, and
the paper-style bar plots from the bench CSV. The last row for a (provider, dtype, heads,
headdim, causal, seqlen, mode) wins; heads is "" for MHA (nheads_k = nheads) and "GQA 32/8" for
32 query heads over 8 K/V heads."""

from __future__ import annotations

import csv
import math
import os
from collections import OrderedDict

PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "naive")
ORDER = ("flashattn2",) + PEERS


def heads(row) -> str:
    nheads, nheads_k = row["nheads"], row.get("nheads_k") or row["nheads"]
    return "" if nheads_k == nheads else f"GQA {nheads}/{nheads_k}"


def load(path: str) -> dict:
    latest = OrderedDict()
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (
                row["dtype"],
                heads(row),
                int(row["headdim"]),
                int(row["causal"]),
                row["mode"],
                int(row["seqlen"]),
                row["provider"],
            )
            latest[key] = row
    return latest


def _tflops(row) -> float:
    return float(row["tflops"]) if row else math.nan


def groups(latest, value=_tflops):
    """{(dtype, heads, headdim, causal, mode): {seqlen: {provider: value(row)}}}"""
    out = {}
    for (dtype, kind, d, causal, mode, seqlen, provider), row in latest.items():
        out.setdefault((dtype, kind, d, causal, mode), {}).setdefault(seqlen, {})[provider] = value(row)
    return out


def _peak(row) -> float:
    return float(row["peak_mib"]) if row and row.get("peak_mib") else math.nan


def _title(dtype, kind, d, causal, mode) -> str:
    return f"{dtype}, {kind + ', ' if kind else ''}headdim {d}, {'causal' if causal else 'non-causal'}, {mode}"


def markdown(latest) -> str:
    lines = []
    meta = next(iter(latest.values()), None)
    if meta:
        lines.append(
            f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
            f"git {meta['git_sha']}. TFLOP/s (FLOPs as the FlashAttention-2 paper counts them); "
            "x = flashattn2's speed over the peer's. A table whose rows come from several runs lists them: "
            "a ratio against a peer that was not re-measured in flashattn2's run is across runs.\n"
        )
    for group, by_len in sorted(groups(latest).items()):
        present = [p for p in ORDER if any(p in v for v in by_len.values())]
        peers = [p for p in present if p != "flashattn2"]
        shas = sorted({row["git_sha"] for key, row in latest.items() if key[:5] == group})
        # a table from other runs than the header's names them (one other run too: the header names the first row's)
        runs = f" (runs: git {', '.join(shas)})" if len(shas) > 1 or shas != [meta["git_sha"]] else ""
        lines.append(f"### {_title(*group)}{runs}\n")
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
    peaks = {
        g: v
        for g, v in groups(latest, _peak).items()
        if any(not math.isnan(x) for by_p in v.values() for x in by_p.values())
    }
    if peaks:
        lines.append("### Peak memory of forward + backward\n")
        lines.append(
            "MiB allocated at the peak of one forward + backward above what was allocated before "
            "it (the inputs, and the previous step's graph where the timing keeps it); x = flashattn2's "
            "memory over the peer's (below 1: less).\n"
        )
        head = ["case", "seqlen", "flashattn2"] + [p for p in PEERS] + [f"x {p}" for p in PEERS]
        rows = []
        for group, by_len in sorted(peaks.items()):
            present = [p for p in PEERS if any(not math.isnan(v.get(p, math.nan)) for v in by_len.values())]
            for seqlen in sorted(by_len):
                vals = by_len[seqlen]
                ours = vals.get("flashattn2", math.nan)
                rows.append(
                    [_title(*group[:4], "").removesuffix(", "), str(seqlen), _fmt(ours)]
                    + [_fmt(vals.get(p, math.nan)) if p in present else "–" for p in PEERS]
                    + [_ratio(ours, vals.get(p, math.nan)) for p in PEERS]
                )
        # peers never measured drop out of the table
        keep = [i for i, h in enumerate(head) if i < 3 or any(r[i] != "–" for r in rows)]
        lines.append("| " + " | ".join(head[i] for i in keep) + " |")
        lines.append("|" + "---|" * len(keep))
        lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
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
    for (dtype, kind, d, causal, mode), by_len in sorted(groups(latest).items()):
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
                    ax.annotate(
                        f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=6
                    )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqlens))])
        ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_xlabel("sequence length (batch x seqlen = 16k tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(
            f"{mode}, {kind + ', ' if kind else ''}headdim {d}, {'causal' if causal else 'non-causal'}, {dtype}"
        )
        ax.legend(fontsize=7, ncol=len(present))
        fig.tight_layout()
        gqa = "-gqa" + kind.removeprefix("GQA ").replace("/", "x") if kind else ""
        path = os.path.join(out_dir, f"{dtype}{gqa}-d{d}-{'causal' if causal else 'full'}-{mode}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
