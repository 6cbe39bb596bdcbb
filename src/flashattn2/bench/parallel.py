"""python -m flashattn2 bench parallel: context parallelism, causal forward and forward + backward, per-GPU TFLOP/s.

Two ways to run it:
- **One GPU** (a plain `python -m flashattn2 bench parallel`): every rank of a SimulatedGroup runs on this GPU,
  one after another, the communication replaced by copies. The time is the sum of the ranks' compute, so the
  global FLOPs over it is the per-GPU rate of a ring whose communication hides entirely behind the compute:
  what the kernels, the block planning and the merges cost. Beside it, single-GPU flashattn2 on the per-GPU
  length (seqlen / world): the yardstick (per-GPU TFLOP/s >= 0.9x of it).
- **Several GPUs** (`torchrun --nproc-per-node N -m flashattn2 bench parallel`): each rank on its GPU over NCCL;
  per-GPU TFLOP/s is the global FLOPs / N over the slowest rank's time. Beside it, in the same run, PyTorch's
  own context parallelism (torch.distributed.tensor.experimental.context_parallel, SDPA's cuDNN kernel under it,
  K/V heads repeated to the query heads) and single-GPU flashattn2 on the per-GPU length.

Each algorithm is checked against flash_attn_func on a short sequence before anything is timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flashattn2
from flashattn2 import parallel
from flashattn2.parallel.module import ALGORITHMS  # name -> (function, layout), as ContextParallelAttention's

from .kernels import problems, run_metadata
from .providers import attention_flops
from .results import appending
from ..reference import BWD_FACTOR, FWD_FACTOR

FIELDS = [
    "gpu",
    "torch",
    "triton",
    "date",
    "git_sha",
    "transport",
    "world",
    "algorithm",
    "seqlen",
    "per_gpu_seqlen",
    "batch",
    "nheads",
    "nheads_k",
    "headdim",
    "dtype",
    "mode",
    "ms",  # per GPU: the slowest rank's, or simulated, the ranks' total / world
    "tflops_per_gpu",
    "vs_one_gpu",
    "problem",
]


@dataclass(frozen=True)
class Shape:
    """What every point shares but its length: batch sequences of nheads query heads and nheads_k K/V heads of
    headdim, in dtype."""

    batch: int = 1
    nheads: int = 32
    nheads_k: int = 8
    headdim: int = 128
    dtype: torch.dtype = torch.bfloat16

    def inputs(self, seqlen: int, leading=()) -> list[torch.Tensor]:
        """Random q, k, v of seqlen tokens a sequence, behind the `leading` dimensions (the simulated ranks)."""
        return [
            torch.randn(*leading, self.batch, seqlen, h, self.headdim, device="cuda", dtype=self.dtype)
            for h in (self.nheads, self.nheads_k, self.nheads_k)
        ]

    def flops(self, seqlen: int, mode: str) -> float:
        """Causal attention over seqlen tokens a sequence, as the paper counts it."""
        return attention_flops(self.batch, self.nheads, seqlen, seqlen, self.headdim, True, mode)


def _time(fn, reps: int) -> float:
    """Median ms of fn() over reps timed calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _step(call, leaves, mode):
    if mode == "fwd":

        def fwd():
            with torch.no_grad():
                call(*leaves)

        return fwd
    out = call(*leaves)
    do = torch.randn_like(out)
    del out
    return lambda: torch.autograd.grad(call(*leaves), leaves, do)


def _check(algorithm, group, world, shape: Shape) -> str:
    """'' when the algorithm's forward and backward obey flash_attn's rule on 2 x 1024 tokens of shape's heads
    (gathered against single-GPU flashattn2 and the reference), else what does not."""
    from ..reference import attention_ref

    func, layout = ALGORITHMS[algorithm]
    seqlen = 2048 if world <= 8 else 256 * world
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do, k, v = (
        torch.randn(1, seqlen, h, shape.headdim, device="cuda", dtype=shape.dtype, generator=g)
        for h in (shape.nheads, shape.nheads, shape.nheads_k, shape.nheads_k)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref_out, _ = attention_ref(q, k, v, causal=True)
    low_out, _ = attention_ref(q, k, v, causal=True, upcast=False)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.float())
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    simulated = isinstance(group, parallel.SimulatedGroup)
    if simulated:
        cut = lambda t: torch.stack([parallel.shard(t, world, r, layout) for r in range(world)])  # noqa: E731
    else:
        rank = torch.distributed.get_rank(group)
        cut = lambda t: parallel.shard(t, world, rank, layout)  # noqa: E731
    leaves = [cut(t.detach()).requires_grad_() for t in (q, k, v)]
    out = func(*leaves, causal=True, group=group)
    grads = torch.autograd.grad(out, leaves, cut(do))
    whole = [parallel.gather(t, group, layout) for t in (out, *grads)]
    results = [("out", whole[0], ref_out, low_out, FWD_FACTOR)]
    results += [(f"d{n}", a, r, lo, BWD_FACTOR) for n, a, r, lo in zip("qkv", whole[1:], ref_grads, low_grads)]
    return problems(results)


def _tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def _slowest(ms: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _torch_context_parallel(world, shape: Shape, seqlen):
    """PyTorch's context parallelism over SDPA's cuDNN kernel: (call, leaves, stop). context_parallel shards the
    full-length (batch, nheads, seqlen, headdim) buffers in place when entered (each rank keeps its load-balanced
    shard) and routes SDPA to its ring while it stays entered; the leaves are those shards, requiring grad."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    size = (shape.batch, shape.nheads, seqlen, shape.headdim)
    buffers = [torch.randn(*size, device="cuda", dtype=shape.dtype) for _ in range(3)]
    context = context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers))
    context.__enter__()
    leaves = [b.detach().requires_grad_() for b in buffers]

    def call(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return call, leaves, lambda: context.__exit__(None, None, None)


def run(
    path: str,
    seqlens: list[int],
    worlds: list[int],
    algorithms: list[str],
    modes: list[str],
    shape: Shape = Shape(),
    reps: int = 3,
) -> None:
    """Append one row per (world, algorithm, seqlen, mode) to the CSV at path (rank 0 writes)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if distributed:
        worlds = [dist.get_world_size()]
    meta = run_metadata()
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[shape.dtype]
    rows = []
    for world in worlds:
        group = None if distributed else parallel.SimulatedGroup(world)
        checks = {a: _check(a, group, world, shape) for a in algorithms}
        for seqlen in seqlens:
            per_gpu = seqlen // world
            base = dict(
                meta,
                transport="nccl" if distributed else "simulated",
                world=world,
                seqlen=seqlen,
                per_gpu_seqlen=per_gpu,
                batch=shape.batch,
                nheads=shape.nheads,
                nheads_k=shape.nheads_k,
                headdim=shape.headdim,
                dtype=dtype_name,
            )
            one = {}  # single-GPU flashattn2 on the per-GPU length: TFLOP/s per mode
            leaves = [t.requires_grad_() for t in shape.inputs(per_gpu)]
            for mode in modes:
                call = lambda q, k, v: flashattn2.flash_attn_func(q, k, v, causal=True)  # noqa: E731
                ms = _time(_step(call, leaves, mode), reps)
                one[mode] = _tflops(shape.flops(per_gpu, mode), ms)
                rows.append(
                    dict(
                        base,
                        algorithm="flashattn2-1gpu",
                        mode=mode,
                        ms=f"{ms:.3f}",
                        tflops_per_gpu=f"{one[mode]:.1f}",
                        vs_one_gpu="1.00",
                    )
                )
            del leaves
            for algorithm in algorithms:
                func, _ = ALGORITHMS[algorithm]
                leading = () if distributed else (world,)
                shards = shape.inputs(per_gpu, leading)
                leaves = [t.requires_grad_() for t in shards]
                for mode in modes:
                    call = lambda q, k, v: func(q, k, v, causal=True, group=group)  # noqa: E731
                    ms = _time(_step(call, leaves, mode), reps)
                    # the step ends with the slowest rank; simulated, the ranks ran one after another
                    per_gpu_ms = _slowest(ms) if distributed else ms / world
                    rate = _tflops(shape.flops(seqlen, mode) / world, per_gpu_ms)
                    rows.append(
                        dict(
                            base,
                            algorithm=algorithm,
                            mode=mode,
                            ms=f"{per_gpu_ms:.3f}",
                            tflops_per_gpu=f"{rate:.1f}",
                            vs_one_gpu=f"{rate / one[mode]:.2f}",
                            problem=checks[algorithm],
                        )
                    )
                del leaves, shards
            if distributed:
                rows.extend(_torch_rows(base, world, shape, seqlen, modes, reps, one))
            torch.cuda.empty_cache()
    if rank == 0:
        with appending(path, FIELDS) as (writer, _):
            for row in rows:
                writer.writerow(row)
        for row in rows:
            print(", ".join(f"{k}={row.get(k, '')}" for k in FIELDS[5:]))


def _torch_rows(base, world, shape: Shape, seqlen, modes, reps, one):
    """PyTorch's context parallelism at one point, beside `one` (single-GPU flashattn2's TFLOP/s per mode)."""
    rows = []
    try:
        call, leaves, stop = _torch_context_parallel(world, shape, seqlen)
        for mode in modes:
            ms = _slowest(_time(_step(call, leaves, mode), reps))
            rate = _tflops(shape.flops(seqlen, mode) / world, ms)
            rows.append(
                dict(
                    base,
                    algorithm="torch-context-parallel-cudnn",
                    mode=mode,
                    ms=f"{ms:.3f}",
                    tflops_per_gpu=f"{rate:.1f}",
                    vs_one_gpu=f"{rate / one[mode]:.2f}",
                    nheads_k=shape.nheads,
                )
            )
        stop()
    except Exception as e:  # noqa: BLE001  (a peer that cannot run is a row saying why, not a crash)
        rows.append(dict(base, algorithm="torch-context-parallel-cudnn", problem=f"{type(e).__name__}: {e}"[:300]))
    return rows


def markdown(path: str) -> str:
    import csv

    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    lines = [
        "| transport | world | seqlen | per GPU | algorithm | mode | ms | TFLOP/s per GPU | vs 1 GPU | problem | git, date |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['transport']} | {r['world']} | {r['seqlen']} | {r['per_gpu_seqlen']} | {r['algorithm']} | "
            f"{r['mode']} | {r['ms']} | {r['tflops_per_gpu']} | {r['vs_one_gpu']} | {r['problem']} | "
            f"{r['git_sha']}, {r['date']} |"
        )
    first = rows[0] if rows else {}
    head = f"{first.get('gpu', '')}, torch {first.get('torch', '')}, triton {first.get('triton', '')}"
    return f"Context parallelism, causal, {head}\n\n" + "\n".join(lines)
