"""Learnable attention sinks (learnable_sink): one logit per query head in every row's softmax denominator, with
no value. Forward, logsumexp and the gradients of q, k, v and the sink against the reference, by flash_attn's
rule; dense, packed, varlen, KV cache with and without splits, paged; rows that see no key; errors."""

import pytest
import torch

import flashattn2
from cases import cu_seqlens, make_qkv, randn
from conftest import DEVICE, ON_GPU
from flashattn2.errors import ArgumentError, ArgumentTypeError
from flashattn2.ops import _runtime, planning
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from flashattn2.reference.kvcache import kvcache_ref
from tolerance import assert_close

if ON_GPU:
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): the Gluon head dims (the first three), a tail, GQA
    SHAPES = [(2, 1000, 1000, 8, 2, 64), (1, 2049, 2049, 4, 4, 128), (2, 777, 1300, 4, 1, 256), (2, 500, 700, 4, 2, 59)]
    DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
else:
    SHAPES = [(2, 97, 131, 4, 2, 64), (1, 70, 45, 2, 1, 40)]
    DTYPES = [pytest.param(torch.float16, id="fp16")]

# (causal, window_size, softcap, alibi)
OPTIONS = [
    pytest.param(False, (-1, -1), 0.0, False, id="plain"),
    pytest.param(True, (-1, -1), 0.0, False, id="causal"),
    pytest.param(True, (64, -1), 0.0, False, id="causal-window"),
    pytest.param(False, (-1, -1), 2.0, True, id="softcap-alibi"),
]


def sink_like(nheads, scale=2.0, requires_grad=True):
    """Sinks of either sign and a few units: large enough to move the result, small enough not to swamp it."""
    return (torch.randn(nheads, device=DEVICE) * scale).requires_grad_(requires_grad)


def sink_grad_of(sink, out, lse, do, dlse):
    """d sink by its formula, in fp64, on a stored output and logsumexp: -sum over batch and rows of
    exp(sink - lse) * (rowsum(do * out) - dlse)."""
    delta = (do.double() * out.double()).sum(-1).transpose(1, 2) - dlse.double()
    return -(torch.exp(sink.detach().double()[None, :, None] - lse.detach().double()) * delta).sum(dim=(0, 2))


def dsink_bound(sink, out, lse, ref_out, ref_lse, do, dlse):
    """How far our out's and lse's errors can move d sink, per head (see check)."""
    w = torch.exp(sink.detach().double()[None, :, None] - ref_lse.detach().double())
    out_err = (out.double() - ref_out.double()).abs().max()
    lse_err = (lse.double() - ref_lse.double()).abs().max()
    delta = (do.double() * ref_out.detach().double()).sum(-1).transpose(1, 2) - dlse.double()
    do_l1 = do.double().abs().sum(-1).transpose(1, 2)
    return (w * (do_l1 * out_err + delta.abs() * lse_err)).sum(dim=(0, 2))


def check(name, out, lse, grads, ref, low, do, dlse, sink):
    """out, lse, dq, dk, dv against the oracle (ref) with PyTorch's own error (low) as the yardstick. d sink is a
    sum over every row of a function of the output and logsumexp the kernel stored: it must equal that formula on
    our out and lse (1e-4), and the oracle's within what our out's and lse's errors (which the rule bounds) can
    move the sum: sum_i w_i (|do_i|_1 max|out err| + |delta_i| max|lse err|), w_i = exp(sink - lse_i). (A
    yardstick from PyTorch's own d sink is a sum of random roundings too, and read 3.2x ours at one H200 point.)"""
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = ref, low
    assert_close(f"{name} out", out, ref_out, low_out, FWD_FACTOR)
    assert torch.isfinite(lse).all(), "with a sink every row's logsumexp is finite"
    assert_close(f"{name} lse", lse, ref_lse, low_lse.float(), FWD_FACTOR)
    for gname, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(f"{name} {gname}", g, r, lo, BWD_FACTOR)
    dsink = grads[3].double()
    torch.testing.assert_close(dsink, sink_grad_of(sink, out, lse, do, dlse), rtol=1e-4, atol=1e-4)
    bound = dsink_bound(sink, out, lse, ref_out, ref_lse, do, dlse) + 1e-4
    err = (dsink - ref_grads[3].double()).abs()
    assert (err <= bound).all(), f"{name} dsink: error {err.tolist()} > bound {bound.tolist()}"


def reference(q, k, v, sink, do, dlse, **opts):
    """(out, lse, grads of q, k, v, sink) of attention_ref in fp32 (the oracle) and in the input dtype."""
    results = []
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, upcast=upcast, learnable_sink=sink, **opts)
        loss = (out * do.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
        results.append((out, lse, torch.autograd.grad(loss, (q, k, v, sink))))
    return results


# the interpreter runs one backward, the deterministic one
DETERMINISTIC = [pytest.param(True, id="det")] + ([pytest.param(False, id="nondet")] if ON_GPU else [])


@pytest.mark.parametrize("deterministic", DETERMINISTIC)
@pytest.mark.parametrize("causal, window, softcap, alibi", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [pytest.param(s, id="b{}-sq{}-sk{}-h{}-hk{}-d{}".format(*s)) for s in SHAPES])
def test_sinks(shape, dtype, causal, window, softcap, alibi, deterministic):
    q, k, v = make_qkv(shape, dtype)
    sink = sink_like(shape[3])
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    if alibi:
        opts["alibi_slopes"] = (torch.rand(shape[3], device=DEVICE) * 0.3).float()
    out, lse, _ = flashattn2.flash_attn_func(
        q, k, v, return_attn_probs=True, deterministic=deterministic, learnable_sink=sink, **opts
    )
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v, sink))
    check("dense", out, lse, grads, *reference(q, k, v, sink, do, dlse, **opts), do, dlse, sink)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_take_the_gluon_kernels(headdim, causal):
    """A sink is one more line in the Gluon kernels' finish: a call with one plans the same kernels as without."""
    if planning.arch_of(torch.device(DEVICE)) != "sm90" or _runtime.hopper_kernels() is None:
        pytest.skip("the Gluon kernels do not run here (not sm_90, or another Triton)")
    q, k, v = make_qkv((2, 1024, 1024, 4, 2, headdim), torch.bfloat16)
    plans = []
    for sink in (None, sink_like(4)):
        text = flashattn2.explain(q, k, v, causal=causal, learnable_sink=sink)
        plans.append([line.split(": ")[1] for line in text.splitlines() if line.startswith(("Attention", "Backward"))])
        flashattn2.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)[0].sum().backward()
    assert plans[0] == plans[1] and plans[0][0].startswith("fwd_hopper") and plans[0][1].startswith("bwd_hopper"), plans
    assert sink.grad is not None and torch.isfinite(sink.grad).all()


def test_rows_that_see_no_key():
    """Causal with seqlen_q > seqlen_k: the top rows see no key; with a sink their output is 0, their logsumexp the
    sink's logit, and the sink's gradient there is the logsumexp's."""
    q, k, v = make_qkv((2, 90, 30, 4, 2, 32), torch.float16)
    sink = sink_like(4)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
    empty = slice(0, 60)
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    # (the kernels hold the sink in base 2: log2(e) and back, a rounding each)
    torch.testing.assert_close(lse[:, :, empty], sink.detach()[None, :, None].expand(2, 4, 60), rtol=1e-6, atol=1e-6)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v, sink))
    check("empty rows", out, lse, grads, *reference(q, k, v, sink, do, dlse, causal=True), do, dlse, sink)


def test_no_keys_at_all():
    """seqlen_k 0 (flash_attn accepts it, no kernel runs): out 0, lse the sink, d sink the lse gradient's sum."""
    q = randn(2, 5, 3, 16, dtype=torch.float16, requires_grad=True)
    k = v = randn(2, 0, 3, 16, dtype=torch.float16, requires_grad=True)
    sink = sink_like(3)
    out, lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sink.detach()[None, :, None].expand(2, 3, 5))
    dlse = torch.randn_like(lse)
    (dsink,) = torch.autograd.grad((lse * dlse).sum() + out.sum(), (sink,))
    torch.testing.assert_close(dsink, dlse.sum(dim=(0, 2)))


def test_varlen_without_keys_or_queries():
    """Varlen packs with no key rows or no query rows (total_k or total_q 0: the kernels' backward has nothing to run):
    out 0, lse the sink's logit where a row exists, the gradients zero and the sink's the lse gradient's sum."""
    q = randn(7, 3, 16, dtype=torch.float16, requires_grad=True)
    k = v = randn(0, 3, 16, dtype=torch.float16, requires_grad=True)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    cu_k = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    sink = sink_like(3)
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 4, 0, return_attn_probs=True, learnable_sink=sink
    )
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sink.detach()[:, None].expand(3, 7), rtol=1e-6, atol=1e-6)
    dlse = torch.randn_like(lse)
    dq, dsink = torch.autograd.grad((lse * dlse).sum() + out.sum(), (q, sink))
    assert torch.equal(dq, torch.zeros_like(dq))
    torch.testing.assert_close(dsink, dlse.sum(dim=1), rtol=1e-5, atol=1e-5)
    # no query rows: nothing to attend, nothing to differentiate but the (empty) sum
    q0 = randn(0, 3, 16, dtype=torch.float16, requires_grad=True)
    kv = randn(5, 3, 16, dtype=torch.float16, requires_grad=True)
    cu0, cu5 = torch.zeros(2, dtype=torch.int32, device=DEVICE), torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    out0 = flashattn2.flash_attn_varlen_func(q0, kv, kv, cu0, cu5, 0, 5, learnable_sink=sink)
    dkv, dsink0 = torch.autograd.grad(out0.sum(), (kv, sink), allow_unused=True)
    assert out0.shape == (0, 3, 16) and torch.equal(dkv, torch.zeros_like(dkv))
    assert dsink0 is None or torch.equal(dsink0, torch.zeros_like(dsink0))


def test_sink_changes_the_result_and_minus_inf_is_none():
    """Guards against the sink being silently ignored: a sink of 0 moves the output; one far below every score
    gives the result without a sink."""
    q, k, v = make_qkv((1, 64, 64, 2, 2, 32), torch.float16, requires_grad=False)
    base, base_lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True)
    zero = torch.zeros(2, device=DEVICE)
    assert (flashattn2.flash_attn_func(q, k, v, learnable_sink=zero).float() - base.float()).abs().max() > 1e-3
    far, far_lse, _ = flashattn2.flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=zero - 1e4)
    assert torch.equal(far, base)
    torch.testing.assert_close(far_lse, base_lse, rtol=0, atol=1e-6)


def test_deterministic_backward_is_bitwise_with_a_sink():
    q, k, v = make_qkv((2, 80, 100, 4, 2, 32), torch.float16)
    sink = sink_like(4)
    runs = []
    for _ in range(2):
        out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink)
        runs.append(torch.autograd.grad(out.square().sum(), (q, k, v, sink)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packing", ["qkv", "kv", "varlen-qkv", "varlen-kv"])
def test_packed_with_a_sink(packing):
    """The packed functions pass the sink on and return its gradient, equal to the unpacked call's."""
    h, d = 4, 32
    sink = sink_like(h)
    if packing.startswith("varlen"):
        lengths = [30, 1, 45]
        cu = cu_seqlens(lengths)
        qkv = randn(sum(lengths), 3, h, d, dtype=torch.float16, requires_grad=True)
        q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(1))
        if packing == "varlen-qkv":
            out = flashattn2.flash_attn_varlen_qkvpacked_func(qkv, cu, 45, causal=True, learnable_sink=sink)
        else:
            out = flashattn2.flash_attn_varlen_kvpacked_func(
                qkv[:, 0], qkv[:, 1:], cu, cu, 45, 45, causal=True, learnable_sink=sink
            )
        ref = flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, 45, 45, causal=True, learnable_sink=sink)
    else:
        qkv = randn(2, 50, 3, h, d, dtype=torch.float16, requires_grad=True)
        q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
        if packing == "qkv":
            out = flashattn2.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sink)
        else:
            out = flashattn2.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, learnable_sink=sink)
        ref = flashattn2.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    assert torch.equal(out, ref)
    do = torch.randn_like(out)
    (dsink,) = torch.autograd.grad(out, (sink,), do)
    (ref_dsink,) = torch.autograd.grad(ref, (sink,), do)
    assert torch.equal(dsink, ref_dsink)


def test_varlen_with_a_sink():
    """Per sequence, as the dense call on that sequence alone; rows past cu_seqlens[-1] stay 0 / +inf and add
    nothing to the sink's gradient (whatever the poisoned buffers held there)."""
    lengths_q, lengths_k, h, hk, d = [17, 0, 40, 1], [30, 5, 40, 9], 4, 2, 32
    extra = 3
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q = randn(sum(lengths_q) + extra, h, d, dtype=torch.float16, requires_grad=True)
    k = randn(sum(lengths_k), hk, d, dtype=torch.float16, requires_grad=True)
    v = randn(sum(lengths_k), hk, d, dtype=torch.float16, requires_grad=True)
    sink = sink_like(h)
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 40, 40, causal=True, return_attn_probs=True, learnable_sink=sink
    )
    do = torch.randn_like(out)
    grads = torch.autograd.grad((out * do).sum(), (q, k, v, sink))
    assert torch.equal(out[-extra:], torch.zeros_like(out[-extra:])) and torch.isposinf(lse[:, -extra:]).all()
    ref_dsink, formula, bound = (torch.zeros(h, dtype=torch.float64, device=DEVICE) for _ in range(3))
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t[None, s].detach().clone().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        ro, rl = attention_ref(qb, kb, vb, causal=True, learnable_sink=sink)
        lo, _ = attention_ref(qb, kb, vb, causal=True, learnable_sink=sink, upcast=False)
        assert_close(f"seq {b} out", out[qs][None], ro, lo, FWD_FACTOR)
        torch.testing.assert_close(lse[:, qs], rl[0], rtol=1e-4, atol=1e-4)
        rg = torch.autograd.grad((ro * do[qs][None].float()).sum(), (qb, kb, vb, sink))
        lg = torch.autograd.grad((lo * do[qs][None]).sum(), (qb, kb, vb))
        for name, g, r, low in zip(("dq", "dk", "dv"), (grads[0][qs], grads[1][ks], grads[2][ks]), rg, lg):
            assert_close(f"seq {b} {name}", g[None], r, low, BWD_FACTOR)
        ref_dsink += rg[3].double()
        if lengths_q[b] == 0:
            continue
        ours = (out[qs][None], lse[None, :, qs], do[qs][None], torch.zeros_like(rl))
        formula += sink_grad_of(sink, *ours[:2], *ours[2:])
        bound += dsink_bound(sink, ours[0], ours[1], ro, rl, ours[2], ours[3])
    # (d sink: as check() says, the formula on what the kernel stored, and the oracle within our errors' reach)
    torch.testing.assert_close(grads[3].double(), formula, rtol=1e-4, atol=1e-4)
    assert ((grads[3].double() - ref_dsink).abs() <= bound + 1e-4).all()


@pytest.mark.parametrize("num_splits", [1, 0, 3], ids=["no-split", "auto", "splits-3"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_with_a_sink(num_splits, paged):
    """Decode and chunked prefill over a cache: without splits the sink joins in the kernel, with them once in
    the combine; sequences of 0 keys (out 0, lse the sink), a short one, a full one."""
    batch, h, hk, d, capacity = 4, 8, 2, 64, 256 if ON_GPU else 48
    seqlen_q = 3
    q = randn(batch, seqlen_q, h, d, dtype=torch.float16)
    k_new, v_new = (randn(batch, 2, hk, d, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([0, 5, capacity - 2, capacity // 2], dtype=torch.int32, device=DEVICE)
    sink = sink_like(h, requires_grad=False)
    if paged:
        page = 16
        blocks = capacity // page
        k_cache, v_cache = (randn(batch * blocks, page, hk, d, dtype=torch.float16) for _ in range(2))
        table = torch.randperm(batch * blocks, device=DEVICE).to(torch.int32).view(batch, blocks)
        cache_args = dict(block_table=table)
    else:
        k_cache, v_cache = (randn(batch, capacity, hk, d, dtype=torch.float16) for _ in range(2))
        cache_args = {}
    for causal in (False, True):
        ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                          learnable_sink=sink, **cache_args)  # fmt: skip
        low = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                          learnable_sink=sink, upcast=False, **cache_args)  # fmt: skip
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flashattn2.flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=causal, num_splits=num_splits,
            return_softmax_lse=True, learnable_sink=sink, **cache_args,
        )  # fmt: skip
        assert_close("kvcache out", out, ref[0], low[0], FWD_FACTOR)
        assert_close("kvcache lse", lse, ref[1], low[1].float(), FWD_FACTOR)


def test_varlen_paged_prefill_with_a_sink():
    h, hk, d, page = 4, 2, 32, 16
    lengths_q, lengths_k = [5, 0, 20], [40, 3, 20]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    blocks = 3
    k_cache, v_cache = (randn(len(lengths_k) * blocks, page, hk, d, dtype=torch.float16) for _ in range(2))
    table = torch.arange(len(lengths_k) * blocks, device=DEVICE, dtype=torch.int32).flip(0).view(-1, blocks)
    q = randn(sum(lengths_q), h, d, dtype=torch.float16)
    sink = sink_like(h, requires_grad=False)
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, 20, 40, causal=True, return_attn_probs=True, block_table=table,
        learnable_sink=sink,
    )  # fmt: skip
    for b in range(len(lengths_q)):
        keys = k_cache[table[b].long()].flatten(0, 1)[None, : lengths_k[b]]
        vals = v_cache[table[b].long()].flatten(0, 1)[None, : lengths_k[b]]
        qs = slice(cu_q[b], cu_q[b + 1])
        ro, rl = attention_ref(q[None, qs], keys, vals, causal=True, learnable_sink=sink)
        lo, _ = attention_ref(q[None, qs], keys, vals, causal=True, learnable_sink=sink, upcast=False)
        assert_close(f"seq {b} out", out[qs][None], ro, lo, FWD_FACTOR)
        torch.testing.assert_close(lse[:, qs], rl[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "sink, error, match",
    [
        pytest.param([0.0, 1.0], ArgumentTypeError, "learnable_sink must be a torch.Tensor", id="list"),
        pytest.param("fp16", ArgumentTypeError, "learnable_sink must be float32", id="dtype"),
        pytest.param("shape", ArgumentError, r"learnable_sink must have shape \(nheads,\) = \(4,\)", id="shape"),
    ],
)
def test_bad_sinks_raise(sink, error, match):
    q, k, v = make_qkv((1, 8, 8, 4, 2, 16), torch.float16, requires_grad=False)
    if sink == "fp16":
        sink = torch.zeros(4, device=DEVICE, dtype=torch.float16)
    elif sink == "shape":
        sink = torch.zeros(2, device=DEVICE)
    calls = [
        lambda: flashattn2.flash_attn_func(q, k, v, learnable_sink=sink),
        lambda: flashattn2.flash_attn_with_kvcache(q, k, v, learnable_sink=sink),
        lambda: flashattn2.flash_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens([8]), cu_seqlens([8]), 8, 8, learnable_sink=sink
        ),
    ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()
