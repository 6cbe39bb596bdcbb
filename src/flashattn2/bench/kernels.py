"""The kernel grid: seqlen 512..16k at a fixed number of tokens, hidden 2048, per headdim, causal,
mode and dtype; every provider in one run; results appended to a CSV so the grid can be run in
slices (one device call each)."""

from __future__ import annotations

import datetime
import itertools
import os
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..reference import BWD_FACTOR, FWD_FACTOR, attention_ref, tolerance
from .providers import attention_flops, providers
from .results import appending

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("fwd", "bwd", "fwd_bwd")
# nheads_k and peak_mib were added later: older rows get nheads_k = nheads (results.appending)
FIELDS = [
    "provider",
    "dtype",
    "headdim",
    "causal",
    "seqlen",
    "batch",
    "nheads",
    "nheads_k",
    "mode",
    "ms",
    "tflops",
    "peak_mib",
    "note",
    "gpu",
    "torch",
    "triton",
    "date",
    "git_sha",
]


class Point(NamedTuple):
    """One point of a Grid: batch sequences of seqlen tokens, nheads query heads and nheads_k K/V heads of headdim;
    dtype a DTYPES name."""

    dtype: str
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    nheads_k: int

    @property
    def label(self) -> str:
        """The point as the progress lines name it."""
        return f"{self.dtype} d{self.headdim} {'causal' if self.causal else 'full'} {self.seqlen}"

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.nheads // self.nheads_k

    def inputs(self, device: str = "cuda") -> Iterator[torch.Tensor]:
        """Random q, k, v in the (batch, seqlen, heads, headdim) layout, each made as it is taken."""
        return (
            torch.randn(self.batch, self.seqlen, h, self.headdim, device=device, dtype=DTYPES[self.dtype])
            for h in (self.nheads, self.nheads_k, self.nheads_k)
        )

    def flops(self, mode: str) -> float:
        """The paper's count (providers.attention_flops)."""
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal, mode)


@dataclass(frozen=True)
class Grid:
    """What bench kernels and bench ab measure: each (dtype, headdim, causal, seqlen) point in each of modes, over
    `rounds` rounds. A point holds `tokens` tokens (batch = tokens // seqlen), nheads query heads (default
    hidden // headdim) and nheads_k K/V heads (default nheads; fewer: GQA)."""

    dtypes: Sequence[str]
    headdims: Sequence[int]
    seqlens: Sequence[int]
    causals: Sequence[bool]
    modes: Sequence[str]
    tokens: int = 16384
    hidden: int = 2048
    nheads: int | None = None
    nheads_k: int | None = None
    rounds: int = 1

    def heads(self, headdim: int) -> tuple[int, int]:
        """(query heads, K/V heads) at headdim."""
        nheads = self.nheads or self.hidden // headdim
        return nheads, self.nheads_k or nheads

    def point(self, dtype: str, headdim: int, causal: bool, seqlen: int) -> Point:
        nheads, nheads_k = self.heads(headdim)
        batch = max(1, self.tokens // seqlen)
        return Point(
            dtype=dtype, headdim=headdim, causal=causal, seqlen=seqlen, batch=batch, nheads=nheads, nheads_k=nheads_k
        )

    def points(self) -> list[Point]:
        """Every point, dtype outermost, then headdim, causal and seqlen."""
        return [self.point(*p) for p in itertools.product(self.dtypes, self.headdims, self.causals, self.seqlens)]


def git_sha() -> str:
    if os.environ.get("FLASHATTN2_GIT_SHA"):
        return os.environ["FLASHATTN2_GIT_SHA"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cuda_graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after three warm-up calls on a side stream, as PyTorch asks):
    replay() runs its kernels with no host work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_metadata(gpu: str | None = None) -> dict:
    """GPU (default: CUDA's current device), versions, date and git sha of a benchmark run."""
    import triton

    return dict(
        gpu=gpu or torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
        git_sha=git_sha(),
    )


def _to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bshd" else t.transpose(1, 2).contiguous()


def problems(results) -> str:
    """'' when every (name, ours, reference, low-precision result, factor) obeys flash-attn's
    rule, else which do not and by how much."""
    found = []
    for name, ours, ref, low, factor in results:
        ok, err, bound = tolerance.check(ours, ref, low, factor)
        if not ok:
            found.append(f"{name} error {err:.2e} > {bound:.2e}")
    return "; ".join(found)


def check_provider(fn, layout, dtype, headdim, causal, group=1) -> str:
    """'' when fwd and bwd obey flash-attn's rule on a small odd-sized problem (with `group`
    query heads per K/V head), else why not."""
    q, do = (torch.randn(1, 511, 2 * group, headdim, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, 511, 2, headdim, device="cuda", dtype=dtype) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref_out, _ = attention_ref(q, k, v, causal=causal)
    low_out, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.float())
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    qn, kn, vn = (_to_layout(t.detach(), layout).requires_grad_() for t in (q, k, v))
    out = fn(qn, kn, vn, causal)
    grads = torch.autograd.grad(out, (qn, kn, vn), _to_layout(do, layout))
    back = (lambda t: t) if layout == "bshd" else (lambda t: t.transpose(1, 2))
    results = [("out", back(out), ref_out, low_out, FWD_FACTOR)]
    results += [(f"d{n}", back(g), r, lo, BWD_FACTOR) for n, g, r, lo in zip("qkv", grads, ref_grads, low_grads)]
    return problems(results)


def time_modes(call, inputs, modes, peak=None):
    """{mode: ms} (do_bench medians) of call(*inputs) -> out: the forward without autograd, the
    backward alone (w.r.t. every input), and forward + backward. peak (a dict), if given, gets
    "fwd_bwd": the most memory one forward + backward allocates above what was allocated before
    it (outputs, saved tensors, gradients, workspaces), in MiB."""
    from triton.testing import do_bench

    result = {}
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = call(*leaves)
    do = torch.randn_like(out)
    for mode in modes:
        if mode == "fwd":
            with torch.no_grad():
                call(*inputs)  # compile / plan outside the timing
                result[mode] = do_bench(lambda: call(*inputs), warmup=10, rep=60, return_mode="median")
            continue
        if mode == "bwd":
            out = call(*leaves)
            step = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)  # noqa: E731
        else:
            step = lambda: torch.autograd.grad(call(*leaves), leaves, do)  # noqa: E731
        step()
        if mode == "fwd_bwd" and peak is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak["fwd_bwd"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        result[mode] = do_bench(step, warmup=10, rep=60, return_mode="median")
    return result


def alternated(calls: dict, time_one, rounds: int) -> dict:
    """{name: {mode: median ms}} over `rounds` rounds of time_one(call) -> {mode: ms}, the calls alternated, odd
    rounds in reverse order (an even count puts each call first in half of them)."""
    acc: dict = {name: {} for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for m, ms in time_one(calls[name]).items():
                acc[name].setdefault(m, []).append(ms)
    return {name: {m: sorted(v)[len(v) // 2] for m, v in d.items()} for name, d in acc.items()}


def time_point(fn, layout, point: Point, modes, peak=None):
    """{mode: ms} for one provider at one point (GQA where point.nheads_k < point.nheads)."""
    inputs = [_to_layout(t, layout) for t in point.inputs()]
    return time_modes(lambda q, k, v: fn(q, k, v, point.causal), inputs, modes, peak)


def run_grid(out_csv, grid: Grid, names, progress=True):
    """Each provider of names at each point of grid, appended to out_csv. grid.rounds > 1: each point is timed that
    many times, the providers alternated, odd rounds in reverse order (as bench ab does), and each mode's median is
    reported: a single pass times the providers one after the other, and a drift between them (clocks, the GPU's
    power state) reads as their ratio."""
    for headdim in grid.headdims:  # before anything is measured or written
        heads, heads_k = grid.heads(headdim)
        if heads % heads_k:
            raise ValueError(f"nheads={heads} (headdim {headdim}) is not a multiple of nheads_k={heads_k}")
    meta = run_metadata()
    table = providers()
    points = grid.points()
    total = len(points) * len(names)
    bar = _progress(total, progress)
    checked: dict[tuple, str] = {}
    rows = []
    with appending(out_csv, FIELDS, lambda row: {"nheads_k": row["nheads"]}) as (writer, fh):
        for point in points:
            notes = {name: "" for name in names}
            peaks = {name: {} for name in names}
            times = {name: {mode: [] for mode in grid.modes} for name in names}
            for r in range(grid.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    if notes[name]:
                        continue
                    layout, fn = table[name]
                    key = (name, point.dtype, point.headdim, point.causal, point.group)
                    try:
                        if key not in checked:
                            dtype = DTYPES[point.dtype]
                            checked[key] = check_provider(fn, layout, dtype, point.headdim, point.causal, point.group)
                        notes[name] = checked[key] and "check failed: " + checked[key]
                        peak = peaks[name] if r == 0 else None  # memory: the first round's
                        timings = {} if notes[name] else time_point(fn, layout, point, grid.modes, peak)
                    except torch.cuda.OutOfMemoryError:
                        timings, notes[name] = {}, "out of memory"
                    except RuntimeError as exc:  # a backend that refuses the shape or dtype
                        timings, notes[name] = {}, "failed: " + str(exc).splitlines()[0][:120]
                    torch.cuda.empty_cache()
                    for mode, ms in timings.items():
                        times[name][mode].append(ms)
            for name in names:
                note = notes[name]
                peak = {} if note else peaks[name]  # (a round that failed: no row of it, memory included)
                for mode in grid.modes:
                    ms = statistics.median(times[name][mode]) if times[name][mode] and not note else float("nan")
                    row = dict(
                        provider=name,
                        dtype=point.dtype,
                        headdim=point.headdim,
                        causal=int(point.causal),
                        seqlen=point.seqlen,
                        batch=point.batch,
                        nheads=point.nheads,
                        nheads_k=point.nheads_k,
                        mode=mode,
                        ms=f"{ms:.4f}",
                        tflops=f"{point.flops(mode) / ms * 1e-9:.1f}",
                        peak_mib=f"{peak[mode]:.0f}" if mode in peak else "",
                        note=note or (f"median of {grid.rounds} rounds" if grid.rounds > 1 else ""),
                        **meta,
                    )
                    writer.writerow(row)
                    rows.append(row)
                fh.flush()
                bar(f"{point.label} {name}")
    return rows


def _progress(total, enabled):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None and enabled:
        bar = tqdm(total=total, unit="point", dynamic_ncols=True)

        def step(desc):
            bar.set_description(desc)
            bar.update()

        return step
    count = [0]

    def step(desc):
        count[0] += 1
        if enabled:
            print(f"[{count[0]}/{total}] {desc}", flush=True)

    return step
