"""The batch-invariant mode (flashattn2.batch_invariant, ops/request/invariance.py): a row's output and logsumexp are
the same bits alone or in any batch, anywhere in a varlen pack, over a contiguous or a paged cache of any page size, and
in a causal prefill or a decode step over a cache holding the same keys; the backward is the deterministic one.
Fresh random inputs and lengths each run; each comparison is bitwise (torch.equal), and the mode's results are
checked against the reference too."""

import os
import subprocess
import sys

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2.errors import ArgumentTypeError
from flashattn2.ops.run import attention
from flashattn2.ops.request import invariance
from flashattn2.ops import planning
from flashattn2.ops.run import call as calls
from flashattn2.reference import FWD_FACTOR, attention_ref
from tolerance import assert_close

# (heads, kv heads, head dim, longest sequence): the interpreter splits every 32 keys, the GPU every 4096
DIMS = [(4, 2, 64, 120), (2, 2, 128, 100)] if not ON_GPU else [(8, 2, 128, 9000), (4, 4, 64, 5000)]
OPTIONS = [
    pytest.param({}, id="plain"),
    pytest.param(dict(window_size=(40, 0)), id="window"),
    pytest.param(dict(softcap=5.0, alibi=True, sink=True), id="softcap-alibi-sink"),
]
PAGES = [16, 7] if not ON_GPU else [64, 16, 7]


def _kw(opts, h):
    """flash_attn's keyword arguments of an OPTIONS entry (ALiBi slopes and sink logits drawn per call)."""
    kw = {k: v for k, v in opts.items() if k not in ("alibi", "sink")}
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.rand(h, device=DEVICE, dtype=torch.float32) * 0.3
    if opts.get("sink"):
        kw["learnable_sink"] = torch.randn(h, device=DEVICE, dtype=torch.float32)
    return kw


def _paged(k_cache, v_cache, page):
    """(batch, capacity, hk, d) K and V caches as shuffled pages (num_blocks, page, hk, d) under one block table:
    (k_pages, v_pages, table)."""
    batch, capacity = k_cache.shape[:2]
    per_seq = -(-capacity // page)
    table = torch.randperm(batch * per_seq, device=DEVICE).view(batch, per_seq).to(torch.int32)
    out = []
    for cache in (k_cache, v_cache):
        padded = torch.zeros(batch, per_seq * page, *cache.shape[2:], dtype=cache.dtype, device=DEVICE)
        padded[:, :capacity] = cache
        pages = torch.empty(batch * per_seq, page, *cache.shape[2:], dtype=cache.dtype, device=DEVICE)
        pages[table.flatten().long()] = padded.reshape(batch * per_seq, page, *cache.shape[2:])
        out.append(pages)
    return (*out, table)


def test_mode_switches(monkeypatch):
    """set_batch_invariant sets the default and returns the previous one; batch_invariant() overrides it for its
    block (nested, on or off); bad types raise naming the function; FLASHATTN2_BATCH_INVARIANT=1 turns it on."""
    assert not invariance.enabled()
    with flashattn2.batch_invariant():
        assert invariance.enabled()
        with flashattn2.batch_invariant(False):
            assert not invariance.enabled()
        assert invariance.enabled()
    assert not invariance.enabled()
    assert flashattn2.set_batch_invariant(True) is False
    try:
        assert invariance.enabled()
        with flashattn2.batch_invariant(False):
            assert not invariance.enabled()
    finally:
        assert flashattn2.set_batch_invariant(False) is True
    with pytest.raises(ArgumentTypeError, match="set_batch_invariant"):
        flashattn2.set_batch_invariant(1)
    with pytest.raises(ArgumentTypeError, match="batch_invariant"):
        with flashattn2.batch_invariant("yes"):
            pass
    code = "import flashattn2.ops.request.invariance as m; print(m.enabled())"
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, FLASHATTN2_BATCH_INVARIANT=value, TRITON_INTERPRET="1")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert run.stdout.strip() == expected, run.stderr[-2000:]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: "h{}-hk{}-d{}".format(*d[:3]))
def test_decode_alone_and_in_a_batch(dims, opts):
    """Decoding a batch of 6 sequences of random lengths (contiguous, then paged with several page sizes, with
    cache_batch_idx) gives each row the bits it gets decoding alone over a cache of its own length (other split
    counts: the merge's fixed width); the mode's results obey the reference."""
    h, hk, d, longest = dims
    batch, dtype = 6, torch.bfloat16
    capacity = longest + 3
    lens = torch.randint(1, longest, (batch,), dtype=torch.int32, device=DEVICE)
    lens[0] = longest  # at least one sequence past a split boundary
    k_cache, v_cache = (randn(batch, capacity, hk, d, dtype=dtype) for _ in range(2))
    q = randn(batch, 1, h, d, dtype=dtype)
    kw = _kw(opts, h)
    with flashattn2.batch_invariant():
        out, lse = flashattn2.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True, **kw
        )
        for b in range(batch):  # alone, over a cache of its own length: fewer splits than the batch's
            n = int(lens[b])
            alone, alone_lse = flashattn2.flash_attn_with_kvcache(
                q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], cache_seqlens=lens[b : b + 1],
                return_softmax_lse=True, **kw,
            )  # fmt: skip
            assert torch.equal(alone, out[b : b + 1]) and torch.equal(alone_lse, lse[b : b + 1]), b
        order = torch.randperm(batch, device=DEVICE)  # a cache row per sequence, in another order
        shuffled = flashattn2.flash_attn_with_kvcache(
            q, k_cache[order], v_cache[order], cache_seqlens=lens, cache_batch_idx=torch.argsort(order).to(torch.int32),
            **kw,
        )  # fmt: skip
        assert torch.equal(shuffled, out)
        for page in PAGES:
            k_pages, v_pages, table = _paged(k_cache, v_cache, page)
            paged, paged_lse = flashattn2.flash_attn_with_kvcache(
                q, k_pages, v_pages, cache_seqlens=lens, block_table=table, return_softmax_lse=True, **kw
            )
            assert torch.equal(paged, out) and torch.equal(paged_lse, lse), page
    for b in (0, 1):
        ref, _ = attention_ref(
            q[b : b + 1], k_cache[b : b + 1, : lens[b]], v_cache[b : b + 1, : lens[b]], **_ref_kw(kw)
        )
        low, _ = attention_ref(
            q[b : b + 1], k_cache[b : b + 1, : lens[b]], v_cache[b : b + 1, : lens[b]], upcast=False, **_ref_kw(kw)
        )
        assert_close(f"sequence {b}", out[b : b + 1], ref, low, FWD_FACTOR)


def _ref_kw(kw):
    return {("learnable_sink" if k == "learnable_sink" else k): v for k, v in kw.items()}


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: "h{}-hk{}-d{}".format(*d[:3]))
def test_prefill_and_decode_agree(dims, opts):
    """A causal prefill's last rows (flash_attn_func and, packed among other sequences, flash_attn_varlen_func)
    equal decoding those tokens over a cache holding the same keys: one new token, three at once, and one appended
    through flash_attn_with_kvcache's k/v, over a contiguous and a paged cache."""
    h, hk, d, longest = dims
    dtype = torch.float16
    length = longest - 5
    q, k, v = (
        randn(1, length, h, d, dtype=dtype),
        randn(1, length, hk, d, dtype=dtype),
        randn(1, length, hk, d, dtype=dtype),
    )
    kw = _kw(opts, h)
    capacity = length + 2 * (planning.INVARIANT_SPLIT_KEYS if ON_GPU else planning.INVARIANT_SPLIT_KEYS_INTERP)
    k_cache, v_cache = torch.zeros(1, capacity, hk, d, dtype=dtype, device=DEVICE), None
    k_cache[:, :length] = k
    v_cache = torch.zeros_like(k_cache)
    v_cache[:, :length] = v
    seqlens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    with flashattn2.batch_invariant():
        out, lse, _ = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **kw)
        other = torch.randint(1, longest, (2,)).tolist()
        lengths = [other[0], length, other[1]]
        qs = [randn(n, h, d, dtype=dtype) for n in lengths]
        ks = [randn(n, hk, d, dtype=dtype) for n in lengths]
        vs = [randn(n, hk, d, dtype=dtype) for n in lengths]
        qs[1], ks[1], vs[1] = q[0], k[0], v[0]
        cu = cu_seqlens(lengths)
        packed, packed_lse, _ = flashattn2.flash_attn_varlen_func(
            torch.cat(qs), torch.cat(ks), torch.cat(vs), cu, cu, max(lengths), max(lengths), causal=True,
            return_attn_probs=True, **kw,
        )  # fmt: skip
        start = lengths[0]
        assert torch.equal(packed[start : start + length], out[0])
        assert torch.equal(packed_lse[:, start : start + length], lse[0])
        for new in (1, 3):
            step, step_lse = flashattn2.flash_attn_with_kvcache(
                q[:, -new:], k_cache, v_cache, cache_seqlens=seqlens, causal=True, return_softmax_lse=True, **kw
            )
            assert torch.equal(step, out[:, -new:]) and torch.equal(step_lse, lse[:, :, -new:]), new
        k_pages, v_pages, table = _paged(k_cache, v_cache, 16)
        step = flashattn2.flash_attn_with_kvcache(
            q[:, -1:], k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=True, **kw
        )
        assert torch.equal(step, out[:, -1:])
        # the last token appended by the call itself (the cache holds the others)
        k_cache[:, length - 1] = 0
        v_cache[:, length - 1] = 0
        step = flashattn2.flash_attn_with_kvcache(
            q[:, -1:], k_cache, v_cache, k[:, -1:], v[:, -1:], cache_seqlens=seqlens - 1, causal=True, **kw
        )
        assert torch.equal(step, out[:, -1:])
    ref, _ = attention_ref(q, k, v, causal=True, **_ref_kw(kw))
    low, _ = attention_ref(q, k, v, causal=True, upcast=False, **_ref_kw(kw))
    assert_close("prefill", out, ref, low, FWD_FACTOR)


@pytest.mark.parametrize(
    "case",
    [(torch.float32, 4, 2, 64, 64), (torch.bfloat16, 4, 1, 192, 128), (torch.float16, 3, 3, 96, 96)],
    ids=["fp32-gqa", "bf16-mqa-d192-dv128", "fp16-mha-d96"],
)
def test_entry_points_agree_with_decode(case):
    """Every dense entry point runs the mode: flash_attn_func, the packed functions where the shapes allow them and
    flash_attn_interface's private forward (fp16/bf16) give a causal prefill's last row the bits of decoding that token over a
    cache of the same keys (a longer cache: more splits); fp32, MQA and a value head dim of its own included."""
    from flashattn2 import flash_attn_interface

    dtype, h, hk, d, dv = case
    length = DIMS[0][3] - 7 if ON_GPU else 50
    q, k, v = (
        randn(2, length, h, d, dtype=dtype),
        randn(2, length, hk, d, dtype=dtype),
        randn(2, length, hk, dv, dtype=dtype),
    )
    extra = 2 * (planning.INVARIANT_SPLIT_KEYS if ON_GPU else planning.INVARIANT_SPLIT_KEYS_INTERP)
    k_cache = torch.cat([k, k.new_zeros(2, extra, hk, d)], 1)
    v_cache = torch.cat([v, v.new_zeros(2, extra, hk, dv)], 1)
    seqlens = torch.full((2,), length, dtype=torch.int32, device=DEVICE)
    with flashattn2.batch_invariant():
        step = flashattn2.flash_attn_with_kvcache(q[:, -1:], k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        outs = {"func": flashattn2.flash_attn_func(q, k, v, causal=True)}
        if dtype != torch.float32:  # (flash_attn's private functions take fp16/bf16 only)
            outs["private"] = flash_attn_interface._flash_attn_forward(
                q, k, v, 0.0, d**-0.5, True, -1, -1, 0.0, None, False
            )[0]
        if d == dv:
            outs["kvpacked"] = flashattn2.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True)
        if d == dv and h == hk:
            outs["qkvpacked"] = flashattn2.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True)
    for name, out in outs.items():
        assert torch.equal(out[:, -1:], step), name
    ref, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close("func", outs["func"], ref, low, FWD_FACTOR)


def test_backward_is_deterministic_in_the_mode(monkeypatch):
    """deterministic=False yields to the mode: the backward takes the deterministic path (and its gradients obey the
    reference)."""
    seen = []
    real = attention.backward
    monkeypatch.setattr(attention, "backward", lambda *a, **kw: seen.append(a[0].spec.deterministic) or real(*a, **kw))
    h, hk, d, _ = DIMS[0]
    q, k, v = (randn(1, 70, n, d, dtype=torch.float16, requires_grad=True) for n in (h, hk, hk))
    with flashattn2.batch_invariant():
        out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=False)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert seen == [True] and all(torch.isfinite(g).all() for g in grads)
    out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=False)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert seen == [True, False]
    from flashattn2 import flash_attn_interface

    qd, kd, vd = (t.detach() for t in (q, k, v))
    with flashattn2.batch_invariant():  # the private backward, as ring-attention libraries call it
        out, lse = flash_attn_interface._flash_attn_forward(qd, kd, vd, 0.0, d**-0.5, True, -1, -1, 0.0, None, False)[
            :2
        ]
        grads = [torch.empty_like(t) for t in (qd, kd, vd)]
        flash_attn_interface._flash_attn_backward(
            torch.randn_like(out), qd, kd, vd, out, lse, *grads, 0.0, d**-0.5, True, -1, -1, 0.0, None, False
        )
    assert seen == [True, False, True]


def test_mode_refuses_dropout_and_too_many_keys(monkeypatch):
    h, hk, d, _ = DIMS[0]
    q, k, v = (randn(1, 40, n, d, dtype=torch.float16) for n in (h, hk, hk))
    with flashattn2.batch_invariant():
        with pytest.raises(NotImplementedError, match="dropout_p > 0 in batch-invariant mode"):
            flashattn2.flash_attn_func(q, k, v, dropout_p=0.1)
        calls.clear()  # plans are made once per spec
        monkeypatch.setattr(planning.decoding, "INVARIANT_MAX_SPLITS", 1)
        monkeypatch.setattr(planning.decoding, "INVARIANT_SPLIT_KEYS", 16)
        monkeypatch.setattr(planning.decoding, "INVARIANT_SPLIT_KEYS_INTERP", 16)
        with pytest.raises(
            NotImplementedError, match="batch-invariant mode: a sequence of up to 40 keys .* more than 1 splits"
        ):
            flashattn2.flash_attn_func(q, k, v)
    calls.clear()


def test_mode_under_torch_compile():
    """A compiled call (fullgraph) runs the mode's kernel when the mode is on at run time: its rows equal the eager
    mode's decode step, bit for bit."""
    h, hk, d, _ = DIMS[0]
    q, k, v = (randn(1, 50, n, d, dtype=torch.float16) for n in (h, hk, hk))
    compiled = torch.compile(lambda q, k, v: flashattn2.flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    seqlens = torch.tensor([50], dtype=torch.int32, device=DEVICE)
    with flashattn2.batch_invariant():
        out = compiled(q, k, v)
        step = flashattn2.flash_attn_with_kvcache(q[:, -1:], k, v, cache_seqlens=seqlens, causal=True)
    assert torch.equal(out[:, -1:], step)
