"""flash_attn_varlen_func and its packed forms: each sequence equals running it alone."""

import pytest
import torch

import flashattn2
from cases import cu_seqlens
from conftest import DEVICE, ON_GPU
from flashattn2.ops import planning
from flashattn2.ops.request import seqlens
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

T = planning.TileConfig
if ON_GPU:
    LENGTHS = [([1000, 0, 1, 4097, 333], [900, 7, 0, 4097, 1500]), ([2048] * 4, [2048] * 4)]
    PATHS = [pytest.param({}, id="table"), pytest.param({"tma": False}, id="no-tma")]
else:
    LENGTHS = [([70, 0, 1, 33, 5], [50, 9, 0, 33, 80]), ([64, 64], [64, 64])]
    PATHS = [
        pytest.param({}, id="ptr-64x64"),
        pytest.param(
            {"tma": True, "fwd": T(32, 64, 4, 1), "bwd_dkdv": T(16, 32, 4, 1), "bwd_dq": T(64, 16, 4, 1)},
            id="tma-mixed-tiles",
        ),
    ]
FEATURES = [
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window_size=(9, -1), softcap=2.0, alibi="bh"), id="causal-window-softcap-alibi"),
]


cu = cu_seqlens


def make(lengths_q, lengths_k, nheads=4, nheads_k=2, d=48, dtype=torch.float16, extra_rows=0):
    g = lambda n, h: torch.randn(n, h, d, device=DEVICE, dtype=dtype).requires_grad_()
    return g(sum(lengths_q) + extra_rows, nheads), g(sum(lengths_k), nheads_k), g(sum(lengths_k), nheads_k)


def resolve(opts, batch, nheads):
    opts = dict(opts)
    if opts.get("alibi") == "bh":
        opts["alibi_slopes"] = torch.rand(batch, nheads, device=DEVICE) * 0.5
    opts.pop("alibi", None)
    return opts


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("opts", FEATURES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed-with-empty", "equal"])
def test_varlen_matches_each_sequence_alone(lengths, opts, path):
    lengths_q, lengths_k = lengths
    q, k, v = make(lengths_q, lengths_k)
    opts = resolve(opts, len(lengths_q), q.shape[1])
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    with planning.force(**path):
        out, lse, _ = flashattn2.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_attn_probs=True, **opts
        )
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(lengths_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        seq_opts = dict(opts)
        if "alibi_slopes" in opts:
            seq_opts["alibi_slopes"] = opts["alibi_slopes"][b]
        qb, kb, vb = (t.detach()[s][None].requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        if lengths_k[b] == 0:  # no key: zeros and lse +inf, no gradient
            assert torch.all(out[sq] == 0) and torch.all(torch.isposinf(lse[:, sq]))
            assert torch.all(grads[0][sq] == 0)
            continue
        ref_out, ref_lse = attention_ref(qb, kb, vb, **seq_opts)
        low_out, low_lse = attention_ref(qb, kb, vb, upcast=False, **seq_opts)
        assert_close(f"out[{b}]", out[sq][None], ref_out, low_out, FWD_FACTOR)
        finite = torch.isfinite(ref_lse[0])
        assert_close(f"lse[{b}]", lse[:, sq][finite], ref_lse[0][finite], low_lse[0][finite], FWD_FACTOR)
        dob = do[sq][None]
        ref_grads = torch.autograd.grad(ref_out, (qb, kb, vb), dob.to(ref_out.dtype))
        low_grads = torch.autograd.grad(low_out, (qb, kb, vb), dob)
        assert_close(f"dq[{b}]", grads[0][sq][None], ref_grads[0], low_grads[0], BWD_FACTOR)
        assert_close(f"dk[{b}]", grads[1][sk][None], ref_grads[1], low_grads[1], BWD_FACTOR)
        assert_close(f"dv[{b}]", grads[2][sk][None], ref_grads[2], low_grads[2], BWD_FACTOR)
    # keys of sequences without queries get no gradient
    for b in range(len(lengths_q)):
        if lengths_q[b] == 0:
            sk = slice(cu_k[b], cu_k[b + 1])
            assert torch.all(grads[1][sk] == 0) and torch.all(grads[2][sk] == 0)


def test_rows_past_cu_seqlens_are_zero():
    lengths = [5, 9]
    q, k, v = make(lengths, lengths, extra_rows=6)
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, k, v, cu(lengths), cu(lengths), 9, 9, causal=True, return_attn_probs=True
    )
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
    assert torch.all(out[14:] == 0) and torch.all(torch.isposinf(lse[:, 14:])) and torch.all(dq[14:] == 0)
    assert not torch.isnan(out).any() and not torch.isnan(dq).any()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_packed_forms(causal):
    lengths = [30, 1, 47]
    total = sum(lengths)
    qkv = torch.randn(total, 3, 4, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    out = flashattn2.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths), max(lengths), causal=causal)
    do = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(1))
    ref = flashattn2.flash_attn_varlen_func(
        q, k, v, cu(lengths), cu(lengths), max(lengths), max(lengths), causal=causal
    )
    assert torch.equal(out, ref)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), do), dim=1))
    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out_kv = flashattn2.flash_attn_varlen_kvpacked_func(
        q, kv, cu(lengths), cu(lengths), max(lengths), torch.tensor(max(lengths)), causal=causal
    )
    assert torch.equal(out_kv, ref)


def test_varlen_matches_dense_batch():
    b, s = 3, 40
    q, k, v = (torch.randn(b, s, 4, 32, device=DEVICE, dtype=torch.float16) for _ in range(3))
    dense = flashattn2.flash_attn_func(q, k, v, causal=True)
    flat = lambda t: t.reshape(b * s, 4, 32)
    cu_s = cu([s] * b)
    varlen = flashattn2.flash_attn_varlen_func(flat(q), flat(k), flat(v), cu_s, cu_s, s, s, causal=True)
    assert torch.equal(varlen, flat(dense))


@pytest.mark.usefixtures("value_checks")
@pytest.mark.parametrize(
    "make_args, exc, match",
    [
        pytest.param(lambda c: (c.long(), c), TypeError, "cu_seqlens_q must be int32", id="cu-dtype"),
        pytest.param(lambda c: (c, c[:-1]), ValueError, "same length", id="cu-length"),
        pytest.param(lambda c: (c.flip(0).contiguous(), c), ValueError, "non-decreasing", id="cu-order"),
        pytest.param(lambda c: (c + 1, c), ValueError, "start at 0", id="cu-start"),
        pytest.param(lambda c: (c, c * 2), ValueError, "past the", id="cu-past-end"),
        pytest.param(lambda c: (c[None], c[None]), ValueError, "shape", id="cu-ndim"),
    ],
)
def test_bad_cu_seqlens(make_args, exc, match):
    lengths = [5, 9]
    q, k, v = make(lengths, lengths)
    cu_q, cu_k = make_args(cu(lengths))
    with pytest.raises(exc, match=match):
        flashattn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9)


@pytest.mark.usefixtures("value_checks")
def test_cu_seqlens_checked_once_until_modified():
    """Checked cu_seqlens are remembered (no host read on later calls) while unchanged; a new
    total or max_seqlen is still checked against them, and an in-place change forgets them."""
    lengths = [5, 9]
    q, k, v = make(lengths, lengths)
    cu_s = cu(lengths)
    ref = flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 9, 9)
    assert seqlens.known(cu_s) == (14, 9)
    assert torch.equal(flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 9, 9), ref)
    with pytest.raises(ValueError, match="exceeds max_seqlen_q"):
        flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 8, 9)
    with pytest.raises(ValueError, match="past the"):
        flashattn2.flash_attn_varlen_func(q[:10], k, v, cu_s, cu_s, 9, 9)
    cu_s[1] = 20
    assert seqlens.known(cu_s) is None
    with pytest.raises(ValueError, match="non-decreasing"):
        flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 20, 20)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longest_first_order_changes_nothing(causal, monkeypatch):
    """Once cu_seqlens are known the grid takes the sequences longest first (SeqOrder); the
    results, dropout's mask included, are bitwise those of the given order."""
    lengths = [5, 40, 0, 17, 33] if not ON_GPU else [300, 2000, 0, 900, 1500]
    q, k, v = make(lengths, lengths)
    cu_s = cu(lengths)
    do = torch.randn_like(q)
    results = []
    for sort in (False, True):
        if not sort:
            unsorted = seqlens.remembered
            monkeypatch.setattr(seqlens, "remembered", lambda cu: (unsorted(cu)[0], None))
        else:
            monkeypatch.undo()
        torch.manual_seed(7)
        out = flashattn2.flash_attn_varlen_func(
            q, k, v, cu_s, cu_s, max(lengths), max(lengths), dropout_p=0.2, causal=causal
        )
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    assert seqlens.remembered(cu_s)[1].tolist() == [1, 4, 3, 0, 2]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_unchecked_cu_seqlens_are_clamped_on_the_device():
    """Without value checks (the default) cu_seqlens' values are not read: one that runs past the
    rows is clamped into them on the device (the call equals one given the clamped values, the
    gradients too) and nothing raises. The clamped copy and the sequences longest first (computed
    on the device) are remembered for the next call with the same tensor, forgotten once it is
    modified in place."""
    lengths = [5, 9]
    q, k, v = make(lengths, lengths)
    cu_s = cu(lengths)
    past = cu_s.clone()
    past[-1] = 40  # the last sequence runs 26 rows past q's and k's 14
    do = torch.randn_like(q)
    results = []
    for given in (cu_s, past, past):
        out = flashattn2.flash_attn_varlen_func(q, k, v, given, given, 40, 40, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for result in results[1:]:
        for a, b in zip(results[0], result):
            assert torch.equal(a, b)
    values, order = seqlens.remembered(past)
    assert values is None and order.tolist() == [1, 0]
    past[1] = 2
    assert seqlens.remembered(past) == (None, None)
    pages = k.detach().new_zeros(4, 8, *k.shape[1:])
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():  # a block-table entry out of range is clamped to a real page, not followed
        out = flashattn2.flash_attn_varlen_func(q, pages, pages, past, cu_s, 9, 9, block_table=table + 2)
    assert torch.isfinite(out).all()


def test_clamp_follows_every_call():
    """The clamp runs on every call: a cu_seqlens first met with fewer rows gives the right result with more, new
    values written where torch does not see them (.data) are the ones the kernels read, a tensor first seen under
    inference mode then takes a training call's backward, and a compiled call (fullgraph) is clamped too."""
    lengths = [3, 7]
    cu_s = cu(lengths)
    q, k, v = make(lengths, lengths)
    with torch.no_grad():
        flashattn2.flash_attn_varlen_func(q[:8], k[:8], v[:8], cu_s, cu_s, 7, 7)  # clamped to 8 rows
        assert torch.equal(
            flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 7, 7),
            flashattn2.flash_attn_varlen_func(q, k, v, cu_s.clone(), cu_s.clone(), 7, 7),
        )
        cu_s.data.copy_(cu([6, 4]))  # no version bump
        assert torch.equal(
            flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 7, 7),
            flashattn2.flash_attn_varlen_func(q, k, v, cu([6, 4]), cu([6, 4]), 7, 7),
        )
    fresh = cu(lengths)
    with torch.inference_mode():
        flashattn2.flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), fresh, fresh, 7, 7)
    flashattn2.flash_attn_varlen_func(q, k, v, fresh, fresh, 7, 7).sum().backward()
    assert q.grad is not None
    past = cu([3, 7])
    past[-1] = 30
    compiled = torch.compile(
        lambda q, k, v, c: flashattn2.flash_attn_varlen_func(q, k, v, c, c, 30, 30), fullgraph=True, backend="aot_eager"
    )
    with torch.no_grad():
        assert torch.equal(
            compiled(q, k, v, past), flashattn2.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 30, 30)
        )


@pytest.mark.usefixtures("value_checks")
def test_varlen_under_inference_mode():
    """Tensors made under torch.inference_mode have no version counter: never remembered, still
    checked on every call."""
    lengths = [5, 9]
    with torch.inference_mode():
        q, k, v = (t.detach() for t in make(lengths, lengths))
        cu_s = cu(lengths)
        out = flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 9, 9)
        assert seqlens.known(cu_s) is None
        assert torch.equal(flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 9, 9), out)
        with pytest.raises(ValueError, match="exceeds max_seqlen_q"):
            flashattn2.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 8, 9)


def test_paged_forward_with_inputs_requiring_grad():
    """As flash_attn (its tests run the paged forward on inputs that require grad): the forward
    runs and equals the no-grad one; only a backward through it raises, naming what is missing."""
    lengths = [5, 9]
    q, k, v = make(lengths, lengths)
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=DEVICE)
    pages = [torch.randn(4, 8, *k.shape[1:], device=DEVICE, dtype=k.dtype).requires_grad_() for _ in range(2)]
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, *pages, cu(lengths), cu(lengths), 9, 9, causal=True, block_table=table, return_attn_probs=True
    )
    assert out.requires_grad
    with torch.no_grad():
        expected, expected_lse, _ = flashattn2.flash_attn_varlen_func(
            q, *pages, cu(lengths), cu(lengths), 9, 9, causal=True, block_table=table, return_attn_probs=True
        )
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    with pytest.raises(NotImplementedError, match="block_table is forward-only"):
        out.sum().backward()
    with pytest.raises(NotImplementedError, match="block_table is forward-only"):
        torch.autograd.grad(lse.sum(), q)
    assert q.grad is None and all(p.grad is None for p in pages)


def test_paged_op_and_compiled_paged_call():
    """flashattn2::fwd_varlen_paged, whose schema is the request's (request.op_schema): opcheck over a request's
    op_args (a window, a scale and a sink set, so that a field dropped or shifted changes the result), and a
    fullgraph-compiled paged call equal to the eager one."""
    from flashattn2.ops.request import request
    from flashattn2.ops.run import registry

    lengths = [5, 9]
    q, _, _ = (t.detach() for t in make(lengths, lengths))
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=DEVICE)
    pages = [torch.randn(4, 8, 2, 48, device=DEVICE, dtype=q.dtype) for _ in range(2)]
    sink = torch.randn(4, device=DEVICE, dtype=torch.float32)
    kwargs = dict(causal=True, window_size=(3, 0), softmax_scale=0.3, block_table=table, learnable_sink=sink)
    r = request.AttentionRequest(q, *pages, cu(lengths), cu(lengths), 9, 9, **kwargs)
    torch.library.opcheck(registry.fwd_varlen_paged, request.op_args(r), test_utils=("test_schema", "test_faketensor"))
    out, lse = registry.fwd_varlen_paged(*request.op_args(r))
    eager = flashattn2.flash_attn_varlen_func(q, *pages, cu(lengths), cu(lengths), 9, 9, **kwargs)
    assert torch.equal(out, eager) and lse.shape == (4, sum(lengths))
    call = lambda q, k, v, cu_q, cu_k: flashattn2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, **kwargs)
    compiled = torch.compile(call, fullgraph=True, backend="eager")(q, *pages, cu(lengths), cu(lengths))
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.usefixtures("value_checks")
def test_bad_varlen_arguments():
    lengths = [5, 9]
    q, k, v = make(lengths, lengths)
    with pytest.raises(ValueError, match="exceeds max_seqlen_q"):
        flashattn2.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 8, 9)
    pages = k.new_zeros(4, 8, *k.shape[1:])
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        flashattn2.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 9, 9, block_table=cu(lengths)[None])
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flashattn2.flash_attn_varlen_func(
            q.detach(), pages, pages, cu(lengths), cu(lengths), 9, 9, dropout_p=0.1, block_table=table
        )
    with pytest.raises(ValueError, match="block_table entries"):
        flashattn2.flash_attn_varlen_func(
            q.detach(), pages, pages, cu(lengths), cu(lengths), 9, 9, block_table=table + 2
        )
    q = q.detach()
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        flashattn2.flash_attn_varlen_func(q[None], k, v, cu(lengths), cu(lengths), 9, 9)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashattn2.flash_attn_varlen_func(
            q, k, v, cu(lengths), cu(lengths), 9, 9, alibi_slopes=torch.ones(3, 4, device=DEVICE)
        )
