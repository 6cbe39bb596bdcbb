"""flash_attn_func against the reference: out, logsumexp and gradients, by flash_attn's rule."""

import random

import pytest
import torch

import flashattn2
from cases import CAUSAL, DTYPES, SHAPE_PARAMS, make_qkv, randn, shape_id
from conftest import DEVICE, ON_GPU
from flashattn2.ops import _runtime, planning
from flashattn2.ops.launch import launch_gluon, launcher
from flashattn2.ops.request import modes, spec
from flashattn2.ops.planning import tables
from flashattn2.ops.run import call as calls
from flashattn2.ops.request.request import AttentionRequest
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close, check_against_reference

T = planning.TileConfig
force = planning.force
# Kernel paths: on CUDA the table's choice (on an H200: the Gluon forward where it applies, its
# persistent kernel at head dim 64/128 and its warp-specialized one at 256, the Gluon backward, TMA with
# host-built descriptors where the inputs allow them), the Triton kernels instead of the Gluon ones,
# descriptors made in each program, the forced pointer (non-TMA) path, and the other architectures'
# rows and load path (on an H200: what an A100 or an RTX card runs); on the CPU, both load paths (TMA:
# host-built descriptors for power-of-two head dims) with tiles where BLOCK_M != BLOCK_N so masked-block
# ranges are exercised.
if ON_GPU:
    PATHS = [
        pytest.param({}, id="table"),
        pytest.param({"hopper": False}, id="triton"),
        pytest.param({"hopper": False, "host_desc": False}, id="kernel-desc"),
        pytest.param({"tma": False}, id="no-tma"),
        pytest.param({"arch": "sm80"}, id="sm80"),
        pytest.param({"arch": "sm86"}, id="sm86"),
    ]
else:
    PATHS = [
        pytest.param({}, id="ptr-64x64"),
        pytest.param(
            {
                "tma": True,
                "host_desc": True,
                "fwd": T(32, 64, 4, 1),
                "bwd_dkdv": T(16, 32, 4, 1),
                "bwd_dq": T(64, 16, 4, 1),
            },
            id="tma-mixed-tiles",
        ),
    ]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_forward_backward(shape, dtype, causal, path):
    q, k, v = make_qkv(shape, dtype)
    with force(**path):
        out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.dtype == dtype and lse.dtype == torch.float32 and s_dmask.numel() == 0
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_against_reference(q, k, v, out, lse, grads, do, causal)


def launch_keyword(kwargs: dict, name: str):
    """A launch's constexpr `name`: a keyword argument, or a field of one (kernels/constexprs.py's
    bundles, TILE.BLOCK_M)."""
    if name in kwargs:
        return kwargs[name]
    (value,) = [getattr(v, name) for v in kwargs.values() if name in getattr(v, "_fields", ())]
    return value


def spy_launches(monkeypatch, kernel_name: str | None = None, *kwargs_of: str) -> list:
    """The names of the kernels launched from now on (in this test; launcher.watched), in order; with
    kernel_name, the values of the constexprs kwargs_of of each launch of that kernel (launch_keyword; "grid":
    the grid it is launched on)."""
    launched = []
    earlier = launcher._WATCH  # spies stack

    def spy(kernel, grid, args, kwargs):
        if earlier is not None:
            earlier(kernel, grid, args, kwargs)
        if kernel_name is None:
            launched.append(kernel.__name__)
        elif kernel.__name__ == kernel_name:
            launched.append(tuple(tuple(grid) if k == "grid" else launch_keyword(kwargs, k) for k in kwargs_of))

    monkeypatch.setattr(launcher, "_WATCH", spy)  # (launcher.watched's hook, undone by monkeypatch)
    return launched


HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and _runtime.hopper_kernels() is not None
GLUON_FWD = planning.Features(gluon=True)
GLUON_BWD = planning.Features(gluon=True, deterministic=False)


@pytest.fixture
def fresh_plans(monkeypatch):
    """Empty plan caches (the prepared calls and planning's table lookups), before and after: for a test that patches
    what the plans read."""
    calls.clear()
    yield
    calls.clear()


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


@pytest.mark.parametrize("blocks", [3, 13], ids=["head-by-head", "all-heads-first"])
def test_causal_block_orders(blocks):
    """Causal grids take query blocks head by head (up to 8 per head) or the heaviest of all heads
    first (more): every block is computed once in both orders (the Triton forward and its dQ pass:
    the Gluon kernels, which an H100/H200 would take here, have their own orders)."""
    block = 64 if ON_GPU else 16
    seqlen = blocks * block - 5  # a ragged last block
    q, k, v = make_qkv((3, seqlen, seqlen + 7, 4, 2, 64 if ON_GPU else 32), torch.float16)
    tile = T(block, block, 4, 1)
    with force(fwd=tile, bwd_dq=tile, hopper=False):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, True)


@pytest.mark.parametrize("causal", CAUSAL)
def test_lse_gradient(causal):
    """The returned logsumexp is differentiable (ring attention needs it)."""
    shape = (2, 70, 90, 2, 1, 32)
    q, k, v = make_qkv(shape, torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * do).sum() + (lse * dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, do, causal, dlse=dlse)


@pytest.mark.parametrize("which", ["out-only", "lse-only"])
def test_one_output_gradient(which, monkeypatch):
    """Missing output gradients are not materialized (registry._grad_of_out): with only `out`
    used, the backward gets no lse gradient and the preprocess reads none (HAS_DLSE off); with
    only the logsumexp used, the output's gradient is zeros. Both against the reference."""
    q, k, v = make_qkv((2, 70, 90, 4, 2, 64), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    flags = spy_launches(monkeypatch, "attn_bwd_preprocess_kernel", "HAS_DLSE")
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    if which == "out-only":
        grads = torch.autograd.grad(out, (q, k, v), do)
        dlse = None
    else:
        grads = torch.autograd.grad(lse, (q, k, v), dlse)
        do = torch.zeros_like(out)
    assert flags == [(which == "lse-only",)], flags
    check_against_reference(q, k, v, out, lse, grads, do, True, dlse=dlse)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_pad, copy_lse", [(100, 128, True), (128, 128, False), (128, 128, True), (61, 64, True)]
)
@pytest.mark.parametrize("d", [64, 256])  # 64 and 32 rows per preprocess program
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_padded_preprocess(seqlen_q, seqlen_pad, copy_lse, d, with_dlse):
    """The Gluon backward's one preprocess launch (ops.launch.launch_triton.Preprocess with seqlen_pad): delta =
    rowsum(dO * O) - dlse up to seqlen_q and 0 to seqlen_pad, the fp32 dQ accumulator's padded rows
    zeroed, and where asked (a tail; the launcher also asks for a non-contiguous lse) lse copied
    with +inf past seqlen_q; every buffer starts NaN-filled. (On the CPU the interpreter runs it; on
    an H100/H200 it is what the Gluon backward runs.)"""
    from flashattn2.ops.launch import launch_triton
    from flashattn2.ops.launch.layout import Layout

    b, h = 2, 3
    out, dout = (randn(b, seqlen_q, h, d, dtype=torch.float16) for _ in range(2))
    lse = randn(b, h, seqlen_q, dtype=torch.float32)
    dlse = randn(b, h, seqlen_q, dtype=torch.float32) if with_dlse else None
    layout = Layout(spec.attention(AttentionRequest(out, out, out)), 1.0)
    delta, lse_pad = (_runtime.empty((b, h, seqlen_pad), torch.float32, out.device) for _ in range(2))
    acc = _runtime.empty((b, seqlen_pad, h, d), torch.float32, out.device)
    pre = launch_triton.Preprocess(layout, spec.tensor(out), spec.tensor(dout), with_dlse, False, seqlen_pad, copy_lse)
    pre(out, dout, lse, dlse, delta, None, lse_pad if copy_lse else None, acc)
    expected = (out.float() * dout.float()).sum(-1).transpose(1, 2)
    if with_dlse:
        expected = expected - dlse
    torch.testing.assert_close(delta[:, :, :seqlen_q], expected, rtol=1e-5, atol=1e-4)
    assert (delta[:, :, seqlen_q:] == 0).all()
    if copy_lse:
        assert torch.equal(lse_pad[:, :, :seqlen_q], lse) and torch.isposinf(lse_pad[:, :, seqlen_q:]).all()
    else:
        assert lse_pad.isnan().all()  # not written
    assert (acc == 0).all()


@pytest.mark.parametrize("layout", ["bhsd-transposed", "sliced-headdim", "last-dim-strided"])
def test_strided_inputs(layout):
    b, s, h, d = 2, 113, 4, 48
    dtype = torch.float16
    if layout == "bhsd-transposed":
        make = lambda: randn(b, h, s, d, dtype=dtype).transpose(1, 2)
    elif layout == "sliced-headdim":
        make = lambda: randn(b, s, h, d + 24, dtype=dtype)[..., 5 : 5 + d]
    else:  # stride(-1) != 1: copied, as flash_attn does
        make = lambda: randn(b, s, h, 2 * d, dtype=dtype)[..., ::2]
    q, k, v = (make().requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, True)


def test_ready_is_for_kernels_rule():
    """A prepared call proves its tensors ready by ops.run.call's reading of the spec, which must be for_kernels' own
    rule on every layout (a size-1 or empty dimension with stride 0, a last dimension of one): where they differed, a
    call copied by for_kernels would still not be ready (the fuzzer found seqlen_k 0 raising NotReady)."""
    from flashattn2.ops.run.registry import for_kernels

    rng = random.Random(0)
    base = torch.zeros(200)
    for _ in range(2000):
        ndim = rng.randint(1, 4)
        shape = [rng.choice((0, 1, 1, 2, 3)) for _ in range(ndim)]
        stride = [rng.choice((0, 1, 2, 3, 6, 12)) for _ in range(ndim)]
        t = base.as_strided(shape, stride)
        assert calls._kernel_ready(spec.tensor(t)) == (for_kernels(t) is t), (shape, stride)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_inputs_not_as_kernels_take_them_repeated(varlen):
    """A repeated call whose k is expanded (stride 0) and v strided in its last dimension copies them every time (the
    prepared call of ready tensors is never reused for them: ops.run.call.NotReady), and gives the contiguous call's
    output bit for bit; so does the contiguous call after it."""
    h, d = 4, 32
    q = randn(2, 9, h, d, dtype=torch.float16)
    k = randn(2, 11, 1, d, dtype=torch.float16).expand(2, 11, h, d)
    v = randn(2, 11, h, 2 * d, dtype=torch.float16)[..., ::2]
    if varlen:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu_q, cu_k = (torch.tensor([0, 4, n], dtype=torch.int32, device=q.device) for n in (18, 22))
        call = lambda *qkv: flashattn2.flash_attn_varlen_func(*qkv, cu_q, cu_k, 14, 18, causal=True)
    else:
        call = lambda *qkv: flashattn2.flash_attn_func(*qkv, causal=True)
    assert k.stride(-2) == 0 and v.stride(-1) == 2
    expected = call(q, k.contiguous(), v.contiguous())
    for _ in range(2):
        assert torch.equal(call(q, k, v), expected)
    assert torch.equal(call(q, k.contiguous(), v.contiguous()), expected)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_returned_lse_is_the_callers(varlen):
    """A call without return_attn_probs (and no gradient) may write its logsumexp into a buffer such calls share
    (_runtime.output_lse): a logsumexp returned to a caller is never that buffer, so later calls leave it as returned,
    and the outputs are the same with it or without."""

    def call(q, k, v, lse=False):
        if not varlen:
            return flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=lse)
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        cu = torch.tensor([0, 5, 18], dtype=torch.int32, device=q.device)
        return flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, return_attn_probs=lse)

    qkv = [randn(2, 9, 2, 32, dtype=torch.float16) for _ in range(3)]
    out, lse, _ = call(*qkv, lse=True)
    kept = lse.clone()
    for _ in range(2):
        assert torch.equal(call(*qkv), out)
        other = [randn(2, 9, 2, 32, dtype=torch.float16) for _ in range(3)]
        call(*other)
        _, lse_other, _ = call(*other, lse=True)
        assert torch.equal(lse, kept) and not torch.equal(lse_other, kept)


def test_broadcast_output_gradient():
    """out.sum() sends an expanded (stride-0) dO; the backward must not feed it to TMA as is."""
    q, k, v = make_qkv((2, 130, 130, 4, 2, 64), torch.bfloat16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    check_against_reference(q, k, v, out, lse, grads, torch.ones_like(out), True)


def test_softmax_scale():
    q, k, v = make_qkv((1, 65, 65, 2, 2, 64), torch.float16)
    out = flashattn2.flash_attn_func(q, k, v, softmax_scale=0.37)
    ref, _ = attention_ref(q, k, v, softmax_scale=0.37)
    low, _ = attention_ref(q, k, v, softmax_scale=0.37, upcast=False)
    assert_close("out", out, ref, low, FWD_FACTOR)
    # a scale that changes the result: guards against the argument being ignored
    assert (out.float() - attention_ref(q, k, v)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", CAUSAL)
def test_zero_softmax_scale(d, causal, monkeypatch):
    """softmax_scale=0 (allowed): every visible key weighs the same, so O is the mean of the visible
    values and lse the log of their count, in every forward (on an H100/H200 each Gluon kernel, the
    launch checked: the persistent one at headdim 64/128, the warp-specialized one at 256; their masked
    blocks must not turn an invisible score's -inf * 0 into NaN) and through the backward. 100 queries
    over 97 keys: causal rows 0-2 see no key (O 0, lse +inf), ragged key blocks, and the persistent
    kernel's causal tiles start before row 0."""
    if not HOPPER and d != 64:
        pytest.skip("elsewhere one kernel (kernels/fwd.py) runs every head dim: d64 checks it")
    launched = spy_launches(monkeypatch)
    sq, sk = 100, 97
    q, k, v = make_qkv((2, sq, sk, 4, 2, d), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    if HOPPER:
        expected = "attn_fwd_ws_kernel" if d == 256 else "attn_fwd_persist_kernel"
    else:
        expected = "attn_fwd_kernel"
    assert launched[0] == expected, launched
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=0.0, causal=causal)
    low, low_lse = attention_ref(q, k, v, softmax_scale=0.0, causal=causal, upcast=False)
    assert_close("out", out, ref, low, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    ref_grads = torch.autograd.grad((ref * do.to(ref.dtype)).sum(), (q, k, v))
    low_grads = torch.autograd.grad((low * do).sum(), (q, k, v))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)
    # the mean of the visible values: row i sees keys j <= i + sk - sq when causal
    rows, cols = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
    seen = (cols <= rows + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    vv = v.float().repeat_interleave(2, dim=2)  # GQA: 4 query heads over 2
    mean = torch.einsum("ij,bjhd->bihd", seen.float(), vv) / seen.sum(1).clamp(min=1)[None, :, None, None]
    assert (out.float() - mean).abs().max() < 2e-2
    blind = sq - sk if causal else 0  # rows that see no key
    assert torch.isposinf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()


@pytest.mark.parametrize("causal", CAUSAL)
def test_deterministic_bitwise(causal):
    """deterministic=True: dQ has its own pass (no atomics), repeated runs give identical bits; and on the
    Triton kernels (force(hopper=False); the CPU's only kernels) deterministic=False gives the same bits as True."""
    shape = (2, 300, 300, 4, 2, 64) if ON_GPU else (1, 97, 97, 2, 1, 32)
    q, k, v = make_qkv(shape, torch.bfloat16)
    do = randn(*q.shape, dtype=q.dtype)

    def run(deterministic, hopper=None):
        with force(hopper=hopper):
            out = flashattn2.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    for first, other in ((run(True), run(True)), (run(True, False), run(False, False))):
        for a, b in zip(first, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU, reason="races need a GPU: the interpreter runs programs one at a time")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("causal", CAUSAL)
def test_race_repeated_runs(causal, deterministic):
    """Many runs with fixed inputs give identical out, lse, dq, dk, dv (a moving result is a race).
    deterministic=False (the Gluon backward on an H100/H200) adds dQ in any order: its dQ may move
    by rounding only; dK and dV accumulate in registers and stay identical."""
    q, k, v = make_qkv((4, 2048, 2048, 16, 4, 128), torch.float16)
    do = randn(*q.shape, dtype=q.dtype)
    first = None
    for _ in range(30):
        out, lse, _ = flashattn2.flash_attn_func(
            q, k, v, causal=causal, return_attn_probs=True, deterministic=deterministic
        )
        result = (out, lse, *torch.autograd.grad(out, (q, k, v), do))
        if first is None:
            first = result
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, result):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3 * first[2].abs().max().item(), msg=name)
            else:
                assert torch.equal(a, b), name


def test_tma_alignment_rule():
    """TMA only for 16-byte aligned bases and leading strides that are nonzero 16-byte multiples."""
    from flashattn2.ops.launch.tma import use_tma

    base = torch.empty(4096, dtype=torch.float16)
    for offset, strides in [
        (0, (512, 64, 1)),
        (8, (512, 64, 1)),
        (1, (512, 64, 1)),
        (0, (520, 64, 1)),
        (0, (512, 4, 1)),
        (0, (0, 64, 1)),
        (16, (64, 0, 1)),
        (0, (1024, 128, 1)),
        (24, (256, 8, 1)),
    ]:
        t = base.as_strided((2, 4, 8), strides, offset)
        es = t.element_size()
        expected = t.data_ptr() % 16 == 0 and all(s and (s * es) % 16 == 0 for s in strides[:-1])
        assert use_tma("sm90", t) == expected, (offset, strides)
        assert not use_tma("sm80", t)


def test_host_descriptor_rule(monkeypatch):
    """Host-built descriptors (on by default) for the TMA path on dense inputs with a
    power-of-two head dim and adjacent heads; descriptors made in the kernel otherwise (varlen,
    other head dims, heads apart, switched off), and none without TMA. Checked where the Triton
    kernels' launchers ask (the Gluon forward off), with the real calls."""
    from flashattn2.ops.launch import launcher

    taken = []
    attention = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")

    def watch(kernel, grid, args, kwargs):
        if kernel.__name__ in attention:
            taken.append(any(type(a) is launcher.HostDesc for a in args))

    def run(q, k, v, varlen=False, **switches):
        taken.clear()
        with force(hopper=False, **switches), launcher.watched(watch):
            if varlen:
                cu = torch.tensor([0, q.shape[0] - 5, q.shape[0]], dtype=torch.int32, device=DEVICE)
                out = flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, q.shape[0] - 5, q.shape[0] - 5)
            else:
                out = flashattn2.flash_attn_func(q, k, v, causal=True)
            torch.autograd.grad(out.float().sum(), (q, k, v))
        return list(taken)

    n = 70 if not ON_GPU else 700
    dense = [randn(2, n, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*dense, tma=True, host_desc=True) == [True] * 3  # forward, dK/dV, dQ
    assert run(*dense, tma=True) == [True] * 3  # the default
    assert run(*dense, tma=True, host_desc=False) == [False] * 3
    assert run(*dense, tma=False, host_desc=True) == [False] * 3
    odd = [randn(2, n, 4, 40, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*odd, tma=True, host_desc=True) == [False] * 3
    # heads apart: every other 64-column slice of a 128-wide last dimension
    wide = randn(2, n, 4, 128, dtype=torch.float16)
    apart = [wide[..., :64].detach().requires_grad_() for _ in range(3)]
    assert apart[0].stride(2) == 128 and run(*apart, tma=True, host_desc=True) == [False] * 3
    packed = [randn(n, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    assert run(*packed, varlen=True, tma=True, host_desc=True) == [False] * 3


def test_arch_override(monkeypatch, fresh_plans):
    """force(arch=...) makes a CUDA device select another architecture's rows and
    load path (the GPU tests run sm80 and sm86 that way); the interpreter ignores it, and a GPU
    without TMA cannot be made to take the sm90 path."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(modes._ARCH, 0, "sm90")  # device 0 is an H200 (its capability is cached)
    tile = lambda: (
        planning.lookup(planning.arch_of(cuda), torch.float16, 128, False, 4096, planning.Features(), "fwd").tile
    )
    fwd = tile()
    assert fwd == T(128, 64, 4, 2)
    with force(arch="sm80"):
        assert planning.arch_of(cuda) == "sm80"
        assert planning.arch_of(torch.device("cpu")) == "interp"
        assert tile() == T(128, 64, 8, 2) != fwd
    with force(arch="sm86"):
        assert planning.arch_of(cuda) == "sm86"
    assert planning.forced().arch is None and planning.arch_of(cuda) == "sm90"
    with pytest.raises(ValueError, match="arch must be one of"):
        with force(arch="sm70"):
            pass
    monkeypatch.setitem(modes._ARCH, 0, "sm80")
    with force(arch="sm90"):
        with pytest.raises(ValueError, match="no TMA"):
            planning.arch_of(cuda)


def test_varlen_tail_rows_get_zero_gradient():
    """Varlen with rows past cu_seqlens[-1]: deterministic=False and True give the same gradients (on the CPU,
    one kernel; on a GPU the Triton kernels either way: the Gluon backward is dense only), and the rows that
    belong to no sequence get a zero gradient."""
    from cases import cu_seqlens

    lengths = [37, 63, 20] if not ON_GPU else [370, 1630, 200]
    total = sum(lengths) + 10
    cu = cu_seqlens(lengths)
    q, k, v = (randn(total, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = randn(total, 4, 64, dtype=torch.bfloat16)
    grads = []
    for deterministic in (False, True):
        out = flashattn2.flash_attn_varlen_func(
            q, k, v, cu, cu, max(lengths), max(lengths), causal=True, deterministic=deterministic
        )
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name
        assert torch.equal(a[sum(lengths) :], torch.zeros_like(a[sum(lengths) :])), name


def test_keys_past_the_end_add_nothing(monkeypatch):
    """Non-causal, seqlen_k not a multiple of the key block, every score strongly negative: the
    zero-filled key rows past seqlen_k get P = exp(-L), huge, and must not reach dQ (inf * 0)
    on the Gluon backward (on an H100/H200; elsewhere the Triton backward runs)."""
    b, s, h, d = 1, 70, 2, 64
    u = torch.randn(d, device=DEVICE, dtype=torch.float32)
    u = u / u.norm() * 32.0  # scores about -|u|^2 / sqrt(d) = -128
    k = (randn(b, 41, h, d, dtype=torch.float32) * 0.1 + u).to(torch.bfloat16).requires_grad_()
    v = randn(b, 41, h, d, dtype=torch.bfloat16, requires_grad=True)
    q = (randn(b, s, h, d, dtype=torch.float32) * 0.1 - u).to(torch.bfloat16).requires_grad_()
    do = randn(b, s, h, d, dtype=torch.bfloat16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True)
    assert lse.max() < -100  # the case: exp(-L) overflows fp32
    grads2 = torch.autograd.grad(out, (q, k, v), do)
    out = flashattn2.flash_attn_func(q, k, v, deterministic=False)
    launched = spy_launches(monkeypatch)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert ("attn_bwd_ws_kernel" in launched) == HOPPER, launched
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads2):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)
