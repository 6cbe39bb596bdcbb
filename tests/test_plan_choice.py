"""The plan's choices, as the launches show them: which kernel and tile the table picks for a call (the
forward's and backward's kernel choice, the Gluon backward's grid and rings, the persistent forward's tiles, the
short-tile rows), the rules behind them, and force()'s scope (per thread, nested, the backward under its
forward's)."""

import pytest
import torch

import flashattn2
from cases import CAUSAL, make_qkv, shape_id
from conftest import DEVICE
from flashattn2.ops import _runtime, planning
from flashattn2.ops.launch import launch_gluon
from flashattn2.ops.request import spec
from flashattn2.ops.planning import tables
from flashattn2.ops.run import call as calls
from flashattn2.ops.request.request import AttentionRequest
from spies import GLUON_BWD, GLUON_FWD, HOPPER, spy_launches
from tolerance import check_against_reference

T = planning.TileConfig
force = planning.force


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "causal",
        "gqa-bf16",
        "d256",
        "softcap",
        "window",
        "alibi",
        "d96",
        "fp32",
        "hopper-off",
        "sm80",
        "varlen",
        "d64-long",
        "d128-short",
        "d128-long",
    ],
)
def test_forward_kernel_choice(case, monkeypatch):
    """The Gluon forward runs on sm_90 exactly for dense fp16/bf16 inputs, head dim 64/128/256,
    causal or not and nothing else, unless force(hopper=False) turns it off; everything else (and the CPU) takes
    the Triton kernel. At head dim 64 and 128 it is the persistent kernel, at 256 the warp-specialized one."""
    launched = spy_launches(monkeypatch)
    d = {"d256": 256, "d96": 96}.get(case, 128 if case.startswith("d128") else 64)
    dtype = {"gqa-bf16": torch.bfloat16, "fp32": torch.float32}.get(case, torch.float16)
    # past the short-key rows (on the CPU every case takes the Triton kernel: short keys will do)
    seqlen_k = {"d64-long": 2049, "d128-long": 4097}.get(case, 130) if HOPPER else 130
    q, k, v = make_qkv((2, 100, seqlen_k, 4, 2 if case == "gqa-bf16" else 4, d), dtype, requires_grad=False)
    kwargs = dict(
        causal=case == "causal",
        softcap=5.0 if case == "softcap" else 0.0,
        window_size=(16, 3) if case == "window" else (-1, -1),
        alibi_slopes=torch.rand(4, device=DEVICE) if case == "alibi" else None,
    )
    with force(hopper=False if case == "hopper-off" else None, arch="sm80" if case == "sm80" else None):
        if case == "varlen":
            cu = torch.tensor([0, 100, 200], device=DEVICE, dtype=torch.int32)
            flashattn2.flash_attn_varlen_func(
                q.flatten(0, 1), k[:, :100].flatten(0, 1), v[:, :100].flatten(0, 1), cu, cu, 100, 100
            )
        else:
            flashattn2.flash_attn_func(q, k, v, **kwargs)
    persist = HOPPER and case in ("plain", "causal", "gqa-bf16", "d64-long", "d128-short", "d128-long")
    ws = HOPPER and case == "d256"
    expected = "attn_fwd_persist_kernel" if persist else "attn_fwd_ws_kernel" if ws else "attn_fwd_kernel"
    assert launched[0] == expected, launched


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("causal", CAUSAL)
def test_gluon_backward_many_heads(causal, monkeypatch, fresh_plans):
    """batch * nheads_k past 65535 (CUDA's limit on a grid's second and third axes; the Gluon backward had (batch,
    kv head) on one of them until its grid grouped the heads) runs the Gluon backward on a grid whose groups of
    heads bring the third axis under it, and its gradients are right."""
    launched = spy_launches(monkeypatch)
    grids = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "grid")
    q, k, v = make_qkv((16385, 2, 3, 4, 4, 128), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert "attn_bwd_ws_kernel" in launched and "attn_bwd_dkdv_kernel" not in launched, launched
    # 65540 heads = 4 * 16385: causal, as many per group as 24 MB of Q and dO hold (a divisor); else raised from 1 to 2
    assert grids == [((16385, 1, 4) if causal else (2, 1, 32770),)], grids
    check_against_reference(q, k, v, out, lse, grads, do, causal)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
def test_gluon_backward_key_blocks_limit(monkeypatch, fresh_plans):
    """More key blocks than CUDA's 65535 on the Gluon backward's second grid axis (lowered here to 4, so that 300
    keys are past it) take the Triton backward, and its gradients are right."""
    monkeypatch.setattr(planning.dense, "_GRID_YZ", 4)
    launched = spy_launches(monkeypatch)
    q, k, v = make_qkv((2, 200, 300, 4, 2, 128), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert "attn_bwd_dkdv_kernel" in launched and "attn_bwd_ws_kernel" not in launched, launched
    check_against_reference(q, k, v, out, lse, grads, do, True)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("groups", ["head-major", "3", "all"])
@pytest.mark.parametrize(
    "shape",
    [(3, 700, 700, 6, 2, 128), (3, 1000, 1000, 5, 5, 256), (4, 333, 900, 3, 3, 64), (6, 640, 512, 4, 4, 128)],
    ids=shape_id,
)
def test_gluon_backward_grid_order(shape, groups, monkeypatch, fresh_plans):
    """The Gluon backward's grid (G, key blocks, heads / G), whose shape is the programs' order (kernels/bwd_hopper_config
    ._ws_program), with G = 1 (force(bwd_order="head-major"), where the L2 budget would give 3), 3 and every head
    in one group, causal (bottom-right aligned where seqlen_q != seqlen_k): every (key block, head) pair runs once,
    so the gradients match the reference; the launch took the grid asked for. (That CUDA starts the programs in the
    order the grouping intends is not tested: a transposed mapping would cover the pairs too.)"""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, d = shape
    head_bytes = 2 * seqlen_q * d * 2 * (nheads // nheads_k)
    n_bh = batch * nheads_k
    want = {"head-major": 1, "3": 3, "all": n_bh}[groups]
    monkeypatch.setattr(planning.dense, "L2_GROUP_BYTES", max(want, 3) * head_bytes + 1)
    grids = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "grid")
    q, k, v = make_qkv(shape, torch.bfloat16)
    with force(bwd_order="head-major" if groups == "head-major" else None):  # the backward runs under the forward's
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    block_n = planning.lookup("sm90", q.dtype, d, True, seqlen_k, GLUON_BWD, "bwd").tile.block_n
    assert grids == [((want, -(-seqlen_k // block_n), n_bh // want),)], grids
    check_against_reference(q, k, v, out, lse, grads, do, True)


def test_gluon_backward_grid_rule():
    """The Gluon backward's program order: causal plans group heads within planning.L2_GROUP_BYTES, non-causal
    ones are head-major (0), unless force(bwd_order=...) says otherwise. launch_gluon.l2_heads: 1 for a budget of
    0, else as many heads as the budget holds, at least 1 and at most all. launch_gluon.bwd_grid: the largest
    divisor of the heads not above that (whole groups), raised where the third axis would pass 65535."""
    order = lambda causal: planning.lookup("sm90", torch.float16, 128, causal, 4096, GLUON_BWD, "bwd").l2_group_bytes
    budget = planning.L2_GROUP_BYTES
    assert (order(True), order(False)) == (budget, 0)
    with force(bwd_order="head-major"):
        assert (order(True), order(False)) == (0, 0)
    with force(bwd_order="grouped"):
        assert (order(True), order(False)) == (budget, budget)
    l2_heads, bwd_grid, divisors = launch_gluon.l2_heads, launch_gluon.bwd_grid, launch_gluon._divisors
    assert l2_heads(0, 64, 1024) == 1
    assert l2_heads(budget, 64, budget // 6) == 6
    assert l2_heads(budget, 4, budget // 6) == 4
    assert l2_heads(budget, 64, budget * 2) == 1
    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(65540) == [d for d in range(1, 65541) if 65540 % d == 0]
    assert bwd_grid(64, 32, 6) == (4, 64, 8)
    assert bwd_grid(64, 32, 1) == (1, 64, 32)
    assert bwd_grid(3, 7, 6) == (1, 3, 7)  # a prime count of heads: head-major
    assert bwd_grid(3, 12, 100) == (12, 3, 1)
    assert bwd_grid(1, 65540, 1) == (2, 1, 32770)  # the third axis within 65535
    assert bwd_grid(1, 2 * 65537, 1) == (65537, 1, 2)
    assert bwd_grid(1, 65537, 1) == (65537, 1, 1)  # prime: every head in one group


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 1000, 1000, 8, 8, 256),
        (1, 333, 1029, 4, 2, 256),
        (2, 1537, 700, 6, 1, 256),
        (1, 2048, 2048, 4, 4, 128),
        (1, 999, 1300, 8, 2, 128),
        (2, 700, 900, 4, 4, 64),
    ],
    ids=shape_id,
)
@pytest.mark.parametrize("causal", CAUSAL)
def test_gluon_backward_rings(shape, dtype, causal, monkeypatch):
    """The Gluon backward's two ring layouts, as the table gives them: at headdim 256 the split ring (dO in a ring
    of its own released after dV, two Q stages, dQ_i staged in column halves), elsewhere one ring; against the
    reference: tails of both lengths, GQA and MQA, seqlen_q != seqlen_k, causal or not."""
    q, k, v = make_qkv(shape, dtype)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    do = torch.randn_like(out)
    split = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "SPLIT_RING", "DQ_SPLIT")
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert split == [(shape[-1] == 256, 2 if shape[-1] == 256 else 1)], split
    check_against_reference(q, k, v, out, lse, grads, do, causal)


def test_plan_rule(monkeypatch, fresh_plans):
    """planning.plan: where the Gluon kernels can run (Features.gluon), the persistent forward at head dims 64 and
    128 (exactly: 59 takes the Triton kernel), the warp-specialized one at 256, the Gluon backward (split ring at 256 only) for
    deterministic=False; the Triton kernels for anything else (another head dim, fp32, varlen, a score
    modifier, deterministic=True, no Gluon), and under force(hopper=False) or FLASHATTN2_HOPPER=0, which
    force(hopper=True) overrides."""
    fwd = lambda d, dtype=torch.float16, f=GLUON_FWD: planning.lookup("sm90", dtype, d, False, 4096, f, "fwd").kernel
    bwd = lambda d, f=GLUON_BWD: planning.lookup("sm90", torch.bfloat16, d, True, 4096, f, "bwd")
    assert [fwd(d) for d in (64, 128, 256, 59, 96)] == ["fwd_hopper_persist"] * 2 + ["fwd_hopper_ws", "fwd", "fwd"]
    assert fwd(128, torch.float32) == fwd(128, f=planning.Features()) == "fwd"
    assert fwd(128, f=planning.Features(gluon=True, varlen=True)) == "fwd"
    assert fwd(128, f=planning.Features(gluon=True, score_mods=True)) == "fwd"
    assert [bwd(d).kernel for d in (64, 128, 256, 96)] == ["bwd_hopper"] * 3 + ["bwd_dkdv"]
    assert [dict(bwd(d).constexprs)["SPLIT_RING"] for d in (64, 128, 256)] == [False, False, True]
    assert bwd(128, planning.Features(gluon=True)).kernel == "bwd_dkdv"  # deterministic
    assert bwd(128).dq_tile is None and bwd(96).dq_tile is not None
    with force(hopper=False):
        assert fwd(128) == "fwd" and bwd(128).kernel == "bwd_dkdv"
    monkeypatch.setattr(_runtime, "_GLUON_SWITCH", False)  # FLASHATTN2_HOPPER=0
    planning._lookup.cache_clear()
    assert fwd(128) == "fwd"
    with force(hopper=True):
        assert fwd(128) == "fwd_hopper_persist"
    # the interpreter: its one tile for every kernel, forced tiles before it
    interp = planning.lookup("interp", torch.float16, 128, False, 4096, GLUON_BWD, "bwd")
    assert (interp.kernel, interp.tile, interp.dq_tile) == ("bwd_dkdv", tables.INTERP, tables.INTERP)
    with force(bwd_dq=T(16, 16, 4, 1)):
        assert planning.lookup("interp", torch.float16, 128, False, 4096, GLUON_BWD, "bwd").dq_tile == T(16, 16, 4, 1)


def test_backward_runs_under_its_forwards_force(monkeypatch):
    """A backward through autograd re-enters its forward's force() state in whatever thread autograd runs it (on
    a GPU the engine's worker thread; here a thread of its own): the forced dK/dV and dQ tiles launch."""
    import threading

    q, k, v = make_qkv((1, 40, 40, 2, 2, 32), torch.float16)
    with force(hopper=False, bwd_dkdv=T(16, 32, 4, 1), bwd_dq=T(32, 16, 4, 1)):
        out = flashattn2.flash_attn_func(q, k, v)
    tiles = spy_launches(monkeypatch, None)
    dkdv = spy_launches(monkeypatch, "attn_bwd_dkdv_kernel", "BLOCK_M", "BLOCK_N")
    dq = spy_launches(monkeypatch, "attn_bwd_dq_kernel", "BLOCK_M", "BLOCK_N")
    grads = []
    thread = threading.Thread(target=lambda: grads.append(torch.autograd.grad(out.float().sum(), (q, k, v))))
    thread.start(), thread.join()
    assert dkdv == [(16, 32)] and dq == [(32, 16)] and len(grads) == 1, tiles


def test_force_is_per_thread_and_nests():
    """force() holds its settings in a context variable: another thread sees none of them; an inner force()
    keeps what the outer one set unless it sets it again; leaving restores."""
    import threading

    seen = []
    with force(hopper=False, fwd=T(32, 32, 4, 1)):
        thread = threading.Thread(target=lambda: seen.append(planning.forced()))
        thread.start(), thread.join()
        with force(tma=True, fwd=T(16, 16, 4, 1)):
            inner = planning.forced()
        outer = planning.forced()
    assert seen == [planning.Forced()]
    assert (inner.hopper, inner.tma, inner.tile("fwd")) == (False, True, T(16, 16, 4, 1))
    assert (outer.hopper, outer.tma, outer.tile("fwd")) == (False, None, T(32, 32, 4, 1))
    assert planning.forced() == planning.Forced()
    with pytest.raises(ValueError, match="bwd_order must be one of"):
        with force(bwd_order="sideways"):
            pass
    with pytest.raises(ValueError, match="unknown kernel"):
        with force(fwd_hopper=T(64, 64, 4, 2)):
            pass


@pytest.mark.skipif(not HOPPER, reason="the persistent Gluon forward runs on an H100/H200 only")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL)
def test_persistent_forward_many_tiles_per_program(d, causal, monkeypatch):
    """The persistent forward with a grid of 3 programs (as if the GPU had 3 SMs), so each runs
    many tiles: the K/V ring and the Q buffers carried across tiles, GQA, a ragged last query tile
    (a half past seqlen_q; causal: a first tile with a half before row 0) and seqlen_q != seqlen_k;
    against the reference, then the gradients."""
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 3)
    launched = spy_launches(monkeypatch)
    # 300 query rows: the last tile (128 rows at d128, 256 at d64) has its second half past the end
    q, k, v = make_qkv((3, 300, 461, 8, 2, d), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert launched[0] == "attn_fwd_persist_kernel", launched
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, causal)


# persistent-forward tiles beyond the table's: three consumer warpgroups (w12), 64-key blocks at d128
PERSIST_TILES = [
    pytest.param(64, T(64, 128, 12, 2), id="d64-64x128w12s2"),
    pytest.param(64, T(64, 128, 12, 3), id="d64-64x128w12s3"),
    pytest.param(64, T(64, 128, 8, 2), id="d64-64x128w8s2"),
    pytest.param(64, T(128, 64, 8, 3), id="d64-128x64w8s3"),
    pytest.param(64, T(64, 64, 12, 4), id="d64-64x64w12s4"),
    pytest.param(128, T(64, 64, 8, 2), id="d128-64x64w8s2"),
    pytest.param(128, T(64, 64, 12, 2), id="d128-64x64w12s2"),
    pytest.param(128, T(64, 64, 12, 3), id="d128-64x64w12s3"),
    pytest.param(128, T(64, 64, 12, 3, qbuf=1), id="d128-64x64w12s3q1"),
    pytest.param(64, T(64, 128, 12, 3, qbuf=1), id="d64-64x128w12s3q1"),
]


@pytest.mark.skipif(not HOPPER, reason="the persistent Gluon forward runs on an H100/H200 only")
@pytest.mark.parametrize("d, tile", PERSIST_TILES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("grid", [3, None], ids=["3-programs", "all-sms"])
def test_persistent_forward_tiles(d, tile, causal, grid, monkeypatch):
    """The persistent forward with each tile it may be given (two or three consumer warpgroups): a
    ragged last tile whose later parts lie past seqlen_q (300 rows: 192-row tiles leave 108, one part
    and a half; causal: the tiles aligned to the last row, a first tile whose first part lies before
    row 0), GQA, seqlen_q != seqlen_k both ways, bf16 too, and on a grid of 3 programs the
    rings and Q buffers carried across many tiles, 2400 rows (10-19 tiles a head), and 40 keys (one
    key block: a tile's ring units are K_0 alone, then V_0 alone); NaN-filled outputs (every element
    written)."""
    if grid is not None:
        monkeypatch.setattr(_runtime, "sm_count", lambda device: grid)
    launched = spy_launches(monkeypatch, "attn_fwd_persist_kernel", "CONSUMERS", "BLOCK_N", "QBUF")
    for dtype, shape in (
        (torch.float16, (3, 300, 461, 8, 2, d)),
        (torch.bfloat16, (2, 461, 300, 4, 4, d)),
        (torch.float16, (1, 64, 1000, 6, 3, d)),
        (torch.float16, (1, 2400, 2400, 3, 1, d)),
        (torch.float16, (2, 200, 40, 4, 2, d)),
    ):
        q, k, v = make_qkv(shape, dtype)
        with force(fwd_hopper_persist=tile):
            out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_against_reference(q, k, v, out, lse, None, None, causal)
    qbuf = tile.qbuf or 2  # the tile's Q buffers where it names them
    assert launched == [(tile.num_warps // 4, tile.block_n, qbuf)] * 5, launched


@pytest.mark.skipif(not HOPPER, reason="the persistent Gluon forward runs on an H100/H200 only")
@pytest.mark.parametrize("d, seqlen_k", [(128, 130), (128, 700), (64, 130), (64, 2049)])
def test_short_tile_launch(d, seqlen_k, monkeypatch):
    """A causal call launches the tile planning.plan gives for its key length, with that tile's Q buffers (d128 up
    to 512 keys: one per consumer; past it two), and is right."""
    launched = spy_launches(monkeypatch, "attn_fwd_persist_kernel", "BLOCK_M", "BLOCK_N", "STAGES", "QBUF", "CONSUMERS")
    q, k, v = make_qkv((2, 100, seqlen_k, 4, 2, d), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_against_reference(q, k, v, out, lse, None, None, True)
    plan = planning.lookup("sm90", torch.float16, d, True, seqlen_k, GLUON_FWD, "fwd")
    tile, extra = plan.tile, dict(plan.constexprs)
    assert launched == [(tile.block_m, tile.block_n, tile.num_stages, extra["QBUF"], extra["CONSUMERS"])], launched
    assert extra["QBUF"] == (1 if (d, seqlen_k) == (128, 130) else 2)


def test_short_tiles():
    """Rows with a key-length bound: each one's tile from the bound before it (exclusive) up to its own, the next
    row's past it; the causal flag apart; a forced tile beats every row."""

    def kernel_of(d, causal, n, dv=None):
        return planning.lookup("sm90", torch.float16, d, causal, n, GLUON_FWD, "fwd", dv)

    bounded = [r for r in planning.TABLE if r.max_seqlen_k is not None]
    assert bounded
    for row in bounded:
        same = [
            r
            for r in planning.TABLE
            if (r.direction, r.arch, r.head_dim, r.elem_bytes, r.kernel, r.head_dim_v)
            == (row.direction, row.arch, row.head_dim, row.elem_bytes, row.kernel, row.head_dim_v)
            and r.causal in (None, row.causal)
        ]
        # the Gluon head-dim pair the row is read for (a row bounded by v's bucket: its narrower pair, 192/128)
        ((d, dv),) = [
            p
            for p in planning.GLUON_HEAD_DIMS[row.direction]
            if planning.head_dim_bucket(p[0]) == row.head_dim and (p[0] == p[1]) == (row.head_dim_v is None)
        ]
        before = [r.max_seqlen_k for r in same[: same.index(row)] if r.max_seqlen_k is not None]
        shorter = max(before, default=0)
        assert kernel_of(d, row.causal, shorter + 1, dv).tile == row.tile
        assert kernel_of(d, row.causal, row.max_seqlen_k, dv).tile == row.tile
        assert kernel_of(d, row.causal, row.max_seqlen_k + 1, dv).tile != row.tile
    assert kernel_of(128, False, 512).tile == kernel_of(128, False, 16384).tile  # no short row there
    with force(fwd_hopper_persist=T(64, 64, 8, 2)):
        assert kernel_of(64, True, 512).tile == kernel_of(64, False, 99999).tile == T(64, 64, 8, 2)


def test_table_rows():
    """Every row names a kernel and a direction it belongs to, says why in one line, and each (direction, arch,
    head-dim bucket, bytes) ends in a Triton row without bounds (so every call has a plan)."""
    fwd_kernels = {"fwd", "fwd_hopper_persist", "fwd_hopper_ws"}
    groups = {}
    for row in planning.TABLE:
        assert row.kernel in planning.KERNELS and (row.kernel in fwd_kernels) == (row.direction == "fwd"), row
        assert row.why and "\n" not in row.why and len(row.why) < 120, row
        assert (row.dq_tile is not None) == (row.kernel == "bwd_dkdv"), row
        groups.setdefault((row.direction, row.arch, row.head_dim, row.elem_bytes), []).append(row)
    for key, rows in groups.items():
        last = rows[-1]
        assert last.kernel in ("fwd", "bwd_dkdv") and last.causal is None and last.max_seqlen_k is None, key
    for arch in planning.ARCHS[:3]:
        for d in planning.HEAD_DIM_BUCKETS:
            for elem_bytes in (2, 4):
                for direction in planning.DIRECTIONS:
                    key = (direction, arch, d, elem_bytes)
                    assert (key in groups) != (key in planning.UNSUPPORTED), key


def test_spec_keys():
    """The spec every cache keys on (ops.request.spec): it changes with what force() holds (tile or switch), the
    batch-invariant mode, the dtype, the strides, the alignment and every option, and equal arguments give equal
    specs (new tensors of the same layout included)."""
    q, k, v = make_qkv((2, 64, 64, 4, 2, 64), torch.float16, requires_grad=False)
    r = AttentionRequest(q, k, v, causal=True)
    key = spec.attention(r)
    same = r._replace(q=q.clone(), k=k.clone(), v=v.clone())
    assert key == spec.attention(same) and hash(key) == hash(spec.attention(same))
    with force(fwd_hopper_persist=T(64, 64, 8, 2)):
        assert spec.attention(r) != key
    with force(hopper=False):
        assert spec.attention(r) != key
    with flashattn2.batch_invariant():
        assert spec.attention(r) != key
    assert spec.attention(r._replace(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16())) != key
    assert spec.attention(r._replace(q=q.transpose(1, 2).contiguous().transpose(1, 2))) != key
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    assert spec.attention(r._replace(q=unaligned)) != key
    alibi = torch.rand(4, device=q.device)
    changes = dict(causal=False, window_size=(3, -1), softcap=1.5, alibi_slopes=alibi, learnable_sink=alibi[:4],
                   deterministic=True, softmax_scale=0.5, dropout_p=0.1)  # fmt: skip
    for name, other in changes.items():
        assert spec.attention(r._replace(**{name: other})) != key, name
    with pytest.raises(spec.NotCanonical):  # a list: validated and normalized first (ops.run.call)
        spec.attention(r._replace(window_size=[-1, -1]))


@pytest.mark.skipif(not HOPPER, reason="the Gluon paths (whose launches are kept) run on an H100/H200 only")
@pytest.mark.parametrize("causal", CAUSAL)
def test_plans_repeated_signature(causal, monkeypatch):
    """A call whose spec was seen before runs from its prepared call (ops.run.call: the Gluon launches kept on it): new
    inputs of the same shapes, NaN-filled outputs, against the reference; a force() between the calls is seen
    (another tile launches)."""
    monkeypatch.setattr(calls, "CALLS", calls.Calls())
    launched = spy_launches(monkeypatch, "attn_fwd_persist_kernel", "BLOCK_M", "BLOCK_N", "STAGES")
    shape = (2, 300, 300, 8, 2, 128)  # a ragged last tile: the backward pads lse
    for _ in range(2):
        q, k, v = make_qkv(shape, torch.float16)
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        check_against_reference(q, k, v, out, lse, grads, do, causal)
        (call,) = set(calls.CALLS._calls.values())
        assert call.launch is not None and len(call.backwards) == 1
    tile = T(64, 64, 8, 2)
    with force(fwd_hopper_persist=tile):
        q, k, v = make_qkv(shape, torch.float16)
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_against_reference(q, k, v, out, lse, None, None, causal)
    assert len(set(calls.CALLS._calls.values())) == 2
    assert launched[0] == launched[1] != launched[2] == (64, 64, 2), launched


def test_persistent_constexprs():
    """The persistent forward's num_warps counts its consumer warps: 8 or 12, nothing else; its Q buffers are the
    tile's where it names them, else 2; the snake order under a causal mask."""

    def plan(tile, d=64, causal=True):
        with force(fwd_hopper_persist=tile):
            return planning.lookup("sm90", torch.float16, d, causal, 4096, GLUON_FWD, "fwd")

    assert dict(plan(T(64, 128, 12, 2)).constexprs) == dict(QBUF=2, SNAKE=True, CONSUMERS=3)
    assert dict(plan(T(64, 128, 8, 2), 128, False).constexprs) == dict(QBUF=2, SNAKE=False, CONSUMERS=2)
    assert plan(T(64, 128, 12, 2)).num_warps == 4 and plan(T(64, 128, 12, 2)).rows == 192
    for warps in (4, 16):
        with pytest.raises(ValueError, match="num_warps"):
            plan(T(64, 128, warps, 2))
    assert dict(plan(T(64, 64, 12, 3, qbuf=1), 128).constexprs)["QBUF"] == 1
    for qbuf in (0, 3):
        with pytest.raises(ValueError, match="qbuf"):
            T(64, 64, 12, 3, qbuf=qbuf)
    with pytest.raises(ValueError, match="qbuf.*fwd_hopper_persist.*fwd_hopper_ws"):
        with force(fwd_hopper_ws=T(64, 128, 4, 2, qbuf=1)):
            pass
    with pytest.raises(TypeError, match="fwd_hopper_persist must be a TileConfig"):
        with force(fwd_hopper_persist=(64, 64, 12, 3)):
            pass


def test_tile_text():
    """A tile as bench ab and the tools write and read it: 'MxNwWsS', 'q' and the Q buffers after it where set."""
    for tile in (T(64, 128, 12, 3), T(64, 64, 12, 3, qbuf=1), T(128, 32, 4, 2)):
        assert planning.parse_tile(str(tile)) == tile
    assert str(T(64, 64, 12, 3, qbuf=1)) == "64x64w12s3q1" and str(T(64, 64, 12, 3)) == "64x64w12s3"
    # a different tile for the plan keys and planning.forced()
    assert T(64, 64, 12, 3, qbuf=1) != T(64, 64, 12, 3) and hash(T(64, 64, 12, 3, qbuf=1)) != hash(T(64, 64, 12, 3))
    for text in ("64x64w12", "64x64w12s3q", "default", "64x64w12s3q1x"):
        assert planning.parse_tile(text) is None


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "causal-gqa",
        "d256-bf16",
        "d128",
        "deterministic",
        "hopper-off",
        "softcap",
        "dropout",
        "d96",
        "varlen",
        "sm80",
    ],
)
def test_backward_kernel_choice(case, monkeypatch):
    """The Gluon backward (warp-specialized) runs on sm_90 exactly for deterministic=False
    (flash_attn's default), dense fp16/bf16 inputs, head dim 64/128/256, causal or not and nothing
    else, unless force(hopper=False) turns it off; everything else (and the CPU) takes the
    Triton dK/dV and dQ kernels."""
    d = {"d256-bf16": 256, "d96": 96, "d128": 128}.get(case, 64)
    dtype = torch.bfloat16 if case == "d256-bf16" else torch.float16
    q, k, v = make_qkv((2, 100, 130, 4, 2 if case == "causal-gqa" else 4, d), dtype)
    kwargs = dict(
        causal=case == "causal-gqa",
        softcap=5.0 if case == "softcap" else 0.0,
        dropout_p=0.1 if case == "dropout" else 0.0,
        deterministic=case == "deterministic",
    )
    with force(hopper=False if case == "hopper-off" else None, arch="sm80" if case == "sm80" else None):
        if case == "varlen":
            cu = torch.tensor([0, 100, 200], device=DEVICE, dtype=torch.int32)
            out = flashattn2.flash_attn_varlen_func(
                q.flatten(0, 1), k[:, :100].flatten(0, 1), v[:, :100].flatten(0, 1), cu, cu, 100, 100
            )
        else:
            out = flashattn2.flash_attn_func(q, k, v, **kwargs)
        launched = spy_launches(monkeypatch)  # the backward's launches only
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    gluon = HOPPER and case in ("plain", "causal-gqa", "d256-bf16", "d128")
    expected, other = ("attn_bwd_ws_kernel", "attn_bwd_dkdv_kernel")[:: 1 if gluon else -1]
    assert expected in launched and other not in launched, launched
