"""Run by tests/test_parallel.py: `python tests/parallel_ranks.py WORLD PORT` spawns WORLD gloo ranks on the CPU
(the kernels through Triton's interpreter: TRITON_INTERPRET=1 in the environment). Each case runs on every rank's
shard; the gathered results must equal the same algorithm on a SimulatedGroup bit for bit (rank 0 checks) and the
reference within flash_attn's tolerance rule. Exits non-zero on the first mismatch."""

import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (algorithm, varlen, options, nheads, nheads_k, documents (varlen) or (batch, seqlen))
CASES = {
    2: [
        ("ring", False, dict(causal=True), 4, 2, (2, 16)),
        ("zigzag", True, dict(causal=True), 2, 1, [5, 1, 14, 4]),
        ("ulysses", True, dict(causal=True), 2, 2, [9, 15]),
        ("zigzag", False, dict(causal=True, window_size=(5, 0)), 2, 2, (1, 24)),
    ],
    4: [
        ("zigzag", False, dict(causal=True), 4, 2, (1, 32)),
        ("ring", True, dict(causal=False), 2, 1, [3, 20, 9]),
        ("ulysses", False, dict(causal=True), 4, 2, (1, 16)),
    ],
}


def _case_inputs(case, seed):
    _, varlen, _, nheads, nheads_k, size = case
    torch.manual_seed(seed)
    if varlen:
        total = sum(size)
        shape_q, shape_k = (total, nheads, 16), (total, nheads_k, 16)
    else:
        shape_q, shape_k = (size[0], size[1], nheads, 16), (size[0], size[1], nheads_k, 16)
    q, k, v, do = torch.randn(shape_q), torch.randn(shape_k), torch.randn(shape_k), torch.randn(shape_q)
    cu = torch.tensor([0, *itertools.accumulate(size)], dtype=torch.int32) if varlen else None
    return [t.half() for t in (q, k, v, do)], cu


def _run(func, layout, dim, q, k, v, do, cu, options, group, world, shard_of):
    from flashattn2 import parallel

    shards = [shard_of(t).detach().requires_grad_() for t in (q, k, v)]
    args = (cu, max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:]))) if cu is not None else ()
    out, lse, _ = func(*shards, *args, return_attn_probs=True, group=group, **options)
    grads = torch.autograd.grad(out, shards, shard_of(do))
    return [
        parallel.gather(t.detach(), group, layout, d)
        for t, d in ((out, dim), (lse, dim + 1), *((g, dim) for g in grads))
    ]


def _worker(rank, world, port):
    from flashattn2 import parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    funcs = {
        (False, "ring"): (parallel.ring_flash_attn_func, "contiguous"),
        (False, "zigzag"): (parallel.zigzag_ring_flash_attn_func, "zigzag"),
        (False, "ulysses"): (parallel.ulysses_flash_attn_func, "contiguous"),
        (True, "ring"): (parallel.ring_flash_attn_varlen_func, "contiguous"),
        (True, "zigzag"): (parallel.zigzag_ring_flash_attn_varlen_func, "zigzag"),
        (True, "ulysses"): (parallel.ulysses_flash_attn_varlen_func, "contiguous"),
    }
    for n, case in enumerate(CASES[world]):
        algorithm, varlen, options = case[:3]
        func, layout = funcs[(varlen, algorithm)]
        (q, k, v, do), cu = _case_inputs(case, 1000 + n)
        dim = 0 if varlen else 1
        got = _run(
            func,
            layout,
            dim,
            q,
            k,
            v,
            do,
            cu,
            options,
            None,
            world,
            lambda t: parallel.shard(t, world, rank, layout, dim),
        )
        if rank:
            continue
        simulated = parallel.SimulatedGroup(world)
        want = _run(
            func,
            layout,
            dim,
            q,
            k,
            v,
            do,
            cu,
            options,
            simulated,
            world,
            lambda t: torch.stack([parallel.shard(t, world, r, layout, dim) for r in range(world)]),
        )
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            if not torch.equal(a, b):
                raise AssertionError(f"world {world}, case {case}: {name} differs from the SimulatedGroup's")
        _against_reference(case, q, k, v, do, cu, got, options)
        print(f"world {world} case {n} {algorithm}{' varlen' if varlen else ''} {options}: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _against_reference(case, q, k, v, do, cu, got, options):
    """Each document (varlen) or the batch against the reference, flash_attn's tolerance rule."""
    from tolerance import check_against_reference

    out, lse, dq, dk, dv = got
    pieces = [(slice(None), None)]
    if cu is not None:
        bounds = cu.tolist()
        pieces = [(slice(a, b), True) for a, b in zip(bounds, bounds[1:]) if b > a]
    for rows, packed in pieces:
        lift = (lambda t: t[rows][None]) if packed else (lambda t: t)
        lift_lse = (lambda t: t[:, rows][None]) if packed else (lambda t: t)
        leaves = [lift(t).detach().clone().requires_grad_() for t in (q, k, v)]
        check_against_reference(*leaves, lift(out), lift_lse(lse), [lift(g) for g in (dq, dk, dv)], lift(do), **options)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    world, port = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(_worker, args=(world, port), nprocs=world)
