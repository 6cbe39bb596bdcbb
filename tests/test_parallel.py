"""flashattn2.parallel: ring, zigzag ring and Ulysses attention equal flash_attn over the gathered sequence.

In this process every rank of a SimulatedGroup (communication by copies) at the suite's sizes; across processes,
2 and 4 gloo ranks spawned by the test (tests/parallel_ranks.py), each compared bit for bit with the simulated
run and against the reference; and the ring's plan (which blocks each rank computes) against the global mask,
exhaustively on small cases.
"""

import ast
import inspect
import itertools
import os
import pathlib
import random
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import flashattn2
from conftest import DEVICE, ON_GPU, skip_without_interpreter
from flashattn2 import parallel
from flashattn2.errors import ArgumentError
from flashattn2.parallel import functions, plan
from flashattn2.parallel.layout import chunks_of, num_chunks
from tolerance import check_against_reference

# at GPU sizes each test takes GiBs (every simulated rank's sequence on one GPU): the GPU suite runs them apart
pytestmark = pytest.mark.big_memory

FUNCS = {
    "ring": (parallel.ring_flash_attn_func, "contiguous"),
    "zigzag": (parallel.zigzag_ring_flash_attn_func, "zigzag"),
    "ulysses": (parallel.ulysses_flash_attn_func, "contiguous"),
}
VARLEN_FUNCS = {
    "ring": (parallel.ring_flash_attn_varlen_func, "contiguous"),
    "zigzag": (parallel.zigzag_ring_flash_attn_varlen_func, "zigzag"),
    "ulysses": (parallel.ulysses_flash_attn_varlen_func, "contiguous"),
}
MASKS = [
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window_size=(13, 0), softcap=3.0), id="causal-window13-softcap"),
    pytest.param(dict(window_size=(7, 5)), id="window7-5"),
]
if ON_GPU:
    # (world, batch, seqlen (global), nheads, nheads_k, headdim)
    DENSE = [(4, 2, 4096, 8, 2, 128), (8, 1, 16384, 8, 8, 64), (2, 1, 2048, 4, 2, 256)]
    DOCS = [[3000, 1, 517, 4096, 2, 6670], [16384]]
else:
    DENSE = [(2, 1, 48, 2, 1, 32), (3, 2, 36, 3, 3, 16)]
    DOCS = [[13, 1, 21, 0, 13], [48]]


def _stack_shards(x, world, layout, dim):
    return torch.stack([parallel.shard(x, world, r, layout, dim) for r in range(world)])


def _leaf(t):
    return t.detach().clone().requires_grad_()


# --- the plan: every (query, key) pair of the global mask in exactly one block ------------------------------


def _allowed(qp, kp, causal, window, doc_of):
    if doc_of is not None and (doc_of[qp] is None or doc_of[qp] != doc_of[kp]):
        return False
    d = kp - qp
    left, right = window
    if causal and d > 0:
        return False
    return (left < 0 or d >= -left) and (right < 0 or d <= right)


def _block_pairs(blk, q_pos, k_pos):
    """Global (query, key) positions a block's flash_attn call attends, its causal/window at the bottom-right."""
    pairs = set()
    segments = [(0, blk.q_rows[1] - blk.q_rows[0], 0, blk.k_rows[1] - blk.k_rows[0])]
    if blk.cu_q is not None:
        segments = [(a, b, c, d) for a, b, c, d in zip(blk.cu_q, blk.cu_q[1:], blk.cu_k, blk.cu_k[1:])]
    left, right = blk.window
    for qa, qb, ka, kb in segments:
        corner = (kb - ka) - (qb - qa)
        for i in range(qb - qa):
            for j in range(kb - ka):
                d = j - i - corner
                if (blk.causal and d > 0) or (left >= 0 and d < -left) or (right >= 0 and d > right):
                    continue
                pairs.add((q_pos[blk.q_rows[0] + qa + i], k_pos[blk.k_rows[0] + ka + j]))
    return pairs


def _positions(sharding, rank):
    c = sharding.chunk
    return [chunk * c + i for chunk in chunks_of(rank, sharding.world, sharding.layout) for i in range(c)]


def _plan_cases():
    rng = random.Random(7)
    for world, layout in itertools.product((1, 2, 3, 4), ("contiguous", "zigzag")):
        n = num_chunks(world, layout)
        for _ in range(6):
            seqlen = n * rng.randint(1, 5)
            cu = None
            if rng.random() < 0.6:
                cuts = sorted(rng.randint(0, seqlen) for _ in range(rng.randint(0, 4)))
                cu = (0, *cuts, seqlen)
            causal = rng.random() < 0.5
            window = rng.choice([(-1, -1), (-1, -1), (rng.randint(0, 9), -1), (rng.randint(0, 9), rng.randint(0, 9))])
            yield world, layout, seqlen, cu, causal, window


def test_each_door_builds_the_request_in_its_fields_order():
    """Each public function builds its ParallelRequest positionally in its signature's order (the dense ones with
    cu_seqlens and max_seqlen None): its parameters, those two added where absent, are the request's fields."""
    fields = functions.ParallelRequest._fields
    doors = [n for n in dir(functions) if n.endswith("_func") and "packed" not in n]
    assert len(doors) == 6, doors
    for name in doors:
        door = getattr(functions, name)
        params = list(inspect.signature(door).parameters)
        passed = list(params)
        if "cu_seqlens" not in params:
            params[3:3] = ["cu_seqlens", "max_seqlen"]
            passed[3:3] = [None, None]
        assert tuple(params) == fields, name
        (built,) = [
            node
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(door))))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ParallelRequest"
        ]
        assert [getattr(a, "id", getattr(a, "value", "?")) for a in built.args] == passed, name


@pytest.mark.parametrize("world, layout, seqlen, cu, causal, window", list(_plan_cases()))
def test_plan_covers_the_mask_once(world, layout, seqlen, cu, causal, window):
    sharding = plan.Sharding(world, layout, seqlen, cu)
    doc_of = None
    if cu is not None:
        doc_of = [None] * seqlen
        for d, (a, b) in enumerate(zip(cu, cu[1:])):
            for p in range(a, b):
                doc_of[p] = d
    for rank in range(world):
        q_pos = _positions(sharding, rank)
        want = {(qp, kp) for qp in q_pos for kp in range(seqlen) if _allowed(qp, kp, causal, window, doc_of)}
        got = []
        for src in range(world):
            for blk in plan.blocks(sharding, rank, src, causal, window):
                got.extend(_block_pairs(blk, q_pos, _positions(sharding, src)))
        assert len(got) == len(set(got)), f"rank {rank}: a pair is computed twice"
        assert set(got) == want, (
            f"rank {rank}: missing {sorted(want - set(got))[:5]}, extra {sorted(set(got) - want)[:5]}"
        )


def test_plan_calls_one_block_per_step_without_a_window():
    """Dense causal zigzag: the rank's own keys in one causal call, every other step one full call (as
    ring-flash-attention's kernels are called), so the ring adds no launches."""
    sharding = plan.Sharding(4, "zigzag", 64)
    for rank, src in itertools.product(range(4), range(4)):
        blocks = plan.blocks(sharding, rank, src, True, (-1, -1))
        assert len(blocks) == 1
        assert blocks[0].causal == (rank == src)


# --- every rank in this process -----------------------------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("algorithm", list(FUNCS))
@pytest.mark.parametrize("shape", DENSE, ids=lambda s: "w{}-b{}-s{}-h{}-hk{}-d{}".format(*s))
def test_dense_matches_the_reference(shape, algorithm, mask):
    world, batch, seqlen, nheads, nheads_k, d = shape
    func, layout = FUNCS[algorithm]
    if algorithm == "ulysses" and nheads % world:
        pytest.skip("Ulysses needs nheads divisible by the world size")
    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, nheads_k, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in "kv")
    shards = [_leaf(_stack_shards(t, world, layout, 1)) for t in (q, k, v)]
    out, lse, none = func(*shards, return_attn_probs=True, group=parallel.SimulatedGroup(world), **mask)
    assert none is None and out.shape == shards[0].shape and lse.shape == (world, batch, nheads, seqlen // world)
    do = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=dtype)
    grads = torch.autograd.grad(out, shards, _stack_shards(do, world, layout, 1))
    gathered = [parallel.unshard(list(g), layout, 1) for g in grads]
    check_against_reference(
        q, k, v, parallel.unshard(list(out), layout, 1), parallel.unshard(list(lse), layout, 2), gathered, do, **mask
    )


@pytest.mark.parametrize("mask", MASKS[1:3])
@pytest.mark.parametrize("algorithm", list(VARLEN_FUNCS))
@pytest.mark.parametrize("lengths", DOCS, ids=["mixed", "one-document"])
def test_varlen_matches_each_document_alone(lengths, algorithm, mask):
    world = 4 if ON_GPU else 2
    func, layout = VARLEN_FUNCS[algorithm]
    n = num_chunks(world, layout)
    lengths = lengths + ([n - sum(lengths) % n] if sum(lengths) % n else [])  # padding: a document of its own
    total, nheads, nheads_k, d = sum(lengths), 4, 2, 64
    dtype = torch.bfloat16
    q = torch.randn(total, nheads, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(total, nheads_k, d, device=DEVICE, dtype=dtype) for _ in "kv")
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    shards = [_leaf(_stack_shards(t, world, layout, 0)) for t in (q, k, v)]
    group = parallel.SimulatedGroup(world)
    out, lse, _ = func(*shards, cu, max(lengths), return_attn_probs=True, group=group, **mask)
    do = torch.randn(total, nheads, d, device=DEVICE, dtype=dtype)
    grads = torch.autograd.grad(out, shards, _stack_shards(do, world, layout, 0))
    out, lse = parallel.unshard(list(out), layout, 0), parallel.unshard(list(lse), layout, 1)
    dq, dk, dv = (parallel.unshard(list(g), layout, 0) for g in grads)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        if a == b:
            continue
        doc = [_leaf(t[a:b][None]) for t in (q, k, v)]
        grads_doc = [g[a:b][None] for g in (dq, dk, dv)]
        check_against_reference(*doc, out[a:b][None], lse[:, a:b][None], grads_doc, do[a:b][None], **mask)


def test_ulysses_takes_alibi_and_gqa_below_the_world():
    world, batch, seqlen, nheads, d = (4, 1, 64, 4, 32) if not ON_GPU else (4, 2, 4096, 8, 128)
    q = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, 2, d, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in "kv")
    slopes = torch.rand(batch, nheads, device=DEVICE) * 0.3
    shards = [_leaf(_stack_shards(t, world, "contiguous", 1)) for t in (q, k, v)]
    out, lse, _ = parallel.ulysses_flash_attn_func(
        *shards, causal=True, alibi_slopes=slopes, return_attn_probs=True, group=parallel.SimulatedGroup(world)
    )
    do = torch.randn(batch, seqlen, nheads, d, device=DEVICE, dtype=torch.float16)
    grads = torch.autograd.grad(out, shards, _stack_shards(do, world, "contiguous", 1))
    gathered = [parallel.unshard(list(g), "contiguous", 1) for g in grads]
    check_against_reference(
        q, k, v, parallel.unshard(list(out), "contiguous", 1), parallel.unshard(list(lse), "contiguous", 2),
        gathered, do, causal=True, alibi_slopes=slopes,
    )  # fmt: skip


def test_ulysses_dropout_is_each_rank_s_heads_own_call():
    """With dropout each rank's heads take flash_attn_func's own call (a seed each, drawn in rank order)."""
    world, seqlen, nheads, d = 2, 64, 4, 32
    q, k, v = (torch.randn(1, seqlen, nheads, d, device=DEVICE, dtype=torch.float16) for _ in "qkv")
    shards = [_stack_shards(t, world, "contiguous", 1) for t in (q, k, v)]
    torch.manual_seed(11)
    out = parallel.ulysses_flash_attn_func(*shards, dropout_p=0.3, causal=True, group=parallel.SimulatedGroup(world))
    torch.manual_seed(11)
    heads = nheads // world
    want = [
        flashattn2.flash_attn_func(*(t[:, :, r * heads : (r + 1) * heads] for t in (q, k, v)), 0.3, causal=True)
        for r in range(world)
    ]
    assert torch.equal(parallel.unshard(list(out), "contiguous", 1), torch.cat(want, dim=2))


def test_lse_gradient_flows_through_the_ring():
    world, seqlen, nheads, d = 2, 32, 2, 16
    q, k, v = (torch.randn(1, seqlen, nheads, d, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in "qkv")
    shards = [_leaf(_stack_shards(t, world, "zigzag", 1)) for t in (q, k, v)]
    out, lse, _ = parallel.zigzag_ring_flash_attn_func(
        *shards, causal=True, return_attn_probs=True, group=parallel.SimulatedGroup(world)
    )
    do = torch.randn(1, seqlen, nheads, d, device=DEVICE, dtype=torch.float16)
    dlse = torch.randn(1, nheads, seqlen, device=DEVICE)
    grads = torch.autograd.grad(
        (out, lse), shards, (_stack_shards(do, world, "zigzag", 1), _stack_shards(dlse, world, "zigzag", 2))
    )
    gathered = [parallel.unshard(list(g), "zigzag", 1) for g in grads]
    check_against_reference(
        q, k, v, parallel.unshard(list(out), "zigzag", 1), parallel.unshard(list(lse), "zigzag", 2), gathered, do,
        causal=True, dlse=dlse,
    )  # fmt: skip


def test_packed_forms_equal_the_unpacked():
    world, seqlen, nheads, d = 2, 32, 2, 16
    qkv = torch.randn(world, 1, seqlen // world, 3, nheads, d, device=DEVICE, dtype=torch.float16)
    group = parallel.SimulatedGroup(world)
    q, k, v = qkv.unbind(3)
    for packed, plain in (
        (parallel.ring_flash_attn_qkvpacked_func, parallel.ring_flash_attn_func),
        (parallel.zigzag_ring_flash_attn_qkvpacked_func, parallel.zigzag_ring_flash_attn_func),
    ):
        assert torch.equal(packed(qkv, causal=True, group=group), plain(q, k, v, causal=True, group=group))
    kv = qkv[:, :, :, 1:]
    for packed, plain in (
        (parallel.ring_flash_attn_kvpacked_func, parallel.ring_flash_attn_func),
        (parallel.zigzag_ring_flash_attn_kvpacked_func, parallel.zigzag_ring_flash_attn_func),
    ):
        assert torch.equal(packed(q, kv, group=group), plain(q, k, v, group=group))


# --- layouts and errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", parallel.LAYOUTS)
def test_shard_unshard_round_trip(layout):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [parallel.shard(x, 3, r, layout) for r in range(3)]
    assert torch.equal(parallel.unshard(shards, layout), x)
    if layout == "zigzag":
        assert shards[0][0, :, 0].tolist() == [0, 3, 6, 9, 60, 63, 66, 69]  # chunks 0 and 5 of 6
    assert torch.equal(parallel.gather(torch.stack(shards), parallel.SimulatedGroup(3), layout), x)


def test_errors_name_the_argument():
    group = parallel.SimulatedGroup(2)
    q = torch.randn(2, 1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ArgumentError, match="layout"):
        parallel.shard(q[0], 2, 0, "striped")
    with pytest.raises(ArgumentError, match="multiple of 4"):
        parallel.shard(torch.zeros(1, 6), 2, 0, "zigzag")
    with pytest.raises(ArgumentError, match="SimulatedGroup of 2 ranks"):
        parallel.ring_flash_attn_func(q[0], q[0], q[0], group=group)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        parallel.ring_flash_attn_func(q, q, q, alibi_slopes=torch.ones(2, device=DEVICE), group=group)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        parallel.zigzag_ring_flash_attn_func(q, q, q, dropout_p=0.1, group=group)
    with pytest.raises(NotImplementedError, match="nheads"):
        three = torch.randn(2, 1, 8, 3, 16, device=DEVICE, dtype=torch.float16)
        parallel.ulysses_flash_attn_func(three, three, three, group=group)
    packed = torch.randn(2, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    local_cu = torch.tensor([0, 8], dtype=torch.int32)  # ring-flash-attention's per-rank cu_seqlens
    with pytest.raises(ArgumentError, match="global packed batch"):
        parallel.ring_flash_attn_varlen_func(packed, packed, packed, local_cu, 8, group=group)
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel.ring_flash_attn_func(q[0], q[0], q[0])


# --- ranks in processes of their own (gloo, the CPU interpreter) ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_the_simulated_group(world):
    skip_without_interpreter()
    script = pathlib.Path(__file__).with_name("parallel_ranks.py")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, str(script), str(world), str(_free_port())], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(": ok") == {2: 4, 4: 3}[world], run.stdout


@pytest.mark.parametrize("algorithm", ["zigzag", "ring", "ulysses"])
def test_context_parallel_attention_is_flash_cross_attention_on_shards(algorithm):
    from flashattn2.modules.mha import FlashCrossAttention

    world, seqlen, nheads, d = 2, 32, 2, 16
    q = torch.randn(1, seqlen, nheads, d, device=DEVICE, dtype=torch.float16)
    kv = torch.randn(1, seqlen, 2, nheads, d, device=DEVICE, dtype=torch.float16)
    inner = parallel.ContextParallelAttention(causal=True, algorithm=algorithm, group=parallel.SimulatedGroup(world))
    out = inner(_stack_shards(q, world, inner.layout, 1), _stack_shards(kv, world, inner.layout, 1))
    want = FlashCrossAttention(causal=True)(q, kv)
    assert (parallel.unshard(list(out), inner.layout, 1) - want).abs().max().item() < 2e-3
    with pytest.raises(ArgumentError, match="algorithm"):
        parallel.ContextParallelAttention(algorithm="stripe")
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        inner(q, kv, cu_seqlens=None)
