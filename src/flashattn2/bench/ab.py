"""Same-run A/B of flashattn2 under two or more settings (`python -m flashattn2 bench ab`): what the
kernel table's choices are made from. A setting is a comma-separated list of ops.planning.force
arguments ("hopper=0", "tma=0", "arch=sm80", "bwd_order=head-major", a tile as
"fwd_hopper_persist=64x64w8s2", with its Q buffers "64x64w12s3q1"; "" or "default" for the defaults) or "pkg:NAME" for a package built
by tools/baseline_pkg.py (an older commit, loaded beside this one). At every point the rounds
alternate the settings (and cuDNN, unless --no-cudnn), so drift hits them alike, odd rounds in reverse
order, so a place in the round favours none (exactly with an even number of rounds); each setting's
median over the rounds is reported with its ratio to the first setting and to cuDNN. Every setting
is checked against the reference (forward and backward, flash-attn's rule) before it is timed; one
that fails is not timed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import statistics

import torch

import flashattn2
from ..ops import planning
from .kernels import DTYPES, FIELDS, Grid, check_provider, run_metadata, time_modes
from .providers import providers
from .results import appending

# planning.force's switches (hopper=..., tma=..., ...); arch and bwd_order take a name
_NAMED = ("arch", "bwd_order")
_SWITCHES = [
    name for name, p in inspect.signature(planning.force).parameters.items() if p.default is None and name not in _NAMED
]
_OFF = ("0", "false", "off", "no")


class Setting:
    """One side of the A/B: label, and how flashattn2 is called under it (run(q, k, v, causal))."""

    def __init__(self, text: str):
        text = text.strip()
        self.label = text if text and text != "default" else "default"
        self.overrides: dict = {}
        self.fn = flashattn2.flash_attn_func
        if text.startswith("pkg:"):
            self.fn = importlib.import_module(text[4:]).flash_attn_func
            return
        for item in filter(None, text.split(",") if self.label != "default" else []):
            key, sep, value = (part.strip() for part in item.partition("="))
            tile = planning.parse_tile(value)
            if key in planning.KERNELS and tile:
                self.overrides[key] = tile
                continue
            if not sep or (key not in _SWITCHES and key not in _NAMED):
                raise ValueError(
                    f"bench ab: setting {text!r}: expected key=value with key one of "
                    f"{[*_NAMED, *_SWITCHES]}, or a kernel of {list(planning.KERNELS)} = a tile like "
                    f"64x128w4s2 (64x64w12s3q1: with its Q buffers), got {item!r}"
                )
            self.overrides[key] = value if key in _NAMED else value.lower() not in _OFF

    def context(self):
        """The setting's overrides, entered around a whole measurement or check: the backward runs
        after the forward call has returned (autograd), and reads the backward's switches then. The
        defaults enter no override at all."""
        return planning.force(**self.overrides) if self.overrides else contextlib.nullcontext()

    def run(self, q, k, v, causal):
        """The call measured, inside context()."""
        return self.fn(q, k, v, causal=causal)


def run(settings: list[str], grid: Grid, cudnn=True, out_csv=None, progress=True, device="cuda") -> list[dict]:
    """Rows {setting, dtype, headdim, causal, seqlen, mode, ms (median of grid.rounds), tflops, note} for each
    setting (and "sdpa_cudnn") at each point of grid; appended to out_csv (kernels.FIELDS, provider =
    "flashattn2[label]") if given."""
    sides = [Setting(s) for s in settings]
    cudnn_fn = providers()["sdpa_cudnn"][1] if cudnn else None
    rows = []
    meta = None  # run_metadata(), at the first point written
    for point in grid.points():
        causal, modes = point.causal, grid.modes
        shape = dict(batch=point.batch, heads=point.nheads, heads_k=point.nheads_k)
        notes = {}
        for side in sides:
            with side.context():
                notes[side.label] = check_provider(
                    side.run, "bshd", DTYPES[point.dtype], point.headdim, causal, point.group
                )
        names = [s.label for s in sides] + (["sdpa_cudnn"] if cudnn else [])
        times = {name: {mode: [] for mode in modes} for name in names}
        q, k, v = point.inputs(device)
        order = [s for s in sides if not notes[s.label]] + ([None] if cudnn else [])  # None: cuDNN
        for round_ in range(grid.rounds):
            # odd rounds in reverse order, so that a place in the round (first after the previous
            # round's cache flush, last after the others' launches) favours no setting
            for side in order if round_ % 2 == 0 else order[::-1]:
                if side is None:
                    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                    for mode, ms in time_modes(lambda a, b, c: cudnn_fn(a, b, c, causal), [qt, kt, vt], modes).items():
                        times["sdpa_cudnn"][mode].append(ms)
                    continue
                with side.context():  # forward and backward under the setting
                    found = time_modes(lambda a, b, c: side.run(a, b, c, causal), [q, k, v], modes)
                for mode, ms in found.items():
                    times[side.label][mode].append(ms)
            if device == "cuda":
                torch.cuda.empty_cache()
        for name in names:
            for mode in modes:
                found = times[name][mode]
                ms = statistics.median(found) if found else float("nan")
                rows.append(
                    dict(
                        setting=name,
                        dtype=point.dtype,
                        headdim=point.headdim,
                        causal=int(causal),
                        seqlen=point.seqlen,
                        mode=mode,
                        ms=ms,
                        tflops=point.flops(mode) / ms * 1e-9,
                        note=notes.get(name, ""),
                        **shape,
                    )
                )
        if out_csv:  # each point as it is done: a run cut short keeps what it measured
            meta = meta or run_metadata()  # once a run (its git sha is a subprocess)
            _append(out_csv, rows[-len(names) * len(modes) :], grid.rounds, meta)
        if progress:
            print(f"ab: {point.label} done", flush=True)
    return rows


def _append(out_csv: str, rows: list[dict], rounds: int, meta: dict) -> None:
    with appending(out_csv, FIELDS, lambda row: {"nheads_k": row["nheads"]}) as (writer, fh):
        for r in rows:
            provider = r["setting"] if r["setting"] == "sdpa_cudnn" else f"flashattn2[{r['setting']}]"
            writer.writerow(
                dict(
                    provider=provider,
                    dtype=r["dtype"],
                    headdim=r["headdim"],
                    causal=r["causal"],
                    seqlen=r["seqlen"],
                    batch=r["batch"],
                    nheads=r["heads"],
                    nheads_k=r["heads_k"],
                    mode=r["mode"],
                    ms=f"{r['ms']:.4f}",
                    tflops=f"{r['tflops']:.1f}",
                    peak_mib="",
                    note=r["note"] or f"ab median of {rounds}",
                    **meta,
                )
            )


def markdown(rows: list[dict]) -> str:
    """One line per (dtype, headdim, causal, seqlen, mode): each setting's TFLOP/s, its ratio to the
    first setting and, where measured, to cuDNN."""
    labels = list(dict.fromkeys(r["setting"] for r in rows if r["setting"] != "sdpa_cudnn"))
    has_cudnn = any(r["setting"] == "sdpa_cudnn" for r in rows)
    head = ["dtype", "headdim", "causal", "seqlen", "mode", *labels]
    head += [f"{lab} / {labels[0]}" for lab in labels[1:]]
    if has_cudnn:
        head += ["cuDNN", *[f"{lab} / cuDNN" for lab in labels]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points: dict = {}
    for r in rows:
        points.setdefault((r["dtype"], r["headdim"], r["causal"], r["seqlen"], r["mode"]), {})[r["setting"]] = r
    for (dtype, headdim, causal, seqlen, mode), found in points.items():
        tf = {name: found[name]["tflops"] if name in found else float("nan") for name in [*labels, "sdpa_cudnn"]}
        cells = [dtype, str(headdim), "causal" if causal else "full", str(seqlen), mode]
        cells += [f"{tf[lab]:.0f}" for lab in labels]
        cells += [f"{tf[lab] / tf[labels[0]]:.3f}" for lab in labels[1:]]
        if has_cudnn:
            cells += [f"{tf['sdpa_cudnn']:.0f}", *[f"{tf[lab] / tf['sdpa_cudnn']:.3f}" for lab in labels]]
        lines.append("| " + " | ".join(cells) + " |")
    notes = {r["setting"]: r["note"] for r in rows if r["note"]}
    for name, note in notes.items():
        lines.append(f"\n{name}: {note}")
    return "\n".join(lines)
