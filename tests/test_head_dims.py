"""Head dims past flash_attn 2.x: a value head dim of its own (v.shape[-1] != q.shape[-1]: the output and dV have
v's) and head dims up to 512 for q/k and v each (576/512 in flash_attn_with_kvcache: the MLA decode shape).
Forward, logsumexp and gradients against the reference by flash_attn's rule; dense, varlen, KV cache (contiguous,
paged, splits, a V cache that is a view of the K cache), the private functions, torch.compile; errors."""

from dataclasses import astuple, replace

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2.ops import _runtime
from flashattn2 import flash_attn_interface
from flashattn2.errors import ArgumentError
from flashattn2.ops import planning
from flashattn2.ops.run import registry
from flashattn2.ops.request import spec
from flashattn2.ops.request.request import KVCacheRequest
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from flashattn2.reference.kvcache import kvcache_ref
from tolerance import assert_close, check_against_reference

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim of q/k, headdim of v)
if ON_GPU:
    SHAPES = [
        (2, 1000, 1000, 8, 2, 192, 128),  # DeepSeek-V3's
        (1, 2049, 2049, 4, 4, 192, 128),
        (2, 777, 1300, 4, 1, 128, 64),
        (2, 800, 600, 4, 2, 64, 128),
        (1, 1000, 1000, 4, 4, 256, 128),
        (1, 700, 900, 4, 2, 96, 256),
        (1, 1024, 1024, 4, 4, 512, 512),
        (2, 513, 700, 4, 2, 512, 128),
        (1, 600, 600, 4, 4, 128, 512),
        (1, 333, 1, 2, 2, 320, 200),
        (1, 1, 333, 2, 2, 448, 384),
    ]
    DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
else:
    SHAPES = [
        (2, 70, 90, 4, 2, 48, 32),
        (1, 50, 40, 2, 1, 32, 80),
        (1, 40, 40, 2, 2, 192, 128),
        (1, 33, 20, 2, 2, 512, 512),
        (1, 1, 30, 2, 2, 16, 512),
    ]
    DTYPES = [pytest.param(torch.float16, id="fp16")]
SHAPE_PARAMS = [pytest.param(s, id="b{}-sq{}-sk{}-h{}-hk{}-d{}-dv{}".format(*s)) for s in SHAPES]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def make(shape, dtype, requires_grad=True):
    b, sq, sk, h, hk, d, dv = shape
    return (
        randn(b, sq, h, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, sk, hk, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, sk, hk, dv, dtype=dtype, requires_grad=requires_grad),
    )


HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and _runtime.hopper_kernels() is not None
GLUON_BWD = planning.Features(gluon=True, deterministic=False)
DETERMINISTIC = [pytest.param(True, id="det")] + ([pytest.param(False, id="nondet")] if ON_GPU else [])


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_head_dims(shape, dtype, causal, deterministic):
    q, k, v = make(shape, dtype)
    out, lse, _ = flashattn2.flash_attn_func(
        q, k, v, causal=causal, deterministic=deterministic, return_attn_probs=True
    )
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, causal, name="dense")


OPTIONS = [
    pytest.param(dict(causal=True, window_size=(37, 0)), id="window"),
    pytest.param(dict(softcap=3.0, alibi=True), id="softcap-alibi"),
    pytest.param(dict(causal=True, sink=True), id="causal-sink"),
    # (on the H200 at 192/128: the Gluon backward with a sink)
    pytest.param(dict(sink=True, deterministic=False), id="sink-nondet"),
]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("dims", [(192, 128), (64, 32)] if ON_GPU else [(48, 32)], ids=lambda d: f"d{d[0]}-dv{d[1]}")
def test_with_options(dims, opts):
    shape = (2, 600, 700, 4, 2, *dims) if ON_GPU else (2, 50, 60, 4, 2, *dims)
    q, k, v = make(shape, torch.bfloat16 if ON_GPU else torch.float16)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(4, device=DEVICE) * 0.3
    sink = torch.randn(4, device=DEVICE) if opts.pop("sink", False) else None
    deterministic = opts.pop("deterministic", True)
    out, lse, _ = flashattn2.flash_attn_func(
        q, k, v, return_attn_probs=True, learnable_sink=sink, deterministic=deterministic, **opts
    )
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    check_against_reference(q, k, v, out, lse, grads, do, name="options", learnable_sink=sink, **opts)


def test_with_dropout():
    """Dropout with v's head dim: the mask recovered from S_dmask (which only q and k shape), the reference with it."""
    p = 0.2
    q, k, v = make((2, 300, 400, 4, 2, 96, 64) if ON_GPU else (1, 40, 50, 2, 2, 48, 32), torch.float16)
    out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = s_dmask[:, :, : q.shape[1], : k.shape[1]] >= 0
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    opts = dict(causal=True, dropout_mask=keep, dropout_p=p)
    check_against_reference(q, k, v, out, lse, grads, do, name="dropout", **opts)


def test_value_a_view_of_the_keys():
    """v = k[..., :dv], heads adjacent with k's stride (MLA's layout): the stride test alone would admit it to the
    Gluon kernels (v.stride(2) == q's head dim), which assume v's head dim is q's."""
    dqk, dv = (128, 64) if ON_GPU else (64, 32)
    q = randn(2, 512 if ON_GPU else 40, 4, dqk, dtype=torch.bfloat16, requires_grad=True)
    kv = randn(2, 512 if ON_GPU else 40, 4, dqk, dtype=torch.bfloat16, requires_grad=True)
    k, v = kv, kv[..., :dv]
    assert v.stride(2) == q.shape[-1]
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    (dq, dkv) = torch.autograd.grad(out, (q, kv), do)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_ref(q2, k2, v2, causal=True)
    low_out, low_lse = attention_ref(q2, k2, v2, causal=True, upcast=False)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    rq, rk, rv = torch.autograd.grad(ref_out, (q2, k2, v2), do.float())
    lq, lk, lv = torch.autograd.grad(low_out, (q2, k2, v2), do)
    ref_dkv, low_dkv = rk.clone(), lk.clone()
    ref_dkv[..., :dv] += rv
    low_dkv[..., :dv] += lv
    assert_close("dq", dq, rq, lq, BWD_FACTOR)
    assert_close("dkv", dkv, ref_dkv, low_dkv, BWD_FACTOR)


@pytest.mark.parametrize("dims", [(192, 128), (512, 256)] if ON_GPU else [(48, 32), (32, 80)])
def test_varlen(dims):
    """Per sequence, the reference on that sequence alone; rows past cu_seqlens[-1] stay 0 / +inf."""
    lengths_q, lengths_k = ([300, 0, 1000, 1], [500, 7, 1000, 90]) if ON_GPU else ([17, 0, 40, 1], [30, 5, 40, 9])
    h, hk, extra = 4, 2, 3
    dqk, dv = dims
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q = randn(sum(lengths_q) + extra, h, dqk, dtype=torch.float16, requires_grad=True)
    k = randn(sum(lengths_k), hk, dqk, dtype=torch.float16, requires_grad=True)
    v = randn(sum(lengths_k), hk, dv, dtype=torch.float16, requires_grad=True)
    mq, mk = max(lengths_q), max(lengths_k)
    out, lse, _ = flashattn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, return_attn_probs=True)
    assert out.shape == (q.shape[0], h, dv)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert torch.equal(out[-extra:], torch.zeros_like(out[-extra:])) and torch.isposinf(lse[:, -extra:]).all()
    assert torch.equal(grads[0][-extra:], torch.zeros_like(grads[0][-extra:]))
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t[None, s].detach().clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        ro, rl = attention_ref(qb, kb, vb, causal=True)
        lo, _ = attention_ref(qb, kb, vb, causal=True, upcast=False)
        assert_close(f"seq {b} out", out[qs][None], ro, lo, FWD_FACTOR)
        torch.testing.assert_close(lse[:, qs], rl[0], rtol=1e-4, atol=1e-4)
        rg = torch.autograd.grad(ro, (qb, kb, vb), do[qs][None].float())
        lg = torch.autograd.grad(lo, (qb, kb, vb), do[qs][None])
        for name, g, r, low in zip(("dq", "dk", "dv"), (grads[0][qs], grads[1][ks], grads[2][ks]), rg, lg):
            assert_close(f"seq {b} {name}", g[None], r, low, BWD_FACTOR)


def test_packed_kv_and_private_functions():
    """The private functions (what ring-flash-attention calls) with v's head dim: out, softmax_lse, and the
    backward's dq/dk/dv and softmax_d, against the public call."""
    q, k, v = make((2, 100, 120, 4, 2, 64, 32) if ON_GPU else (1, 30, 40, 2, 1, 48, 32), torch.float16)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    do = torch.randn_like(out)
    ref = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out2, lse2, _, rng = flash_attn_interface._flash_attn_forward(qd, kd, vd, 0.0, None, True, -1, -1, 0.0, None, False)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
    softmax_d = flash_attn_interface._flash_attn_backward(
        do, qd, kd, vd, out2, lse2, dq, dk, dv, 0.0, None, True, -1, -1, 0.0, None, True, rng
    )
    for g, r in zip((dq, dk, dv), ref):
        assert torch.equal(g, r)
    torch.testing.assert_close(softmax_d, (do.float() * out.float()).sum(-1).transpose(1, 2), rtol=1e-3, atol=1e-3)


def _paged(cache, perm, page):
    """A (batch, capacity, hk, d) cache as pages (num_blocks, page, hk, d) in the order perm (the block table)."""
    blocks = perm.numel()
    pages = torch.empty(blocks, page, *cache.shape[2:], dtype=cache.dtype, device=DEVICE)
    pages[perm.flatten().long()] = cache.reshape(blocks, page, *cache.shape[2:])
    return pages


@pytest.mark.parametrize("num_splits", [1, 0, 3], ids=["no-split", "auto", "splits-3"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 256), (512, 512)] if ON_GPU else [(48, 32), (16, 80)])
def test_kvcache(dims, paged, num_splits):
    """Appending k/v of their own head dims, then attending: the new tokens land in each cache, the output has v's
    head dim."""
    dqk, dv = dims
    batch, h, hk, seqlen_q, capacity, page = 3, 8, 2, 2, 512 if ON_GPU else 48, 16
    q = randn(batch, seqlen_q, h, dqk, dtype=torch.float16)
    k_cache = randn(batch, capacity, hk, dqk, dtype=torch.float16)
    v_cache = randn(batch, capacity, hk, dv, dtype=torch.float16)
    k_new, v_new = randn(batch, 2, hk, dqk, dtype=torch.float16), randn(batch, 2, hk, dv, dtype=torch.float16)
    seqlens = torch.tensor([0, 5, capacity - 2], dtype=torch.int32, device=DEVICE)
    ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    low = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, upcast=False)
    table = None
    if paged:
        table = torch.randperm(batch * capacity // page, device=DEVICE).view(batch, -1).to(torch.int32)
        k_cache, v_cache = _paged(k_cache, table, page), _paged(v_cache, table, page)
    out, lse = flashattn2.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        cache_seqlens=seqlens,
        block_table=table,
        causal=True,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    assert out.shape == (batch, seqlen_q, h, dv)
    assert_close("out", out, ref[0], low[0], FWD_FACTOR)
    torch.testing.assert_close(lse, ref[1].float(), rtol=1e-3, atol=1e-3)
    got_k = k_cache[table.long()].flatten(1, 2) if paged else k_cache
    got_v = v_cache[table.long()].flatten(1, 2) if paged else v_cache
    assert torch.equal(got_k, ref[2]) and torch.equal(got_v, ref[3])


@pytest.mark.parametrize("num_splits", [1, 0], ids=["no-split", "auto"])
def test_mla_decode(num_splits):
    """The MLA decode shape: q/k 576, v 512 -- one latent head, its value the K cache's first 512 columns (v_cache a
    view of k_cache: read where it lies, written once by the append), paged, 128 query heads (64 on the CPU)."""
    heads, batch, page = (128, 4, 64) if ON_GPU else (64, 2, 16)  # rows over several row blocks
    capacity = 1024 if ON_GPU else 64
    q = randn(batch, 1, heads, 576, dtype=torch.bfloat16) * 0.1
    blocks = batch * capacity // page
    kv_pages = randn(blocks, page, 1, 576, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.tensor([capacity - 1, 3, capacity // 2, 0][:batch], dtype=torch.int32, device=DEVICE)
    k_new = randn(batch, 1, 1, 576, dtype=torch.bfloat16)
    kv_before = kv_pages.clone()
    out, lse = flashattn2.flash_attn_with_kvcache(
        q,
        kv_pages,
        kv_pages[..., :512],
        k_new,
        k_new[..., :512],
        cache_seqlens=seqlens,
        block_table=table,
        softmax_scale=192**-0.5,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    args = dict(cache_seqlens=seqlens, block_table=table, softmax_scale=192**-0.5)
    ref = kvcache_ref(q, kv_before, kv_before[..., :512], k_new, k_new[..., :512], **args)
    low = kvcache_ref(q, kv_before, kv_before[..., :512], k_new, k_new[..., :512], upcast=False, **args)
    assert out.shape == (batch, 1, heads, 512)
    assert_close("mla out", out, ref[0], low[0], FWD_FACTOR)
    torch.testing.assert_close(lse, ref[1].float(), rtol=1e-3, atol=1e-3)
    assert torch.equal(kv_pages, ref[2])


@pytest.mark.parametrize(
    "dims", [(576, 512, 16), (576, 512, 32), (576, 512, 64), (128, 128, 4), (96, 64, 4), (40, 40, 4)]
)
def test_values_read_from_the_key_tile(dims, monkeypatch):
    """A V cache that is the K cache's first columns (a view, or k_cache itself) is read once per key block: the
    kernel takes the values from the keys' tile (V_FROM_K), with any split; the result equals the same call with the
    values read separately (the kernel's other path, forced) and the reference. 576/512 at 16, 32 and 64 query heads:
    the latent tiles of 16, 32 and 64 rows on an H100/H200, whose whole key blocks are TMA copies (KV_TMA; lengths that
    end inside a block: the rest by pointers), and the same tiles by pointers (force(tma=False))."""
    from flashattn2.ops.launch import kvcache

    dqk, dv, heads = dims
    batch, page = 2, 64 if ON_GPU else 16  # a key block in one page: MLA's key blocks by TMA (KV_TMA)
    capacity = 256 if ON_GPU else 48
    q = randn(batch, 1, heads, dqk, dtype=torch.bfloat16)
    blocks = batch * capacity // page
    kv = randn(blocks, page, 1, dqk, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.tensor([capacity - 5, 17], dtype=torch.int32, device=DEVICE)
    v_cache = kv if dv == dqk else kv[..., :dv]
    assert planning.v_from_k(spec.tensor(kv), spec.tensor(v_cache), True)
    args = dict(cache_seqlens=seqlens, block_table=table)
    ref = kvcache_ref(q, kv, v_cache, **args)
    low = kvcache_ref(q, kv, v_cache, upcast=False, **args)
    chosen = spy_decode_plans(monkeypatch)
    latent = planning.latent_dims(dqk, dv)
    call = lambda splits: flashattn2.flash_attn_with_kvcache(q, kv, v_cache, num_splits=splits, **args)  # noqa: E731
    for num_splits in (1, 3):
        # TMA on: the interpreter runs the descriptors too (Hopper's default; MLA's shape takes them)
        with planning.force(tma=True if dqk == 576 else None):
            out = call(num_splits)
        assert chosen.pop().kv_tma == (dqk == 576 and (not ON_GPU or planning.arch_of(q.device) == "sm90"))
        assert_close(f"out, {num_splits} splits", out, ref[0], low[0], FWD_FACTOR)
        with planning.force(tma=False):  # the same tile by pointers (TMA and pointer tiles may round apart)
            pointers = call(num_splits)
            # and with v read on its own, still the same tile (the 64-row latent tile has no shared memory for a
            # v tile of its own: 352 KB on the H200; only a V cache of k's memory reaches it)
            if not (ON_GPU and latent and heads >= 64):
                with monkeypatch.context() as m:
                    decode = kvcache.Decode
                    m.setattr(kvcache, "Decode", lambda plan, *a: decode(replace(plan, v_from_k=False), *a))
                    separate = call(num_splits)
                assert torch.equal(pointers, separate)
        assert_close(f"pointers, {num_splits} splits", pointers, ref[0], low[0], FWD_FACTOR)


def test_mla_speculative_decode(monkeypatch):
    """MLA decoding a few tokens at once (speculative decoding, multi-token prediction: seqlen_q 3, causal, the new
    tokens appended to the latent cache) with lengths that end inside a key block: the decode kernel's latent path
    (the keys' tile as values; whole key blocks by TMA on an H100/H200 and under force(tma=True) on the CPU, the
    causal diagonal inside the TMA loop), against the reference."""

    # the 3 queries' rows in one row block (16 heads: the 64-row tile; 4 on the CPU), so that a block's diagonal
    # falls in the TMA loop where a sequence ends on a block's end (the first)
    heads, batch, page, capacity = (16, 3, 64, 512) if ON_GPU else (4, 3, 16, 64)
    q = randn(batch, 3, heads, 576, dtype=torch.bfloat16)
    blocks = batch * capacity // page
    kv = randn(blocks, page, 1, 576, dtype=torch.bfloat16)
    table = torch.randperm(blocks, device=DEVICE).view(batch, -1).to(torch.int32)
    seqlens = torch.tensor([capacity - 3, page + 5, 2 * page - 3], dtype=torch.int32, device=DEVICE)
    k_new = randn(batch, 3, 1, 576, dtype=torch.bfloat16)
    args = dict(cache_seqlens=seqlens, block_table=table, causal=True)
    ref = kvcache_ref(q, kv, kv[..., :512], k_new, k_new[..., :512], **args)
    low = kvcache_ref(q, kv, kv[..., :512], k_new, k_new[..., :512], upcast=False, **args)
    chosen = spy_decode_plans(monkeypatch)
    with planning.force(tma=True):
        out = flashattn2.flash_attn_with_kvcache(q, kv, kv[..., :512], k_new, k_new[..., :512], **args)
    assert [plan.kv_tma for plan in chosen] == [not ON_GPU or planning.arch_of(q.device) == "sm90"]
    assert_close("mla speculative out", out, ref[0], low[0], FWD_FACTOR)
    assert torch.equal(kv, ref[2])


def test_values_from_the_keys_rule():
    """v_from_k: only the K cache's own memory, strides and first column block (as wide as the kernel loads it)."""
    kv = randn(4, 16, 2, 576, dtype=torch.bfloat16)
    v_from_k = lambda k, v: planning.v_from_k(spec.tensor(k), spec.tensor(v), k.data_ptr() == v.data_ptr())  # noqa: E731
    assert v_from_k(kv, kv[..., :512])
    assert not v_from_k(kv, kv[..., :512].clone())  # its own memory
    assert not v_from_k(kv, kv[..., :256])  # narrower than k's first block
    assert not v_from_k(kv, kv[..., 64:])  # other columns
    k128 = kv[..., :128]
    assert v_from_k(k128, k128)
    assert not v_from_k(k128, k128[..., :64])  # k's block is 128 wide
    other = kv.as_strided(k128.shape, (kv.stride(0), kv.stride(1), 128, 1))  # same start, heads at other strides
    assert not v_from_k(k128, other)
    kd = kv[..., :96]
    assert v_from_k(kd, kd[..., :64])  # 96 = 64 + 32: k's first block is 64


def test_compile_and_opcheck():
    """The ops' fake implementations give the output v's head dim: opcheck, and torch.compile(fullgraph=True) with
    a backward equal to eager's."""
    q, k, v = make((1, 33, 47, 4, 2, 48, 32), torch.float16, requires_grad=False)
    args = (None, None, 0, 0, 0.0, None, 0.25, True, -1, -1, 0.0, None)
    torch.library.opcheck(registry.fwd, (q, k, v, *args))
    out, lse = registry.fwd(q, k, v, *args)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(registry.bwd, (torch.randn_like(out), q, k, v, out, lse, None, dq, dk, dv, *args, None, None))
    torch._dynamo.reset()
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))

    def step(q, k, v):
        return flashattn2.flash_attn_func(q, k, v, causal=True).square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for g, e in zip(torch.autograd.grad(compiled(q, k, v), (q, k, v)), eager):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_errors():
    q = randn(1, 8, 2, 64, dtype=torch.float16)
    k = randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="headdim 520 > 512"):
        flashattn2.flash_attn_func(randn(1, 8, 2, 520, dtype=torch.float16), k[..., :1].expand(1, 8, 2, 520), k)
    with pytest.raises(NotImplementedError, match=r"headdim of v \(544\) > 512"):
        flashattn2.flash_attn_func(q, k, randn(1, 8, 2, 544, dtype=torch.float16))
    with pytest.raises(ArgumentError, match="same shape but for the head dim"):
        flashattn2.flash_attn_func(q, k, randn(1, 9, 2, 32, dtype=torch.float16))
    with pytest.raises(ArgumentError, match=r"headdim of k \(32\) differs from q's \(64\)"):
        flashattn2.flash_attn_func(q, k[..., :32], k)
    cache = randn(1, 16, 1, 608, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="headdim 608 > 576"):
        flashattn2.flash_attn_with_kvcache(randn(1, 1, 2, 608, dtype=torch.float16), cache, cache[..., :512])
    with pytest.raises(ArgumentError, match="v must be"):
        kc, vc = randn(1, 16, 1, 64, dtype=torch.float16), randn(1, 16, 1, 32, dtype=torch.float16)
        flashattn2.flash_attn_with_kvcache(q[:, :1], kc, vc, kc[:, :1], kc[:, :1], cache_seqlens=1)


def test_plans_read_the_wider_head_dim():
    """The table is read by the wider of the two head dims (its tiles hold both), and past 256 no Gluon row
    applies."""
    features = planning.Features(gluon=True, deterministic=False)
    wide = planning.lookup("sm90", torch.bfloat16, 512, True, 4096, features, "fwd")
    assert wide.kernel == "fwd" and wide.tile == planning.TileConfig(64, 64, 8, 1)
    assert planning.lookup("sm90", torch.bfloat16, 512, True, 4096, features, "bwd").kernel == "bwd_dkdv"
    with pytest.raises(NotImplementedError, match="99 KB"):
        planning.lookup("sm86", torch.float32, 384, False, 100, planning.Features(), "bwd")
    from flashattn2.ops.planning.geometry import Geometry

    q, k, v = make((1, 5, 5, 2, 2, 192, 128), torch.float16, False)
    geo = Geometry.of(q, k, None, v)
    assert (geo.head_dim, geo.head_dim_v) == (192, 128)
    # the bucket is the wider head dim's, v's too
    assert planning.lookup("sm90", torch.bfloat16, 64, True, 4096, features, "fwd", 512) == wide
    # the 256 bucket's rows for a narrower v (DeepSeek-V3's 192/128): its own tiles; an equal v keeps the d256 ones
    narrow = planning.lookup("sm90", torch.bfloat16, 192, False, 8192, planning.Features(), "fwd", 128)
    equal = planning.lookup("sm90", torch.bfloat16, 192, False, 8192, planning.Features(), "fwd")
    assert narrow.tile == planning.TileConfig(128, 64, 8, 3) and equal.tile == planning.TileConfig(128, 64, 8, 2)
    narrow = planning.lookup("sm90", torch.bfloat16, 192, True, 8192, planning.Features(), "bwd", 128)
    assert (narrow.tile, narrow.dq_tile) == (planning.TileConfig(32, 64, 4, 2), planning.TileConfig(128, 64, 8, 2))
    assert planning.lookup("sm90", torch.bfloat16, 128, True, 8192, planning.Features(), "bwd", 256).tile != narrow.tile
    # past 256 the backward's columns are split (DSPLIT), on the CPU too
    assert dict(planning.lookup("interp", torch.float16, 512, True, 64, planning.Features(), "bwd").constexprs) == {
        "DSPLIT": 2
    }


def test_gluon_pairs():
    """The Gluon kernels run DeepSeek-V3's 192/128 (q's and k's head dim in two parts, 128 + 64: Gluon's tiles are
    powers of two) and the equal pairs 64/128/256, forward and backward; other pairs take the Triton kernels."""
    fwd = lambda d, dv, causal=False: planning.lookup("sm90", torch.bfloat16, d, causal, 8192, GLUON_BWD, "fwd", dv)
    bwd = lambda d, dv: planning.lookup("sm90", torch.bfloat16, d, True, 8192, GLUON_BWD, "bwd", dv).kernel
    assert fwd(192, 128).kernel == fwd(192, 128, True).kernel == "fwd_hopper_persist"
    assert fwd(192, 128).tile != fwd(128, 128).tile
    assert fwd(128, 128).kernel == "fwd_hopper_persist" and fwd(256, 256).kernel == "fwd_hopper_ws"
    for d, dv in [(160, 128), (192, 192), (256, 128), (128, 64), (64, 128), (192, 64)]:
        assert fwd(d, dv).kernel == "fwd", (d, dv)
    assert bwd(192, 128) == bwd(128, 128) == "bwd_hopper" and bwd(160, 128) == bwd(192, 64) == "bwd_dkdv"
    full = planning.lookup("sm90", torch.bfloat16, 192, False, 8192, GLUON_BWD, "bwd", 128)
    assert full.kernel == "bwd_hopper" and dict(full.constexprs)["DQ_SPLIT"] == 2  # dQ_i in the head dim's parts
    from flashattn2.ops.planning.geometry import column_parts

    parts = [column_parts(d) for d in (64, 128, 192, 256, 96, 576, 80, 40, 112, 1)]
    assert parts == [(64, 0), (128, 0), (128, 64), (256, 0), (64, 32), (512, 64), (64, 16), (64, 0), (128, 0), (16, 0)]


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels: an sm_90 GPU")
@pytest.mark.parametrize("dims", [(192, 128), (160, 128)], ids=lambda d: f"d{d[0]}-dv{d[1]}")
def test_gluon_runs(dims, monkeypatch):
    """On the H200 a dense bf16 192/128 forward and (deterministic=False) backward launch the Gluon kernels (the
    other tests check their numbers), 160/128 the Triton ones."""
    from flashattn2.ops.launch import launcher

    launched = []
    monkeypatch.setattr(launcher, "_WATCH", lambda kernel, grid, args, kwargs: launched.append(kernel.__name__))
    q, k, v = make((1, 300, 300, 4, 2, *dims), torch.bfloat16)
    out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=False)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    gluon = dims == (192, 128)
    assert launched[0] == ("attn_fwd_persist_kernel" if gluon else "attn_fwd_kernel")
    assert ("attn_bwd_ws_kernel" in launched) == gluon and ("attn_bwd_dkdv_kernel" in launched) == (not gluon)


# the contiguous refinements exist for one split setting each
_REFINED_ONLY = {("contiguous-short", False), ("contiguous-many", True)}


def spy_decode_plans(monkeypatch) -> list:
    """The plans the KV-cache kernel runs from here on, in order (those its ops.launch.kvcache.Decode is made with;
    every call prepared afresh, since a prepared call keeps its Decode)."""
    from flashattn2.ops.run import call as calls
    from flashattn2.ops.launch import kvcache

    plans, decode = [], kvcache.Decode
    monkeypatch.setattr(calls.CALLS, "get", lambda spec: None)
    monkeypatch.setattr(kvcache, "Decode", lambda plan, *a: plans.append(plan) or decode(plan, *a))
    return plans


def test_decode_tiles():
    """The decode tiles for any pair of head dims: powers of two (tl.arange's), the key block's bytes those of the
    d128 entry's at most, one stage past 256/256 (shared memory), fewer rows for wide heads (registers)."""
    paths = ("contiguous", "contiguous-short", "contiguous-many", "page-block", "page-row")
    for d, dv in [(64, 64), (128, 128), (192, 128), (96, 40), (64, 256), (320, 200), (512, 512), (576, 512)]:
        for path, split in [(p, s) for p in paths for s in (False, True) if (p, s) not in _REFINED_ONLY]:
            for rows in (1, 16, 128):
                tile = planning.decode_tile(planning.decode_row(path, split), rows, d, dv, 2, "sm90")
                block_m, block_n, stages = tile.block_m, tile.block_n, tile.num_stages
                assert block_m & (block_m - 1) == 0 and block_n & (block_n - 1) == 0, (d, dv, path, block_n)
                if d + dv > 512:
                    assert stages == 1 and block_m <= 32
                # 99 KB of shared memory: at most two stages, one from 256/256 (compile_check's sm86 rows)
                small = planning.decode_tile(planning.decode_row(path, split), rows, d, dv, 2, "sm86")
                assert (small.block_m, small.block_n, small.num_warps) == (tile.block_m, tile.block_n, tile.num_warps)
                assert small.num_stages <= (1 if d + dv >= 512 else 2), (d, dv, path, small)
    tile = planning.decode_tile(planning.decode_row("page-block", True), 128, 576, 512, 2, "sm90")
    assert (tile.block_m, tile.block_n) == (16, 32)


def test_latent_tiles():
    """MLA's latent cache (v the K cache's first 512 columns, q/k 576) takes LATENT_TILES on sm90 in 16-bit types, by
    the packed rows (64 rows a program at 128 heads: one wgmma over the heads); anything else the generic tiles."""
    pages = torch.empty(64, 64, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 64, dtype=torch.int32)

    def plan(k, v, rows, arch="sm90", dtype=torch.bfloat16):
        q = torch.empty(1, 1, rows, k.shape[-1], dtype=dtype)
        s = spec.kvcache(KVCacheRequest(q, k.to(dtype), v.to(dtype) if dtype != k.dtype else v, block_table=table))
        p = planning.decode(planning.kvcache_cache(s), arch, planning.Forced(), False, 0, 132)
        return (*astuple(p.tile)[:4], p.splits, p.chunk)

    latent_rows = {d.when[1][1]: astuple(d.tile)[:4] for d in planning.DECODE_ROWS if ("latent", True) in d.when}
    latent = (pages, pages[..., :512])
    assert plan(*latent, 128)[:4] == latent_rows[64] == (64, 64, 8, 2)
    assert plan(*latent, 33)[:4] == latent_rows[64]
    assert plan(*latent, 20)[:4] == latent_rows[32] and plan(*latent, 16)[:4] == latent_rows[16]
    generic = plan(*latent, 128, arch="sm80")
    assert generic[:2] == (16, 32)  # the generic rows: 16 a program at these widths
    assert plan(pages, pages[..., :512].clone(), 128) == generic
    assert plan(*latent, 128, dtype=torch.float32)[0] == 16
    # the splits count the latent tile's programs: 2 row blocks of 64, not 8 of 16
    assert plan(*latent, 128)[4:] == (64, 64)  # 2 programs: 64 splits of one 64-key block (at most one a block)
    assert generic[4:] == (32, 128)  # 8 programs: 2 x 132 / 8 = 33 splits of 32 keys, rounded to 32 of 128
    view192 = torch.empty(64, 64, 1, 192, dtype=torch.bfloat16)
    on = lambda arch: plan(view192, view192[..., :128], 128, arch)  # noqa: E731
    assert on("sm90") == on("sm80")  # 192/128 with v a view of k: the generic tiles, not the latent ones
    on320 = lambda arch: plan(pages[..., :320], pages[..., :256], 128, arch)  # noqa: E731
    assert on320("sm90") == on320("sm80")  # a 256-wide latent: the generic tiles
