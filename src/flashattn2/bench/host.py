"""Host time per call (`python -m flashattn2 bench host`): what a call costs its caller beside its kernels.

Each entry point is called on tiny inputs, many times, beside torch's own attention doing a whole tiny call and an
empty torch.library custom op, in the same run and the same rounds (alternated, the median of each):

- on the CPU, through Triton's interpreter with every launch replaced by a no-op (ops.launch.launcher.stubbed): what is
  timed is the Python path a call takes around its launches;
- on a GPU, with real launches, each call enqueued without a sync (the host's time until the call returns).

The calls repeat one spec each (ops.run.call: what a training or decoding loop does), so what is timed is the prepared
call's path. Launches per call are counted (on the CPU: the stubbed launches). Correctness is not this bench's: the
same calls are the suite's (tests/).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import flashattn2
from ..flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from ..ops.launch import launcher

FIELDS = ["case", "us", "ratio", "against", "launches", "device", "torch", "triton", "date", "git_sha"]


@torch.library.custom_op("flashattn2_bench::empty", mutates_args=())
def _empty_op(x: torch.Tensor) -> None:
    """A custom op that does nothing: the dispatcher's own cost."""


def cases(device: str) -> dict:
    """name -> (a call, the peer its ratio is against). Tiny shapes: a decode step (bf16, 32 query heads over 8 K/V
    heads, headdim 128, a cache of 64, one new token appended or none), a dense and a varlen forward (bf16, 2 heads,
    headdim 64, 4 tokens), forward + backward, the packed forms and the private functions ring-attention libraries
    call. The peers: SDPA's tiny call in fp32 (batch 1, 2 heads, 4 tokens, headdim 64; on a GPU in bf16) and the
    same with its backward."""
    bf16 = torch.bfloat16
    gen = dict(device=device, dtype=bf16)
    q1 = torch.randn(1, 1, 32, 128, **gen)
    kc, vc = torch.randn(1, 64, 8, 128, **gen), torch.randn(1, 64, 8, 128, **gen)
    kn, vn = torch.randn(1, 1, 8, 128, **gen), torch.randn(1, 1, 8, 128, **gen)
    seqlens = torch.tensor([10], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(1, 4, 2, 64, **gen) for _ in range(3))
    qkv = torch.randn(1, 4, 3, 2, 64, **gen)
    qv, kv, vv = (t.view(4, 2, 64) for t in (q, k, v))
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qkvg = qkv.clone().requires_grad_()
    peer_dtype = torch.float32 if device == "cpu" else bf16
    sq, sk, sv = (torch.randn(1, 2, 4, 64, device=device, dtype=peer_dtype) for _ in range(3))
    sqg, skg, svg = (t.clone().requires_grad_() for t in (sq, sk, sv))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    out, lse = _flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)[:2]
    dout = torch.randn_like(out)
    x = torch.randn(4, device=device)
    fwd, fwd_bwd = "sdpa forward", "sdpa forward + backward"
    return {
        fwd: (lambda: F.scaled_dot_product_attention(sq, sk, sv), None),
        fwd_bwd: (lambda: F.scaled_dot_product_attention(sqg, skg, svg).sum().backward(), None),
        "empty custom op": (lambda: _empty_op(x), fwd),
        "with_kvcache, append": (
            lambda: flashattn2.flash_attn_with_kvcache(q1, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True),
            fwd,
        ),
        "with_kvcache": (lambda: flashattn2.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens), fwd),
        "func forward": (lambda: flashattn2.flash_attn_func(q, k, v, causal=True), fwd),
        "varlen forward": (lambda: flashattn2.flash_attn_varlen_func(qv, kv, vv, cu, cu, 2, 2, causal=True), fwd),
        "qkvpacked forward": (lambda: flashattn2.flash_attn_qkvpacked_func(qkv, causal=True), fwd),
        "func forward + backward": (
            lambda: flashattn2.flash_attn_func(qg, kg, vg, causal=True).sum().backward(),
            fwd_bwd,
        ),
        "qkvpacked forward + backward": (
            lambda: flashattn2.flash_attn_qkvpacked_func(qkvg, causal=True).sum().backward(),
            fwd_bwd,
        ),
        "_flash_attn_forward": (lambda: _flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False), fwd),
        "_flash_attn_backward": (
            lambda: _flash_attn_backward(
                dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, True, -1, -1, 0.0, None, False
            ),
            fwd,
        ),
    }


def _time(fn, calls: int, sync) -> float:
    """Host microseconds per call over `calls` calls (enqueued; sync() after, outside the timed span)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def measure(device: str, rounds: int = 7, calls: int = 500) -> list[dict]:
    """Each case's median host microseconds per call over `rounds` alternated rounds, its ratio to its peer, and its
    launches per call."""
    cpu = device == "cpu"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    table = cases(device)
    counted: dict = {}
    for name, (fn, _) in table.items():  # warm: compile, prepare, and count the launches of one call
        record: list = []
        for _ in range(3):
            fn()
        if cpu:
            with launcher.stubbed(record):
                fn()
        counted[name] = len(record) if cpu else None
    times: dict = {name: [] for name in table}
    with launcher.stubbed() if cpu else _nothing():
        for r in range(rounds):
            order = list(table) if r % 2 == 0 else list(reversed(table))
            for name in order:
                fn = table[name][0]
                for _ in range(calls // 10):
                    fn()
                times[name].append(_time(fn, calls, sync))
    rows = []
    for name, (_, peer) in table.items():
        us = statistics.median(times[name])
        ratio = us / statistics.median(times[peer]) if peer else None
        rows.append(dict(case=name, us=round(us, 2), ratio=None if ratio is None else round(ratio, 2), against=peer or "",
                         launches=counted[name]))  # fmt: skip
    return rows


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Host time per call, {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
        f"git {meta['git_sha']}); median of alternated rounds",
        "",
        "| case | µs per call | × peer | peer | launches per call |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        launches = "" if row["launches"] is None else str(row["launches"])
        lines.append(f"| {row['case']} | {row['us']:.1f} | {ratio} | {row['against']} | {launches} |")
    return "\n".join(lines)


def main(csv_path: str | None, md_path: str | None, rounds: int) -> int:
    import datetime

    import triton

    from .kernels import git_sha

    device = "cuda" if torch.cuda.is_available() and not _interpreted() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # one core's path, as the peers run theirs
        name = "cpu"
    else:
        name = torch.cuda.get_device_name()
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), git_sha=git_sha())  # fmt: skip
    rows = measure(device, rounds=rounds)
    text = markdown(rows, meta)
    print(text)
    if csv_path:
        from .results import appending

        with appending(csv_path, FIELDS) as (writer, _):
            for row in rows:
                writer.writerow({**row, **meta})
    if md_path:
        with open(md_path, "w") as fh:
            fh.write(text + "\n")
    return 0


def _interpreted() -> bool:
    from ..ops import _runtime

    return _runtime.interpreted()
