"""flash_attn_func against the reference: out, logsumexp and gradients, by flash_attn's rule."""
import pytest
import torch

import flashattn2
from cases import CAUSAL, DTYPES, SHAPE_PARAMS, make_qkv, randn, shape_id
from conftest import DEVICE, ON_GPU
from flashattn2.ops import _runtime, config
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

T = config.TileConfig
# Kernel paths: on CUDA the table's choice (on an H200: the Gluon forward where it applies, its
# persistent kernel at head dim 64/128, the Gluon backward, TMA with host-built descriptors where
# the inputs allow them), the warp-specialized Gluon forward forced, its one-warpgroup kernel
# forced, the Triton kernels instead of the Gluon ones, descriptors made in each program, the
# forced pointer (non-TMA) path, and the other architectures' table entries and load path (on an
# H200: what an A100 or an RTX card runs); on the CPU, both load paths (TMA: host-built
# descriptors for power-of-two head dims) with tiles where BLOCK_M != BLOCK_N so masked-block
# ranges are exercised.
if ON_GPU:
    PATHS = [pytest.param({}, id="table"), pytest.param({"gluon_ws": True}, id="gluon-ws"),
             pytest.param({"gluon_ws": False}, id="gluon-one-wg"),
             pytest.param({"gluon": False, "gluon_bwd": False}, id="triton"),
             pytest.param({"gluon": False, "gluon_bwd": False, "host_desc": False}, id="kernel-desc"),
             pytest.param({"tma": False}, id="no-tma"),
             pytest.param({"arch": "sm80"}, id="sm80"), pytest.param({"arch": "sm86"}, id="sm86")]
else:
    PATHS = [
        pytest.param({}, id="ptr-64x64"),
        pytest.param({"tma": True, "host_desc": True, "fwd": T(32, 64, 4, 1), "bwd_dkdv": T(16, 32, 4, 1),
                      "bwd_dq": T(64, 16, 4, 1)}, id="tma-mixed-tiles"),
    ]


def check_against_reference(q, k, v, out, lse, grads, do, causal, dlse=None):
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal)
    low_out, low_lse = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "rows without keys must have lse=+inf"
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    if grads is None:
        return
    ref_loss = (ref_out * do.to(ref_out.dtype)).sum()
    low_loss = (low_out * do).sum()
    if dlse is not None:
        ref_loss = ref_loss + (ref_lse.masked_fill(~finite, 0) * dlse.to(ref_lse.dtype)).sum()
        low_loss = low_loss + (low_lse.masked_fill(~finite, 0) * dlse).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    low_grads = torch.autograd.grad(low_loss, (q, k, v))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_forward_backward(shape, dtype, causal, path):
    q, k, v = make_qkv(shape, dtype)
    with config.override(**path):
        out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.dtype == dtype and lse.dtype == torch.float32 and s_dmask.numel() == 0
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check_against_reference(q, k, v, out, lse, grads, do, causal)


def spy_launches(monkeypatch, kernel_name: str | None = None, *kwargs_of: str) -> list:
    """The names of the kernels _runtime.launch runs from now on (in this test), in order; with
    kernel_name, the values of the keyword arguments kwargs_of of each launch of that kernel ("grid":
    the grid it is launched on)."""
    launched = []
    real = _runtime.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel_name is None:
            launched.append(kernel.__name__)
        elif kernel.__name__ == kernel_name:
            launched.append(tuple(tuple(grid) if k == "grid" else kwargs[k] for k in kwargs_of))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_runtime, "launch", spy)
    return launched


HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and _runtime.hopper_kernels() is not None


@pytest.mark.parametrize("case", ["plain", "causal", "gqa-bf16", "d256", "softcap", "window", "alibi", "d96",
                                  "fp32", "gluon-off", "sm80", "varlen", "d64-long", "d128-short", "d128-long",
                                  "d128-ws-forced", "d128-one-wg-forced", "d128-persist-off", "d256-ws-off",
                                  "d64-ws-forced"])
def test_forward_kernel_choice(case, monkeypatch):
    """The Gluon forward runs on sm_90 exactly for dense fp16/bf16 inputs, head dim 64/128/256,
    causal or not and nothing else; everything else (and the CPU) takes the Triton kernel. At head
    dim 64 and 128 it is the persistent kernel, unless override(gluon_persist=False) or forcing
    gluon_ws asks otherwise; then (and at head dim 256) the warp-specialized kernel runs past
    config.GLUON_WS_ABOVE_SEQLEN_K keys, or where override(gluon_ws=True) forces it (never at head
    dim 64: no table entry), else the one-warpgroup kernel."""
    launched = spy_launches(monkeypatch)
    d = {"d256": 256, "d96": 96, "d256-ws-off": 256}.get(case, 128 if case.startswith("d128") else 64)
    dtype = {"gqa-bf16": torch.bfloat16, "fp32": torch.float32}.get(case, torch.float16)
    seqlen_k = {"d64-long": 2049,  # past _TABLE_SHORT's d64 tiles (and the length limit the Gluon forward had there)
                "d128-long": config.GLUON_WS_ABOVE_SEQLEN_K[128] + 1,
                "d128-persist-off": config.GLUON_WS_ABOVE_SEQLEN_K[128] + 1}.get(case, 130)
    q, k, v = make_qkv((2, 100, seqlen_k, 4, 2 if case == "gqa-bf16" else 4, d), dtype, requires_grad=False)
    kwargs = dict(causal=case == "causal", softcap=5.0 if case == "softcap" else 0.0,
                  window_size=(16, 3) if case == "window" else (-1, -1),
                  alibi_slopes=torch.rand(4, device=DEVICE) if case == "alibi" else None)
    ws_forced = {"d128-ws-forced": True, "d64-ws-forced": True, "d256-ws-off": False,
                 "d128-one-wg-forced": False}.get(case)
    with config.override(gluon=False if case == "gluon-off" else None, arch="sm80" if case == "sm80" else None,
                         gluon_ws=ws_forced, gluon_persist=False if case == "d128-persist-off" else None):
        if case == "varlen":
            cu = torch.tensor([0, 100, 200], device=DEVICE, dtype=torch.int32)
            flashattn2.flash_attn_varlen_func(q.flatten(0, 1), k[:, :100].flatten(0, 1), v[:, :100].flatten(0, 1),
                                              cu, cu, 100, 100)
        else:
            flashattn2.flash_attn_func(q, k, v, **kwargs)
    gluon = HOPPER and case in ("plain", "causal", "gqa-bf16", "d256", "d64-long", "d128-short", "d128-long",
                                "d128-ws-forced", "d128-one-wg-forced", "d128-persist-off", "d256-ws-off",
                                "d64-ws-forced")
    persist = gluon and case in ("plain", "causal", "gqa-bf16", "d64-long", "d128-short", "d128-long")
    ws = gluon and case in ("d256", "d128-ws-forced", "d128-persist-off")
    expected = ("attn_fwd_persist_kernel" if persist else "attn_fwd_ws_kernel" if ws
                else "attn_fwd_hopper_kernel" if gluon else "attn_fwd_kernel")
    assert launched[0] == expected, launched


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("causal", CAUSAL)
def test_gluon_backward_many_heads(causal, monkeypatch):
    """batch * nheads_k past 65535 (CUDA's limit on a grid's second and third axes; the Gluon backward had (batch,
    kv head) on one of them until its grid grouped the heads) runs the Gluon backward on a grid whose groups of
    heads bring the third axis under it, and its gradients are right."""
    from flashattn2.ops import attention

    monkeypatch.setattr(attention, "_BWD_PLANS", {})
    launched = spy_launches(monkeypatch)
    grids = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "grid")
    q, k, v = make_qkv((16385, 2, 3, 4, 4, 128), torch.float16)
    with config.override(gluon_bwd=True):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert "attn_bwd_ws_kernel" in launched and "attn_bwd_dkdv_kernel" not in launched, launched
    # 65540 heads = 4 * 16385: causal, as many per group as 24 MB of Q and dO hold (a divisor); else raised from 1 to 2
    assert grids == [((16385, 1, 4) if causal else (2, 1, 32770),)], grids
    check_against_reference(q, k, v, out, lse, grads, do, causal)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
def test_gluon_backward_key_blocks_limit(monkeypatch):
    """More key blocks than CUDA's 65535 on the Gluon backward's second grid axis (lowered here to 4, so that 300
    keys are past it) take the Triton backward, and its gradients are right."""
    from flashattn2.ops import attention

    monkeypatch.setattr(attention, "_BWD_PLANS", {})
    monkeypatch.setattr(attention, "_GRID_YZ", 4)
    launched = spy_launches(monkeypatch)
    q, k, v = make_qkv((2, 200, 300, 4, 2, 128), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert "attn_bwd_dkdv_kernel" in launched and "attn_bwd_ws_kernel" not in launched, launched
    check_against_reference(q, k, v, out, lse, grads, do, True)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("groups", ["head-major", "3", "all"])
@pytest.mark.parametrize("shape", [(3, 700, 700, 6, 2, 128), (3, 1000, 1000, 5, 5, 256), (4, 333, 900, 3, 3, 64),
                                   (6, 640, 512, 4, 4, 128)], ids=shape_id)
def test_gluon_backward_grid_order(shape, groups, monkeypatch):
    """The Gluon backward's grid (G, key blocks, heads / G), whose shape is the programs' order (kernels/bwd_hopper
    ._ws_program), with G = 1 (override(gluon_bwd_grouped=False), where the L2 budget would give 3), 3 and every head
    in one group, causal (bottom-right aligned where seqlen_q != seqlen_k): every (key block, head) pair runs once,
    so the gradients match the reference; the launch took the grid asked for. (That CUDA starts the programs in the
    order the grouping intends is not tested: a transposed mapping would cover the pairs too.)"""
    from flashattn2.ops import attention

    monkeypatch.setattr(attention, "_BWD_PLANS", {})
    batch, seqlen_q, seqlen_k, nheads, nheads_k, d = shape
    head_bytes = 2 * seqlen_q * d * 2 * (nheads // nheads_k)
    n_bh = batch * nheads_k
    want = {"head-major": 1, "3": 3, "all": n_bh}[groups]
    monkeypatch.setattr(config, "GLUON_BWD_L2_BYTES", max(want, 3) * head_bytes + 1)
    grids = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "grid")
    q, k, v = make_qkv(shape, torch.bfloat16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    with config.override(gluon_bwd_grouped=False if groups == "head-major" else None):
        grads = torch.autograd.grad(out, (q, k, v), do)
    block_n = config.select("bwd_hopper_split" if d == 256 else "bwd_hopper", "sm90", d, q.dtype, True).block_n
    assert grids == [((want, -(-seqlen_k // block_n), n_bh // want),)], grids
    check_against_reference(q, k, v, out, lse, grads, do, True)


def test_gluon_backward_grid_rule():
    """config.gluon_bwd_l2_heads: 1 (head-major) for non-causal calls or where turned off; else as many heads as
    GLUON_BWD_L2_BYTES holds, at least 1 and at most all. attention._bwd_grid: the largest divisor of the heads not
    above that (whole groups), raised where the third axis would pass 65535."""
    from flashattn2.ops import attention

    budget = config.GLUON_BWD_L2_BYTES
    assert config.gluon_bwd_l2_heads(False, 64, 1024) == 1
    assert config.gluon_bwd_l2_heads(True, 64, budget // 6) == 6
    assert config.gluon_bwd_l2_heads(True, 4, budget // 6) == 4
    assert config.gluon_bwd_l2_heads(True, 64, budget * 2) == 1
    with config.override(gluon_bwd_grouped=False):
        assert config.gluon_bwd_l2_heads(True, 64, budget // 6) == 1
    assert attention._divisors(1) == [1] and attention._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert attention._divisors(65540) == [d for d in range(1, 65541) if 65540 % d == 0]
    assert attention._bwd_grid(64, 32, 6) == (4, 64, 8)
    assert attention._bwd_grid(64, 32, 1) == (1, 64, 32)
    assert attention._bwd_grid(3, 7, 6) == (1, 3, 7)  # a prime count of heads: head-major
    assert attention._bwd_grid(3, 12, 100) == (12, 3, 1)
    assert attention._bwd_grid(1, 65540, 1) == (2, 1, 32770)  # the third axis within 65535
    assert attention._bwd_grid(1, 2 * 65537, 1) == (65537, 1, 2)
    assert attention._bwd_grid(1, 65537, 1) == (65537, 1, 1)  # prime: every head in one group


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on an H100/H200 only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 8, 8, 256), (1, 333, 1029, 4, 2, 256), (2, 1537, 700, 6, 1, 256),
                                   (1, 2048, 2048, 4, 4, 128), (1, 999, 1300, 8, 2, 128), (2, 700, 900, 4, 4, 64)],
                         ids=shape_id)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("forced", [True, False], ids=["split", "one-ring"])
def test_gluon_backward_split_ring(shape, dtype, causal, forced, monkeypatch):
    """The Gluon backward's split-ring variant (dO in a ring of its own released after dV; at
    headdim 256, its default there, two Q stages and dQ_i staged in column halves) and the one-ring
    kernel, each forced (override(gluon_bwd_split=...)), against the reference: tails of both
    lengths, GQA and MQA, seqlen_q != seqlen_k, causal or not."""
    q, k, v = make_qkv(shape, dtype)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    do = torch.randn_like(out)
    split = spy_launches(monkeypatch, "attn_bwd_ws_kernel", "SPLIT_RING", "DQ_SPLIT")
    with config.override(gluon_bwd_split=forced):
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert split == [(forced, 2 if forced and shape[-1] == 256 else 1)], split
    check_against_reference(q, k, v, out, lse, grads, do, causal)


def test_gluon_backward_split_rule(monkeypatch):
    """config.gluon_bwd_split: by default at headdim 256 only (GLUON_BWD_SPLIT_DEFAULT), elsewhere
    where asked (override before the environment) and the head dim has an entry."""
    monkeypatch.setattr(config, "_ENV_GLUON_BWD_SPLIT", None)
    assert [config.gluon_bwd_split(d) for d in (64, 128, 256, 200)] == [False, False, True, True]
    with config.override(gluon_bwd_split=True):
        assert all(config.gluon_bwd_split(d) for d in (64, 128, 256, 200))
    monkeypatch.setattr(config, "_ENV_GLUON_BWD_SPLIT", True)
    assert config.gluon_bwd_split(256)
    with config.override(gluon_bwd_split=False):
        assert not config.gluon_bwd_split(256)


def test_gluon_forward_rule(monkeypatch):
    """config.gluon_persist / gluon_ws: the persistent kernel wherever it has a table entry (head
    dim 64, 128), overrides before the environment, and forcing gluon_ws either way turns it off."""
    monkeypatch.setattr(config, "_ENV_GLUON_PERSIST", None)  # whatever this process's environment says
    monkeypatch.setattr(config, "_ENV_GLUON_WS", None)
    assert config.gluon_persist(128) and config.gluon_persist(59) and not config.gluon_persist(256)
    with config.override(gluon_persist=False):
        assert not config.gluon_persist(128)
        assert config.gluon_ws(128, 4096) and not config.gluon_ws(128, 2048)  # then by length
    for ws in (True, False):
        with config.override(gluon_ws=ws):
            assert not config.gluon_persist(128) and config.gluon_ws(128, 1) == ws
        with config.override(gluon_ws=ws, gluon_persist=True):
            assert config.gluon_persist(128)
    monkeypatch.setattr(config, "_ENV_GLUON_PERSIST", True)
    with config.override(gluon_ws=False):  # an override beats the environment
        assert not config.gluon_persist(128)
    monkeypatch.setattr(config, "_ENV_GLUON_PERSIST", None)
    monkeypatch.setattr(config, "_ENV_GLUON_WS", True)
    assert not config.gluon_persist(128) and config.gluon_ws(128, 1)


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
PERSIST_TILES = [pytest.param(64, T(64, 128, 12, 2), id="d64-64x128w12s2"),
                 pytest.param(64, T(64, 128, 12, 3), id="d64-64x128w12s3"),
                 pytest.param(64, T(64, 128, 8, 2), id="d64-64x128w8s2"),
                 pytest.param(64, T(128, 64, 8, 3), id="d64-128x64w8s3"),
                 pytest.param(64, T(64, 64, 12, 4), id="d64-64x64w12s4"),
                 pytest.param(128, T(64, 64, 8, 2), id="d128-64x64w8s2"),
                 pytest.param(128, T(64, 64, 12, 2), id="d128-64x64w12s2"),
                 pytest.param(128, T(64, 64, 12, 3), id="d128-64x64w12s3"),
                 pytest.param(128, T(64, 64, 12, 3, qbuf=1), id="d128-64x64w12s3q1"),
                 pytest.param(64, T(64, 128, 12, 3, qbuf=1), id="d64-64x128w12s3q1")]


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
    for dtype, shape in ((torch.float16, (3, 300, 461, 8, 2, d)), (torch.bfloat16, (2, 461, 300, 4, 4, d)),
                         (torch.float16, (1, 64, 1000, 6, 3, d)), (torch.float16, (1, 2400, 2400, 3, 1, d)),
                         (torch.float16, (2, 200, 40, 4, 2, d))):
        q, k, v = make_qkv(shape, dtype)
        with config.override(fwd_hopper_persist=tile):
            out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_against_reference(q, k, v, out, lse, None, None, causal)
    qbuf = config.GLUON_PERSIST_QBUF[d] if tile.qbuf is None else tile.qbuf  # the tile's Q buffers where it names them
    assert launched == [(tile.num_warps // 4, tile.block_n, qbuf)] * 5, launched


@pytest.mark.skipif(not HOPPER, reason="the persistent Gluon forward runs on an H100/H200 only")
@pytest.mark.parametrize("d, seqlen_k", [(128, 130), (128, 700), (64, 130), (64, 2049)])
def test_short_tile_launch(d, seqlen_k, monkeypatch):
    """A causal call launches the tile config.select gives for its key length, with that tile's Q buffers (d128 up
    to 512 keys: one per consumer, from the tile; past it the head dim's), and is right."""
    launched = spy_launches(monkeypatch, "attn_fwd_persist_kernel", "BLOCK_M", "BLOCK_N", "STAGES", "QBUF", "CONSUMERS")
    q, k, v = make_qkv((2, 100, seqlen_k, 4, 2, d), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_against_reference(q, k, v, out, lse, None, None, True)
    tile = config.select("fwd_hopper_persist", "sm90", d, torch.float16, True, seqlen_k)
    extra = config.gluon_persist_constexprs(tile, d, True)
    assert launched == [(tile.block_m, tile.block_n, tile.num_stages, extra["QBUF"], extra["CONSUMERS"])], launched
    assert extra["QBUF"] == (1 if (d, seqlen_k) == (128, 130) else 2)


def test_short_tiles():
    """config.select with the longest key sequence: _TABLE_SHORT's tile up to its bound (causal and
    not apart), the table entry past it or without a length; an override beats both."""
    sel = lambda d, causal, n: config.select("fwd_hopper_persist", "sm90", d, torch.float16, causal, n)
    for (arch, d, _, kernel, causal), tiles in config._TABLE_SHORT.items():
        base = config.select(kernel, arch, d, torch.float16, causal)
        shorter = 0  # the bound of the tile before: the next one starts past it
        for longest, tile in tiles:
            assert sel(d, causal, shorter + 1) == sel(d, causal, longest) == tile != base
            shorter = longest
        assert sel(d, causal, tiles[-1][0] + 1) == base
    assert sel(128, False, 512) == config._TABLE[("sm90", 128, 2, "fwd_hopper_persist")]  # no short tile there
    with config.override(fwd_hopper_persist=T(64, 64, 8, 2)):
        assert sel(64, True, 512) == sel(64, False, 99999) == T(64, 64, 8, 2)


def test_plan_keys():
    """The keys under which ops.attention remembers the Gluon paths' choices: they change with an
    override (tile or switch), the dtype, the strides and the causal flag, and are None where a
    call is not remembered (ALiBi, dropout)."""
    from flashattn2.ops import attention

    q, k, v = make_qkv((2, 64, 64, 4, 2, 64), torch.float16, requires_grad=False)
    mods = attention.ScoreMods(causal=True)
    key = attention._forward_key(q, k, v, mods)
    assert key == attention._forward_key(q.clone(), k.clone(), v.clone(), mods)
    with config.override(fwd_hopper_persist=T(64, 64, 8, 2)):
        assert attention._forward_key(q, k, v, mods) != key
    with config.override(gluon_persist=False):
        assert attention._forward_key(q, k, v, mods) != key
    assert attention._forward_key(q, k, v, attention.ScoreMods(causal=False)) != key
    assert attention._forward_key(q.bfloat16(), k.bfloat16(), v.bfloat16(), mods) != key
    assert attention._forward_key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mods) != key
    alibi = torch.rand(4, device=q.device)
    assert attention._forward_key(q, k, v, attention.ScoreMods(causal=True, alibi_slopes=alibi)) is None
    out = torch.randn_like(q)
    bkey = attention._backward_key(out, q, k, v, out, None, mods)
    assert bkey == attention._backward_key(out.clone(), q, k, v, out.clone(), None, mods)
    assert bkey != attention._backward_key(out, q, k, v, out, torch.zeros(2, 4, 64, device=q.device), mods)
    with config.override(gluon_bwd_split=True):
        assert attention._backward_key(out, q, k, v, out, None, mods) != bkey


@pytest.mark.skipif(not HOPPER, reason="the Gluon paths (whose choices are remembered) run on an H100/H200 only")
@pytest.mark.parametrize("causal", CAUSAL)
def test_plans_repeated_signature(causal, monkeypatch):
    """A call signature seen before runs from its remembered choices (attention._FWD_PLANS /
    _BWD_PLANS): new inputs of the same shapes, NaN-filled outputs, against the reference; an
    override between the calls is seen (another tile launches)."""
    from flashattn2.ops import attention

    monkeypatch.setattr(attention, "_FWD_PLANS", {})
    monkeypatch.setattr(attention, "_BWD_PLANS", {})
    launched = spy_launches(monkeypatch, "attn_fwd_persist_kernel", "BLOCK_M", "BLOCK_N", "STAGES")
    shape = (2, 300, 300, 8, 2, 128)  # a ragged last tile: the backward pads lse
    for _ in range(2):
        q, k, v = make_qkv(shape, torch.float16)
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        check_against_reference(q, k, v, out, lse, grads, do, causal)
        assert len(attention._FWD_PLANS) == len(attention._BWD_PLANS) == 1
    tile = T(64, 64, 8, 2)
    with config.override(fwd_hopper_persist=tile):
        q, k, v = make_qkv(shape, torch.float16)
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_against_reference(q, k, v, out, lse, None, None, causal)
    assert len(attention._FWD_PLANS) == 2 and launched[0] == launched[1] != launched[2] == (64, 64, 2), launched


def test_persistent_constexprs():
    """The persistent forward's num_warps counts its consumer warps: 8 or 12, nothing else."""
    assert config.gluon_persist_constexprs(T(64, 128, 12, 2), 64, True) == dict(QBUF=2, SNAKE=True, CONSUMERS=3)
    assert config.gluon_persist_constexprs(T(64, 128, 8, 2), 128, False)["CONSUMERS"] == 2
    for warps in (4, 16):
        with pytest.raises(ValueError, match="num_warps"):
            config.gluon_persist_constexprs(T(64, 128, warps, 2), 64, False)
    # Q buffers per consumer: the tile's where it names them, else the head dim's
    assert config.gluon_persist_constexprs(T(64, 64, 12, 3, qbuf=1), 128, True)["QBUF"] == 1
    assert config.gluon_persist_constexprs(T(64, 64, 12, 3), 128, True)["QBUF"] == config.GLUON_PERSIST_QBUF[128]
    for qbuf in (0, 3):
        with pytest.raises(ValueError, match="qbuf"):
            config.gluon_persist_constexprs(T(64, 64, 12, 3, qbuf=qbuf), 128, True)
    with pytest.raises(ValueError, match="qbuf.*fwd_hopper_persist.*fwd_hopper_ws"):
        with config.override(fwd_hopper_ws=T(64, 128, 4, 2, qbuf=1)):
            pass
    with pytest.raises(ValueError, match="qbuf.*1 or 2, got 3"):  # refused where the tile is made
        with config.override(fwd_hopper_persist=T(64, 64, 12, 3, qbuf=3)):
            pass
    with pytest.raises(TypeError, match="fwd_hopper_persist must be a TileConfig"):
        with config.override(fwd_hopper_persist=(64, 64, 12, 3)):
            pass


def test_tile_text():
    """A tile as bench ab and the tools write and read it: 'MxNwWsS', 'q' and the Q buffers after it where set."""
    for tile in (T(64, 128, 12, 3), T(64, 64, 12, 3, qbuf=1), T(128, 32, 4, 2)):
        assert config.parse_tile(str(tile)) == tile
    assert str(T(64, 64, 12, 3, qbuf=1)) == "64x64w12s3q1" and str(T(64, 64, 12, 3)) == "64x64w12s3"
    # a different tile for the plan keys and config.state()
    assert T(64, 64, 12, 3, qbuf=1) != T(64, 64, 12, 3) and hash(T(64, 64, 12, 3, qbuf=1)) != hash(T(64, 64, 12, 3))
    for text in ("64x64w12", "64x64w12s3q", "default", "64x64w12s3q1x"):
        assert config.parse_tile(text) is None


@pytest.mark.parametrize("case", ["plain", "causal-gqa", "d256-bf16", "d128", "deterministic", "gluon-bwd-off",
                                  "softcap", "dropout", "d96", "varlen", "sm80"])
def test_backward_kernel_choice(case, monkeypatch):
    """The Gluon backward (warp-specialized) runs on sm_90 exactly for deterministic=False
    (flash_attn's default), dense fp16/bf16 inputs, head dim 64/128/256, causal or not and nothing
    else, unless override(gluon_bwd=False) turns it off; everything else (and the CPU) takes the
    Triton dK/dV and dQ kernels."""
    d = {"d256-bf16": 256, "d96": 96, "d128": 128}.get(case, 64)
    dtype = torch.bfloat16 if case == "d256-bf16" else torch.float16
    q, k, v = make_qkv((2, 100, 130, 4, 2 if case == "causal-gqa" else 4, d), dtype)
    kwargs = dict(causal=case == "causal-gqa", softcap=5.0 if case == "softcap" else 0.0,
                  dropout_p=0.1 if case == "dropout" else 0.0, deterministic=case == "deterministic")
    with config.override(gluon_bwd=False if case == "gluon-bwd-off" else None, arch="sm80" if case == "sm80" else None):
        if case == "varlen":
            cu = torch.tensor([0, 100, 200], device=DEVICE, dtype=torch.int32)
            out = flashattn2.flash_attn_varlen_func(q.flatten(0, 1), k[:, :100].flatten(0, 1),
                                                    v[:, :100].flatten(0, 1), cu, cu, 100, 100)
        else:
            out = flashattn2.flash_attn_func(q, k, v, **kwargs)
        launched = spy_launches(monkeypatch)  # the backward's launches only
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    gluon = HOPPER and case in ("plain", "causal-gqa", "d256-bf16", "d128")
    expected, other = ("attn_bwd_ws_kernel", "attn_bwd_dkdv_kernel")[::1 if gluon else -1]
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
    with config.override(fwd=tile, bwd_dq=tile, gluon=False, gluon_bwd=False):
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


@pytest.mark.parametrize("seqlen_q, seqlen_pad, copy_lse", [(100, 128, True), (128, 128, False), (128, 128, True),
                                                             (61, 64, True)])
@pytest.mark.parametrize("d", [64, 256])  # 64 and 32 rows per preprocess program
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_padded_preprocess(seqlen_q, seqlen_pad, copy_lse, d, with_dlse):
    """The Gluon backward's one preprocess launch (ops.attention._preprocess with seqlen_pad): delta =
    rowsum(dO * O) - dlse up to seqlen_q and 0 to seqlen_pad, the fp32 dQ accumulator's padded rows
    zeroed, and where asked (a tail; the launcher also asks for a non-contiguous lse) lse copied
    with +inf past seqlen_q; every buffer starts NaN-filled. (On the CPU the interpreter runs it; on
    an H100/H200 it is what the Gluon backward runs.)"""
    from flashattn2.ops import attention

    b, h = 2, 3
    out, dout = (randn(b, seqlen_q, h, d, dtype=torch.float16) for _ in range(2))
    lse = randn(b, h, seqlen_q, dtype=torch.float32)
    dlse = randn(b, h, seqlen_q, dtype=torch.float32) if with_dlse else None
    geo = attention._Geometry.of(out, out, None)
    delta, lse_pad = (_runtime.empty((b, h, seqlen_pad), torch.float32, out.device) for _ in range(2))
    acc = _runtime.empty((b, seqlen_pad, h, d), torch.float32, out.device)
    attention._preprocess(out, dout, lse, dlse, geo, delta, seqlen_pad, lse_pad if copy_lse else None, acc)
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
        make = lambda: randn(b, s, h, d + 24, dtype=dtype)[..., 5:5 + d]
    else:  # stride(-1) != 1: copied, as flash_attn does
        make = lambda: randn(b, s, h, 2 * d, dtype=dtype)[..., ::2]
    q, k, v = (make().requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, True)


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


@pytest.mark.parametrize("path", ["default", "ws-forced", "one-warpgroup"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", CAUSAL)
def test_zero_softmax_scale(d, causal, path, monkeypatch):
    """softmax_scale=0 (allowed): every visible key weighs the same, so O is the mean of the visible
    values and lse the log of their count, in every forward (on an H100/H200 each Gluon kernel, the
    launch checked: the persistent one at headdim 64/128 by default, the warp-specialized one at
    128/256, the one-warpgroup one; their masked blocks must not turn an invisible score's -inf * 0
    into NaN) and through the backward. 100 queries over 97 keys: causal rows 0-2 see no key (O 0,
    lse +inf), ragged key blocks, and the persistent kernel's causal tiles start before row 0."""
    if not HOPPER and (path != "default" or d != 64):
        pytest.skip("elsewhere one kernel (kernels/fwd.py) runs every path and head dim: d64 checks it")
    overrides = {"default": {}, "ws-forced": {"gluon_persist": False, "gluon_ws": True},
                 "one-warpgroup": {"gluon_persist": False, "gluon_ws": False}}[path]
    launched = spy_launches(monkeypatch)
    sq, sk = 100, 97
    q, k, v = make_qkv((2, sq, sk, 4, 2, d), torch.float16)
    with config.override(**overrides):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal, return_attn_probs=True)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    if HOPPER:  # (the d64 warp-specialized kernel has no table entry: forcing it gives the one-warpgroup kernel)
        expected = ("attn_fwd_persist_kernel" if path == "default" and d != 256 else
                    "attn_fwd_ws_kernel" if path != "one-warpgroup" and d != 64 else "attn_fwd_hopper_kernel")
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
    """deterministic=True: dQ has its own pass (no atomics), repeated runs give identical bits,
    even where atomics (or the Gluon backward) are enabled for deterministic=False; so does
    deterministic=False with both off."""
    shape = (2, 300, 300, 4, 2, 64) if ON_GPU else (1, 97, 97, 2, 1, 32)
    q, k, v = make_qkv(shape, torch.bfloat16)
    do = randn(*q.shape, dtype=q.dtype)
    runs = []
    for deterministic, atomic in ((True, None), (True, True), (False, False)):
        with config.override(dq_atomic=atomic, gluon_bwd=False if atomic is False else None):
            out = flashattn2.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


ATOMIC_CASES = [
    pytest.param(dict(shape=(2, 1000, 1500, 8, 2, 64) if ON_GPU else (2, 97, 97, 4, 2, 32), causal=True),
                 id="gqa-causal"),
    pytest.param(dict(shape=(1, 700, 1300, 4, 4, 128) if ON_GPU else (1, 70, 130, 2, 2, 64), causal=False),
                 id="full-qk-lengths-differ"),
    pytest.param(dict(shape=(2, 900, 900, 4, 1, 256) if ON_GPU else (2, 90, 90, 2, 1, 32), causal=False,
                      window_size=(20, 5), softcap=5.0, alibi=True), id="local-softcap-alibi"),
]


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("case", ATOMIC_CASES)
def test_dq_atomics(case, tma, monkeypatch):
    """deterministic=False with the atomic dQ path (scalar atomics, or the TMA bulk reduce): no dQ
    kernel runs, the gradients obey the rule against the reference, and dQ agrees with the
    deterministic pass's to fp32 rounding."""
    case = dict(case)
    q, k, v = make_qkv(case.pop("shape"), torch.float16)
    if case.pop("alibi", False):
        case["alibi_slopes"] = torch.rand(q.shape[2], device=q.device, dtype=torch.float32) * 0.3
    do = randn(*q.shape, dtype=q.dtype)
    launched = spy_launches(monkeypatch)
    with config.override(dq_atomic=True, tma=tma, gluon_bwd=False):
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, deterministic=False, return_attn_probs=True, **case)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert "attn_bwd_dkdv_kernel" in launched and "attn_bwd_dq_kernel" not in launched
    out2 = flashattn2.flash_attn_func(q, k, v, deterministic=True, **case)
    grads2 = torch.autograd.grad(out2, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads2):  # fp16: one rounding of the output apart
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3, msg=name)
    ref_out, _ = attention_ref(q, k, v, causal=case.get("causal", False), window_size=case.get("window_size", (-1, -1)),
                               softcap=case.get("softcap", 0.0), alibi_slopes=case.get("alibi_slopes"))
    low_out, _ = attention_ref(q, k, v, causal=case.get("causal", False), window_size=case.get("window_size", (-1, -1)),
                               softcap=case.get("softcap", 0.0), alibi_slopes=case.get("alibi_slopes"), upcast=False)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)


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
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True,
                                                 deterministic=deterministic)
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
    from flashattn2.ops import attention

    base = torch.empty(4096, dtype=torch.float16)
    for offset, strides in [(0, (512, 64, 1)), (8, (512, 64, 1)), (1, (512, 64, 1)), (0, (520, 64, 1)),
                            (0, (512, 4, 1)), (0, (0, 64, 1)), (16, (64, 0, 1)), (0, (1024, 128, 1)),
                            (24, (256, 8, 1))]:
        t = base.as_strided((2, 4, 8), strides, offset)
        es = t.element_size()
        expected = t.data_ptr() % 16 == 0 and all(s and (s * es) % 16 == 0 for s in strides[:-1])
        assert attention._use_tma("sm90", t) == expected, (offset, strides)
        assert not attention._use_tma("sm80", t)


def test_host_descriptor_rule(monkeypatch):
    """Host-built descriptors (on by default) for the TMA path on dense inputs with a
    power-of-two head dim and adjacent heads; descriptors made in the kernel otherwise (varlen,
    other head dims, heads apart, switched off), and none without TMA. Checked where the Triton
    kernels' launchers ask (the Gluon forward off), with the real calls."""
    from flashattn2.ops import attention

    taken = []
    sources = attention._sources
    monkeypatch.setattr(attention, "_sources", lambda *a: taken.append(sources(*a)[1]) or sources(*a))

    def run(q, k, v, varlen=False, **force):
        taken.clear()
        with config.override(gluon=False, gluon_bwd=False, **force):
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
    if config._ENV_HOST_DESC is None:
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


def test_arch_override(monkeypatch):
    """config.override(arch=...) makes a CUDA device select another architecture's entries and
    load path (the GPU tests run sm80 and sm86 that way); the interpreter ignores it, and a GPU
    without TMA cannot be made to take the sm90 path."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(config._ARCH, 0, "sm90")  # device 0 is an H200 (its capability is cached)
    fwd = config.select("fwd", config.arch_of(cuda), 128, torch.float16, False)
    assert fwd == config._TABLE[("sm90", 128, 2, "fwd")]
    with config.override(arch="sm80"):
        assert config.arch_of(cuda) == "sm80"
        assert config.arch_of(torch.device("cpu")) == "interp"
        fwd_sm80 = config.select("fwd", config.arch_of(cuda), 128, torch.float16, False)
        assert fwd_sm80 == config._TABLE[("sm80", 128, 2, "fwd")] and fwd_sm80 != fwd
    with config.override(arch="sm86"):
        assert config.arch_of(cuda) == "sm86"
    assert config._forced["arch"] is None and config.arch_of(cuda) == "sm90"
    with pytest.raises(ValueError, match="arch must be one of"):
        with config.override(arch="sm70"):
            pass
    monkeypatch.setitem(config._ARCH, 0, "sm80")
    with config.override(arch="sm90"):
        with pytest.raises(ValueError, match="no TMA"):
            config.arch_of(cuda)


@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_dq_atomics_varlen(tma):
    """Varlen with rows past cu_seqlens[-1]: the atomic dQ equals the deterministic pass's to fp32
    rounding (a tile that crosses into the next sequence adds nothing there), and the rows that
    belong to no sequence get a zero gradient on both paths."""
    from cases import cu_seqlens

    lengths = [37, 63, 20] if not ON_GPU else [370, 1630, 200]
    total = sum(lengths) + 10
    cu = cu_seqlens(lengths)
    q, k, v = (randn(total, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = randn(total, 4, 64, dtype=torch.bfloat16)
    grads = []
    for deterministic in (False, True):
        with config.override(dq_atomic=True, tma=tma):
            out = flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                    deterministic=deterministic)
            grads.append(torch.autograd.grad(out, (q, k, v), do))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)
        assert torch.equal(a[sum(lengths):], torch.zeros_like(a[sum(lengths):])), name


@pytest.mark.parametrize("path", [dict(dq_atomic=True, gluon_bwd=False), dict(gluon_bwd=True)],
                         ids=["atomic", "gluon"])
def test_dq_atomics_keys_past_the_end_add_nothing(path, monkeypatch):
    """Non-causal, seqlen_k not a multiple of the key block, every score strongly negative: the
    zero-filled key rows past seqlen_k get P = exp(-L), huge, and must not reach dQ (inf * 0);
    on the Triton kernels' atomic dQ path and on the Gluon backward (on an H100/H200; elsewhere
    the Triton backward runs)."""
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
    with config.override(**path):
        out = flashattn2.flash_attn_func(q, k, v, deterministic=False)
        launched = spy_launches(monkeypatch)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert ("attn_bwd_ws_kernel" in launched) == (HOPPER and path.get("gluon_bwd", False)), launched
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads2):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)
