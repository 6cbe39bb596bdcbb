"""What the training features cost on the GPU, each ratio from one run (`python -m flashattn2 bench
features`):

- varlen: a varlen batch of mixed lengths against a dense batch of the same total tokens split into
  equal lengths, in real-token TFLOP/s (FLOPs counted per sequence);
- window: `window_size=(1024, 0)` on one 16k sequence against causal attention on 8 sequences of 2k
  (the same work per query), as a time ratio;
- off: every feature off against a baseline build of the core kernel (an older commit's package
  loaded under another name, see tools/baseline_pkg.py), alternated over rounds so drift cancels;
- on: each feature on (softcap, ALiBi, a window, dropout) against the same call with it off;
- sinks: a learnable sink (requiring grad) against none, 2k-16k tokens a sequence (16k in all), causal and not,
  alternated over SINK_ROUNDS rounds; and decoding (CUDA graphs, GQA-8, bf16 K/V of 8 x 8k and 64 x 8k tokens,
  one split and the automatic splits) with and without one (its rows' tflops column holds GB/s of K/V read, their
  note says so);
- dv, d512, mla: head dims past flash_attn 2.x (bench/headdims.py: a value head dim of its own, head dim 512, MLA
  decoding), beside SDPA's backends.

Every case is checked against the reference (forward and backward) before it is timed.
"""

from __future__ import annotations

import csv
import importlib

import torch

import flashattn2
from ..reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from . import headdims
from .kernels import DTYPES, alternated, problems, run_metadata, time_modes
from .results import Attention, appending

FIELDS = [
    "case",
    "variant",
    "dtype",
    "headdim",
    "nheads",
    "shape",
    "mode",
    "ms",
    "tflops",
    "note",
    "gpu",
    "torch",
    "triton",
    "date",
    "git_sha",
]
# eight sequences of mixed lengths (not multiples of a block) that add up to 16k tokens
MIXED = (3971, 509, 2813, 1157, 3070, 641, 2300, 1923)
ROUNDS = 3
SINK_ROUNDS = 4  # even: each side first in half of them
SINK_LENGTHS = (2048, 4096, 8192, 16384)


def _flops(lengths_q, lengths_k, nheads, headdim, causal, mode, window=None):
    """Paper-style FLOPs summed per sequence; with a window, counted from the visible pairs."""
    total = 0.0
    for sq, sk in zip(lengths_q, lengths_k):
        if window is not None:
            left, right = window
            i = torch.arange(sq, dtype=torch.int64) + (sk - sq)
            lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
            hi = (i + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
            pairs = float((hi - lo + 1).clamp(min=0).sum())
            total += 4.0 * nheads * headdim * pairs
        else:
            total += 4.0 * nheads * sq * sk * headdim / (2 if causal else 1)
    return total * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def _check(call, ref, inputs) -> str:
    """'' when call's out and grads obey flash-attn's rule against ref (fp32 and low precision)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = call(*leaves)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, do)
    ref_out = ref(*leaves, upcast=True)
    low_out = ref(*leaves, upcast=False)
    ref_grads = torch.autograd.grad(ref_out, leaves, do.float())
    low_grads = torch.autograd.grad(low_out, leaves, do)
    named = [("out", out, ref_out, low_out, FWD_FACTOR)]
    named += [(f"grad{i}", g, r, lo, BWD_FACTOR) for i, (g, r, lo) in enumerate(zip(grads, ref_grads, low_grads))]
    return problems(named)


def _dense(batch, seqlen, nheads, headdim, dtype):
    return [torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=dtype) for _ in range(3)]


def _ref_dense(**options):
    def ref(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, **options)[0]

    return ref


def _api_dense(module, **options):
    def call(q, k, v):
        return module.flash_attn_func(q, k, v, **options)

    return call


def _varlen_case(lengths, nheads, headdim, dtype, causal):
    total = sum(lengths)
    cu = torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)
    inputs = [torch.randn(total, nheads, headdim, device="cuda", dtype=dtype) for _ in range(3)]

    def call(q, k, v):
        return flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)

    def ref(q, k, v, upcast):
        outs = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            o, _ = attention_ref(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal, upcast=upcast)
            outs.append(o[0])
        return torch.cat(outs)

    return call, ref, inputs


class _Writer:
    def __init__(self, writer, fh, meta):
        self.writer, self.fh, self.meta, self.rows = writer, fh, meta, []

    def add(self, case, variant, attention: Attention, shape, times, flops_of, note=""):
        """A row per mode of times {mode: ms}, its TFLOP/s flops_of(mode) / ms."""
        if not times:  # not timed (a failed check): one row that says why
            times = {"fwd": float("nan")}
        for mode, ms in times.items():
            row = dict(
                case=case,
                variant=variant,
                dtype=attention.dtype,
                headdim=attention.headdim,
                nheads=attention.nheads,
                shape=shape,
                mode=mode,
                ms=f"{ms:.4f}",
                tflops=f"{flops_of(mode) / ms * 1e-9:.1f}",
                note=note,
                **self.meta,
            )
            self.writer.writerow(row)
            self.rows.append(row)
        self.fh.flush()


def run(
    out_csv,
    dtypes=("fp16", "bf16"),
    headdim=128,
    modes=("fwd", "bwd", "fwd_bwd"),
    baseline=None,
    cases=("varlen", "window", "off", "on", "sinks"),
):
    meta = run_metadata()
    with appending(out_csv, FIELDS) as (writer, fh):
        return _run(_Writer(writer, fh, meta), dtypes, headdim, modes, baseline, cases)


def _run(out, dtypes, headdim, modes, baseline, cases):
    nheads = 2048 // headdim
    base = importlib.import_module(baseline) if baseline else None
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        tag = f"{dtype_name} d{headdim}"
        attention = Attention(dtype=dtype_name, headdim=headdim, nheads=nheads)
        if "varlen" in cases:
            for causal in (False, True):
                n = len(MIXED)
                eq = [sum(MIXED) // n] * n
                dense_inputs = _dense(n, eq[0], nheads, headdim, dtype)
                call_d = _api_dense(flashattn2, causal=causal)
                note_d = _check(call_d, _ref_dense(causal=causal), [t[:, :1024] for t in dense_inputs])
                call_v, ref_v, inputs_v = _varlen_case(MIXED, nheads, headdim, dtype, causal)
                note_v = _check(call_v, ref_v, inputs_v)
                c = "causal" if causal else "full"
                t_d = {} if note_d else time_modes(call_d, dense_inputs, modes)
                out.add(
                    f"varlen-{c}",
                    "dense 8x2048",
                    attention,
                    "8x2048",
                    t_d,
                    lambda m: _flops(eq, eq, nheads, headdim, causal, m),
                    note_d,
                )
                t_v = {} if note_v else time_modes(call_v, inputs_v, modes)
                out.add(
                    f"varlen-{c}",
                    "varlen mixed",
                    attention,
                    "+".join(map(str, MIXED)),
                    t_v,
                    lambda m: _flops(MIXED, MIXED, nheads, headdim, causal, m),
                    note_v,
                )
                print(
                    f"{tag} varlen {c}: "
                    + _pair(
                        t_v,
                        t_d,
                        lambda m: _flops(MIXED, MIXED, nheads, headdim, causal, m),
                        lambda m: _flops(eq, eq, nheads, headdim, causal, m),
                    )
                )
        if "window" in cases:
            win = _dense(1, 16384, nheads, headdim, dtype)
            call_w = _api_dense(flashattn2, window_size=(1024, 0))
            note_w = _check(call_w, _ref_dense(window_size=(1024, 0)), [t[:, :4096] for t in win])
            cau = _dense(8, 2048, nheads, headdim, dtype)
            call_c = _api_dense(flashattn2, causal=True)
            note_c = _check(call_c, _ref_dense(causal=True), [t[:2] for t in cau])
            t_w = {} if note_w else time_modes(call_w, win, modes)
            t_c = {} if note_c else time_modes(call_c, cau, modes)
            out.add(
                "window",
                "causal 8x2k",
                attention,
                "8x2048",
                t_c,
                lambda m: _flops([2048] * 8, [2048] * 8, nheads, headdim, True, m),
                note_c,
            )
            out.add(
                "window",
                "window (1024,0) 1x16k",
                attention,
                "1x16384",
                t_w,
                lambda m: _flops([16384], [16384], nheads, headdim, False, m, window=(1024, 0)),
                note_w,
            )
            print(
                f"{tag} window(1024,0) 16k / causal 8x2k time: "
                + ", ".join(f"{m} {t_w[m] / t_c[m]:.2f}" for m in t_w if m in t_c)
            )
        if "off" in cases and base is not None:
            for causal in (False, True):
                for batch, seqlen in ((8, 2048), (1, 16384)):
                    inputs = _dense(batch, seqlen, nheads, headdim, dtype)
                    now, old = _api_dense(flashattn2, causal=causal), _api_dense(base, causal=causal)
                    note = _check(now, _ref_dense(causal=causal), [t[:1, :1024] for t in inputs])
                    acc = {"now": {}, "base": {}}
                    for _ in range(ROUNDS if not note else 0):  # alternate: drift hits both alike
                        for name, call in (("base", old), ("now", now)):
                            for m, ms in time_modes(call, inputs, modes).items():
                                acc[name].setdefault(m, []).append(ms)
                    med = {k: {m: sorted(v)[len(v) // 2] for m, v in d.items()} for k, d in acc.items()}
                    c = "causal" if causal else "full"
                    fl = lambda m, c=causal, b=batch, s=seqlen: _flops([s] * b, [s] * b, nheads, headdim, c, m)  # noqa: E731
                    out.add(
                        f"off-{c}-{batch}x{seqlen}",
                        f"core ({baseline})",
                        attention,
                        f"{batch}x{seqlen}",
                        med["base"],
                        fl,
                        note,
                    )
                    out.add(
                        f"off-{c}-{batch}x{seqlen}",
                        "features off",
                        attention,
                        f"{batch}x{seqlen}",
                        med["now"],
                        fl,
                        note,
                    )
                    print(f"{tag} features off vs core {c} {batch}x{seqlen}: " + _pair(med["now"], med["base"], fl, fl))
        if "on" in cases:
            batch, seqlen = 4, 4096
            inputs = _dense(batch, seqlen, nheads, headdim, dtype)
            slopes = torch.rand(nheads, device="cuda") * 0.1
            variants = [
                ("off", {}),
                ("window (-1,-1) given", dict(window_size=(-1, -1))),
                ("softcap 30", dict(softcap=30.0)),
                ("alibi", dict(alibi_slopes=slopes)),
                ("window (1024,1024)", dict(window_size=(1024, 1024))),
            ]
            for causal in (False, True):
                c = "causal" if causal else "full"
                base_times = None
                for name, opts in variants + [("dropout 0.1", dict(dropout_p=0.1))]:
                    call = _api_dense(flashattn2, causal=causal, **opts)
                    note = ""
                    if "dropout_p" not in opts:  # dropout is checked by the test suite against S_dmask
                        note = _check(call, _ref_dense(causal=causal, **opts), [t[:1, :1024] for t in inputs])
                    times = {} if note else time_modes(call, inputs, modes)
                    fl = lambda m, c=causal: _flops([seqlen] * batch, [seqlen] * batch, nheads, headdim, c, m)  # noqa: E731
                    out.add(f"on-{c}", name, attention, f"{batch}x{seqlen}", times, fl, note)
                    if name == "off":
                        base_times = times
                    else:
                        print(f"{tag} {c} {name} vs off (same-FLOP TFLOP/s ratio): " + _pair(times, base_times, fl, fl))
        if "sinks" in cases:
            _sinks(out, attention, dtype, modes)
        if "dv" in cases:
            headdims.dv_case(out, dtype_name, dtype, modes)
        if "d512" in cases:
            headdims.d512_case(out, dtype_name, dtype, modes)
        if "mla" in cases:
            headdims.mla_case(out, dtype_name, dtype)
    return out.rows


def _sinks(out, attention: Attention, dtype, modes):
    """The sinks case (module docstring): prefill / training, then decoding."""
    dtype_name, headdim, nheads = attention
    tag = f"{dtype_name} d{headdim}"
    sink = (torch.randn(nheads, device="cuda") * 2).requires_grad_()
    for causal in (False, True):
        c = "causal" if causal else "full"
        for seqlen in SINK_LENGTHS:
            batch = 16384 // seqlen
            inputs = _dense(batch, seqlen, nheads, headdim, dtype)
            calls = {
                "no sink": _api_dense(flashattn2, causal=causal),
                "sink": _api_dense(flashattn2, causal=causal, learnable_sink=sink),
            }
            note = _check(calls["sink"], _ref_dense(causal=causal, learnable_sink=sink), [t[:1, :1024] for t in inputs])
            med = alternated(calls, lambda call: time_modes(call, inputs, modes), SINK_ROUNDS) if not note else {}
            fl = lambda m, c=causal, b=batch, s=seqlen: _flops([s] * b, [s] * b, nheads, headdim, c, m)  # noqa: E731
            for name in calls:
                out.add(f"sinks-{c}", name, attention, f"{batch}x{seqlen}", med.get(name, {}), fl, note)
            if med:
                print(f"{tag} {c} {batch}x{seqlen} sink vs none: " + _pair(med["sink"], med["no sink"], fl, fl))
    _sinks_decode(out, dtype_name, dtype, headdim)


def _sinks_decode(out, dtype_name, dtype, headdim):
    """flash_attn_with_kvcache with and without a sink, GB/s of K/V read, CUDA graphs."""
    from ..api import set_kvcache_checks
    from .decode import _time

    nheads, nheads_k, cache_len = 32, 4, 8192
    attention = Attention(dtype=dtype_name, headdim=headdim, nheads=nheads)
    sink = torch.randn(nheads, device="cuda")
    previous = set_kvcache_checks(False)
    try:
        for batch in (8, 64):
            for splits in (1, 0):
                k_cache = torch.randn(batch, cache_len, nheads_k, headdim, device="cuda", dtype=dtype)
                v_cache = torch.randn_like(k_cache)
                q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=dtype)
                lens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")

                def step(s, q=q, k=k_cache, v=v_cache, lens=lens, splits=splits):
                    return lambda: flashattn2.flash_attn_with_kvcache(
                        q, k, v, cache_seqlens=lens, num_splits=splits, learnable_sink=s
                    )

                calls = {"no sink": step(None), "sink": step(sink)}
                med = alternated(calls, lambda call: {"fwd": _time(call, "graph")}, SINK_ROUNDS)
                read = 2 * k_cache.numel() * k_cache.element_size()
                shape = f"{batch}x{cache_len} GQA {nheads}/{nheads_k} splits {splits or 'auto'}"
                for name, times in med.items():
                    out.add(
                        "sinks-decode",
                        name,
                        attention,
                        shape,
                        times,
                        lambda m, read=read: read * 1e3,
                        "GB/s",
                    )
                ratio = med["no sink"]["fwd"] / med["sink"]["fwd"]
                print(f"{dtype_name} d{headdim} decode {shape}: sink speed / none {ratio:.3f}")
    finally:
        set_kvcache_checks(previous)


def _pair(a, b, fa, fb) -> str:
    """'mode ratio' of real-token TFLOP/s of a over b."""
    parts = []
    for m in a:
        if m in b:
            parts.append(f"{m} {(fa(m) / a[m]) / (fb(m) / b[m]):.3f}")
    return ", ".join(parts) or "not measured"


def markdown(path) -> str:
    """One table per case: the latest row of each variant and mode (runs may differ between
    cases, never within one: a case's variants are measured together), TFLOP/s and the ratio to
    the case's first variant, with the git sha of the run."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    heads = [r for r in rows if r["case"].startswith(headdims.CASES)]  # tables by length (bench/headdims.py)
    rows = [r for r in rows if not r["case"].startswith(headdims.CASES)]
    if not rows:
        return headdims.markdown(heads) if heads else "no rows"
    latest: dict = {}
    for r in rows:
        latest[(r["case"], r["dtype"], r["headdim"], r["variant"], r["mode"])] = r
    meta = rows[-1]
    lines = [
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. TFLOP/s counted per "
        "sequence from the pairs each query sees; x = ratio of TFLOP/s to the case's first row (the same "
        "run); for `window`, x is time(row) / time(first).\n"
    ]
    table: dict = {}
    for (case, dtype, d, variant, mode), r in latest.items():
        table.setdefault((case, dtype, d), {}).setdefault(variant, {})[mode] = r
    for (case, dtype, d), variants in table.items():
        first = next(iter(variants.values()))
        modes = list(first)
        shas = sorted({r["git_sha"] for v in variants.values() for r in v.values()})
        lines.append(f"### {case}, {dtype}, headdim {d} (git {', '.join(shas)})\n")
        head = ["variant", "shape"] + [f"{m} TFLOP/s" for m in modes] + [f"x {m}" for m in modes]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for name, by_mode in variants.items():
            any_row = next(iter(by_mode.values()))
            cells = [name, any_row["shape"]]
            cells += [by_mode[m]["tflops"] if m in by_mode else "–" for m in modes]
            for m in modes:
                if m not in by_mode or m not in first:
                    cells.append("–")
                elif case == "window":
                    cells.append(f"{float(by_mode[m]['ms']) / float(first[m]['ms']):.2f} (time)")
                else:
                    cells.append(f"{float(by_mode[m]['tflops']) / float(first[m]['tflops']):.3f}")
            lines.append("| " + " | ".join(cells) + " |")
            if any_row["note"]:
                lines.append(f"| note: {any_row['note']} |")
        lines.append("")
    if heads:
        lines.append(headdims.markdown(heads))
    return "\n".join(lines)
