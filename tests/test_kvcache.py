"""flash_attn_with_kvcache against the plain-PyTorch reference (append, rotate, attend): output and
logsumexp by flash-attn's rule (factor 3, 5 with ALiBi), cache contents after the call, splits
against no split. On the CPU a pairwise covering sample of the options; on the GPU more."""

import itertools
import random
from dataclasses import astuple

import pytest
import torch

import flashattn2
from flashattn2.ops import _runtime
from cases import cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2.reference import tolerance
from flashattn2.reference.kvcache import kvcache_ref
from tolerance import assert_close

# option -> its values; the first value is the plain one
OPTIONS = {
    "dtype": [torch.float16, torch.bfloat16, torch.float32],
    "paged": [None, 16, 5],  # page size (None: a contiguous cache)
    "seqlen_new": [0, 1, 4],
    "rotary": [None, "neox", "gptj"],
    "mask": ["none", "causal", "window", "causal-window"],
    "softcap": [0.0, 3.0],
    "alibi": [False, True],
    "group": [1, 2, 4, 8],  # nheads / nheads_k
    "seqlen_q": [1, 3, 9],  # 9 x group 8: several row blocks
    "seqlens": ["tensor", "int"],
    "batch_idx": [False, True],
    "leftpad": [False, True],
    "splits": [1, 0, 3],
}


def _valid(c):
    if c.get("rotary") and c.get("seqlen_new") == 0:
        return False  # rotary is applied on append
    if c.get("batch_idx") and c.get("paged"):
        return False  # unsupported, as in flash_attn
    return True


def pairwise(options, seed=0):
    """A small list of configurations (dicts) in which every pair of values of two options
    appears at least once (greedy covering; invalid combinations skipped)."""
    rng = random.Random(seed)
    names = list(options)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in options[a]
        for vb in options[b]
        if _valid({a: va, b: vb})
    }
    configs = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(60):
            a, va, b, vb = rng.choice(sorted(uncovered, key=repr))
            c = {a: va, b: vb}
            for n in names:
                if n in c:
                    continue
                choices = [v for v in options[n] if _valid({**c, n: v})]
                # the value that covers most still-uncovered pairs with what is chosen so far
                c[n] = max(
                    choices,
                    key=lambda v: (
                        sum((m, c[m], n, v) in uncovered or (n, v, m, c[m]) in uncovered for m in c)
                        + rng.random() * 0.1
                    ),
                )
            gain = sum((x, c[x], y, c[y]) in uncovered for x, y in itertools.combinations(names, 2))
            if _valid(c) and gain > best_gain:
                best, best_gain = c, gain
        configs.append(best)
        uncovered -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(names, 2)}
    return configs


def _id(c):
    parts = [str(c["dtype"]).replace("torch.", "")]
    parts += [f"{k}={v}" for k, v in c.items() if k != "dtype" and v != OPTIONS[k][0]]
    return "-".join(parts)


CONFIGS = pairwise(OPTIONS)
if ON_GPU:  # and a denser sample: three more covering arrays with other seeds
    CONFIGS += pairwise(OPTIONS, 1) + pairwise(OPTIONS, 2) + pairwise(OPTIONS, 3)
HEADDIMS = [128, 64, 40] if not ON_GPU else [128, 256, 64, 96]
CAPACITY = 70 if not ON_GPU else 3000


def make_case(c, head_dim, capacity=CAPACITY, batch=3, nheads_k=2):
    dtype, group = c["dtype"], c["group"]
    nheads = nheads_k * group
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    seqlen_new = c["seqlen_new"]
    if c["seqlens"] == "int":
        seqlens = int(torch.randint(0, capacity - seqlen_new + 1, (1,), generator=gen))
        lens = torch.full((batch,), seqlens)
    else:
        lens = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=gen)
        lens[0] = capacity - seqlen_new  # one sequence fills its cache
        seqlens = lens.to(torch.int32).to(DEVICE)
    q = randn(batch, c["seqlen_q"], nheads, head_dim, dtype=dtype)
    kwargs = dict(cache_seqlens=seqlens)
    if c["paged"]:
        page = c["paged"]
        max_blocks = -(-capacity // page)
        num_blocks = batch * max_blocks + 3
        k_cache = randn(num_blocks, page, nheads_k, head_dim, dtype=dtype)
        perm = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
        kwargs["block_table"] = perm.view(batch, max_blocks).to(torch.int32).to(DEVICE)
    else:
        rows = batch + 2 if c["batch_idx"] else batch
        k_cache = randn(rows, capacity, nheads_k, head_dim, dtype=dtype)
        if c["batch_idx"]:
            kwargs["cache_batch_idx"] = torch.randperm(rows, generator=gen)[:batch].to(torch.int32).to(DEVICE)
    v_cache = torch.randn_like(k_cache)
    if seqlen_new:
        kwargs["k"] = randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
        kwargs["v"] = randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    if c["leftpad"]:
        kwargs["cache_leftpad"] = (
            (torch.rand(batch, generator=gen) * (lens + 1)).long().clamp(max=lens).to(torch.int32).to(DEVICE)
        )
    if c["rotary"]:
        rotary_dim = head_dim if head_dim % 32 else head_dim // 2
        angle = torch.rand(capacity + 16, rotary_dim // 2, device=DEVICE) * 6.28  # causal q may reach past the keys
        kwargs.update(
            rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=c["rotary"] == "gptj"
        )
    mask = c["mask"]
    kwargs["causal"] = "causal" in mask
    if "window" in mask:
        kwargs["window_size"] = (
            int(torch.randint(0, capacity // 2, (1,), generator=gen)),
            -1 if "causal" in mask else int(torch.randint(0, 4, (1,), generator=gen)),
        )
    kwargs["softcap"] = c["softcap"]
    if c["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device=DEVICE) * 0.3
    return q, k_cache, v_cache, kwargs


def run_ours(q, k_cache, v_cache, kwargs, splits):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out, lse = flashattn2.flash_attn_with_kvcache(
        q, k_cache, v_cache, **kwargs, num_splits=splits, return_softmax_lse=True
    )
    return out, lse, k_cache, v_cache


def check(q, k_cache, v_cache, kwargs, splits, name=""):
    out, lse, k_after, v_after = run_ours(q, k_cache, v_cache, kwargs, splits)
    ref_out, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, **kwargs)
    low_out, _, _, _ = kvcache_ref(q, k_cache, v_cache, **kwargs, upcast=False)
    factor = 5.0 if "alibi_slopes" in kwargs else 3.0
    assert_close(name + "out", out, ref_out, low_out, factor)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows without keys must have lse +inf"
    assert (lse[~finite] == float("inf")).all()
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=1e-3, atol=1e-3)
    if "rotary_cos" in kwargs:  # rotated in fp32 by both, rounded once: equal up to an ulp
        torch.testing.assert_close(k_after, ref_k, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(k_after, ref_k)
    assert torch.equal(v_after, ref_v)
    return out, lse


@pytest.mark.parametrize("config", [pytest.param(c, id=_id(c)) for c in CONFIGS])
def test_kvcache(config):
    head_dim = HEADDIMS[CONFIGS.index(config) % len(HEADDIMS)]
    q, k_cache, v_cache, kwargs = make_case(config, head_dim)
    check(q, k_cache, v_cache, kwargs, config["splits"])


# On the H200, the full product of the options that choose a kernel path (dtype, page, rotary,
# mask, GQA packing, split), at small sizes; the other options at their plain values.
PRODUCT = (
    [
        dict(zip(("dtype", "paged", "rotary", "mask", "group", "splits"), values))
        for values in itertools.product(
            [torch.float16, torch.bfloat16], [None, 16, 5], [None, "neox", "gptj"], OPTIONS["mask"], [1, 8], [1, 0]
        )
    ]
    if ON_GPU
    else []
)


@pytest.mark.skipif(not ON_GPU, reason="the full product runs on the GPU; the CPU runs the pairwise sample")
@pytest.mark.parametrize("config", [pytest.param(c, id=_id({**c, "seqlen_new": 4})) for c in PRODUCT])
def test_kvcache_product(config):
    c = {name: values[0] for name, values in OPTIONS.items()} | config | {"seqlen_new": 4, "seqlen_q": 4}
    q, k_cache, v_cache, kwargs = make_case(c, 128, capacity=700)
    check(q, k_cache, v_cache, kwargs, c["splits"])


@pytest.mark.big_memory
@pytest.mark.skipif(not ON_GPU, reason="128k-token caches are for the GPU")
@pytest.mark.parametrize("paged", [None, 16, 256], ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
def test_long_cache(paged, group):
    """Caches up to 128k keys: split (heuristic) and unsplit against the reference."""
    c = {name: values[0] for name, values in OPTIONS.items()} | dict(
        dtype=torch.bfloat16, paged=paged, seqlen_new=1, rotary="neox", group=group
    )
    q, k_cache, v_cache, kwargs = make_case(c, 128, capacity=131072, batch=2)
    for splits in (0, 1):
        check(q, k_cache, v_cache, kwargs, splits, name=f"splits={splits} ")


def test_pairwise_sample_covers_every_pair():
    covered = {(a, c[a], b, c[b]) for c in CONFIGS for a, b in itertools.combinations(OPTIONS, 2)}
    for a, b in itertools.combinations(OPTIONS, 2):
        for va in OPTIONS[a]:
            for vb in OPTIONS[b]:
                if _valid({a: va, b: vb}):
                    assert (a, va, b, vb) in covered, (a, va, b, vb)


PDL = [False, pytest.param(True, marks=pytest.mark.skipif(not ON_GPU, reason="programmatic dependent launch: sm90"))]


@pytest.mark.parametrize("pdl", PDL)
@pytest.mark.parametrize("splits", [2, 5, 64])
def test_splits_match_no_split(splits, pdl, monkeypatch):
    monkeypatch.setattr(_runtime, "PDL", pdl)
    c = dict(
        dtype=torch.float16,
        paged=16,
        seqlen_new=2,
        rotary=None,
        mask="causal",
        softcap=0.0,
        alibi=False,
        group=4,
        seqlen_q=2,
        seqlens="tensor",
        batch_idx=False,
        leftpad=True,
        splits=1,
    )
    q, k_cache, v_cache, kwargs = make_case(c, 64)
    one, lse_one, _, _ = run_ours(q, k_cache, v_cache, kwargs, 1)
    out, lse = check(q, k_cache, v_cache, kwargs, splits)
    ref, _, _, _ = kvcache_ref(q, k_cache, v_cache, **kwargs)
    # the split result is as close to the reference as the unsplit one, by the same rule
    ok, err, bound = tolerance.check(out, ref, one, 2.0)
    assert ok or err <= 2 * (one.double() - ref.double()).abs().max().item() + 1e-3, (err, bound)
    finite = torch.isfinite(lse_one)
    torch.testing.assert_close(lse[finite], lse_one[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
@pytest.mark.parametrize("pdl", [False, True])
def test_split_decode_in_cuda_graph(pdl, monkeypatch):
    """A split decode step captured in a CUDA graph (as serving engines run it) replays the eager
    result, with the combine launched as a programmatic dependent launch or not."""
    monkeypatch.setattr(_runtime, "PDL", pdl)
    q = randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = randn(1, 8192, 8, 128, dtype=torch.bfloat16), randn(1, 8192, 8, 128, dtype=torch.bfloat16)
    seqlens = torch.tensor([8000], dtype=torch.int32, device=DEVICE)

    def step():
        return flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=16)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_empty_sequences_and_full_cache():
    """A sequence with no keys at all (cache_seqlens 0, nothing appended) gives 0 and lse +inf;
    cache_seqlens=None attends to the whole cache."""
    q = randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache, v_cache = randn(2, 20, 2, 32, dtype=torch.float16), randn(2, 20, 2, 32, dtype=torch.float16)
    seqlens = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out, lse = flashattn2.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits, return_softmax_lse=True
        )
        assert torch.equal(out[0], torch.zeros_like(out[0])) and (lse[0] == float("inf")).all()
    check(q, k_cache, v_cache, {}, 0)


@pytest.mark.parametrize("splits", [1, 3])
def test_returned_lse_is_the_callers(splits):
    """A call without return_softmax_lse may write its logsumexp into a buffer such calls share (kvcache.Decode): a
    logsumexp returned to a caller is never that buffer, so later calls, with or without it, leave it as returned; the
    outputs are the same either way, call after call."""
    q = randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache, v_cache = randn(2, 20, 2, 32, dtype=torch.float16), randn(2, 20, 2, 32, dtype=torch.float16)
    seqlens = torch.tensor([5, 11], dtype=torch.int32, device=DEVICE)
    call = lambda q, **kw: flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kw)
    out, lse = call(q, num_splits=splits, return_softmax_lse=True)
    kept = lse.clone()
    for _ in range(2):
        assert torch.equal(call(q, num_splits=splits), out)
        other = randn(2, 1, 4, 32, dtype=torch.float16)  # another logsumexp
        call(other, num_splits=splits)
        again, lse_again = call(other, num_splits=splits, return_softmax_lse=True)
        assert torch.equal(lse, kept) and lse_again.data_ptr() != lse.data_ptr()
        assert not torch.equal(lse_again, kept)


def test_decode_loop_appends_token_by_token():
    """generate(): one token per step; the cache grows, each step matches the reference."""
    c = dict(
        dtype=torch.bfloat16,
        paged=5,
        seqlen_new=1,
        rotary="neox",
        mask="causal",
        softcap=0.0,
        alibi=False,
        group=2,
        seqlen_q=1,
        seqlens="tensor",
        batch_idx=False,
        leftpad=False,
        splits=0,
    )
    q, k_cache, v_cache, kwargs = make_case(c, 64, capacity=40, batch=2)
    kwargs["cache_seqlens"] = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for step in range(6):
        kwargs["k"], kwargs["v"] = (randn(2, 1, 2, 64, dtype=torch.bfloat16) for _ in range(2))
        q = randn(2, 1, 4, 64, dtype=torch.bfloat16)
        ref_out, _, ref_k, ref_v = kvcache_ref(q, ref_k, ref_v, **kwargs)
        out = flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        low, _, _, _ = kvcache_ref(q, k_cache.clone(), v_cache.clone(), **kwargs, upcast=False)
        assert_close(f"step {step} out", out, ref_out, low, 3.0)
        torch.testing.assert_close(k_cache, ref_k, rtol=1e-2, atol=1e-2)
        assert torch.equal(v_cache, ref_v)
        kwargs["cache_seqlens"] = kwargs["cache_seqlens"] + 1


def test_compile_decode_step_fullgraph():
    torch._dynamo.reset()
    q = randn(2, 1, 4, 32, dtype=torch.float32)
    k_cache, v_cache = randn(2, 16, 2, 32, dtype=torch.float32), randn(2, 16, 2, 32, dtype=torch.float32)
    k, v = randn(2, 1, 2, 32, dtype=torch.float32), randn(2, 1, 2, 32, dtype=torch.float32)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True) * 2

    kc, vc = k_cache.clone(), v_cache.clone()
    eager = step(q, kc, vc, k, v, seqlens)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, kc2, vc2, k, v, seqlens)
    torch.testing.assert_close(compiled, eager)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the cache mutation survives compilation


def test_opcheck_kvcache():
    from flashattn2.ops.run import registry

    q = randn(2, 2, 4, 32, dtype=torch.float16)
    k_cache, v_cache = randn(2, 16, 2, 32, dtype=torch.float16), randn(2, 16, 2, 32, dtype=torch.float16)
    k, v = randn(2, 2, 2, 32, dtype=torch.float16), randn(2, 2, 2, 32, dtype=torch.float16)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(
        registry.fwd_kvcache,
        (q, k_cache, v_cache, k, v, None, None, seqlens, 0, None, None, None, 0.2, True, -1, -1, 0.0, True, None, 2),
    )


def test_new_keys_with_any_strides():
    """k/v whose last dimension is not contiguous are appended as given (the kernel reads a
    contiguous copy)."""
    c = {name: values[0] for name, values in OPTIONS.items()} | dict(seqlen_new=4, rotary="neox")
    q, k_cache, v_cache, kwargs = make_case(c, 32)
    kwargs["k"] = kwargs["k"].transpose(-1, -2).contiguous().transpose(-1, -2)  # last-dim stride != 1
    kwargs["v"] = kwargs["v"].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert kwargs["k"].stride(-1) != 1
    check(q, k_cache, v_cache, kwargs, 1)


def _paged(k, lengths, page, gen):
    """Scatter packed keys (total, hk, d) of sequences of the given lengths into pages at random
    block indices: (pages (num_blocks, page, hk, d), block_table (batch, max_blocks))."""
    max_blocks = max(1, max(-(-n // page) for n in lengths))
    num_blocks = len(lengths) * max_blocks + 2
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: len(lengths) * max_blocks].view(len(lengths), max_blocks)
    pages = torch.randn(num_blocks, page, *k.shape[1:], generator=gen).to(k.dtype).to(k.device)
    start = 0
    for b, n in enumerate(lengths):
        for j in range(n):
            pages[table[b, j // page], j % page] = k[start + j]
        start += n
    return pages, table.to(torch.int32).to(k.device)


@pytest.mark.parametrize("page", [16, 3])
@pytest.mark.parametrize(
    "opts",
    [
        pytest.param({}, id="full"),
        pytest.param({"causal": True}, id="causal"),
        pytest.param(
            {"causal": True, "window_size": (7, -1), "softcap": 2.0, "alibi": True}, id="causal-window-softcap-alibi"
        ),
    ],
)
def test_varlen_paged_prefill(page, opts):
    """flash_attn_varlen_func(block_table=...) equals the same call on the packed K/V, and each
    sequence obeys flash-attn's rule against the reference."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lengths_q = [5, 0, 17, 1] if not ON_GPU else [500, 0, 1700, 1]
    lengths_k = [9, 4, 17, 130] if not ON_GPU else [900, 40, 1700, 3000]  # 130: long enough to be split
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(4, device=DEVICE) * 0.3
    cu = cu_seqlens
    q = randn(sum(lengths_q) + 3, 4, 64, dtype=torch.bfloat16)  # 3 rows past cu_seqlens_q[-1]
    k, v = randn(sum(lengths_k), 2, 64, dtype=torch.bfloat16), randn(sum(lengths_k), 2, 64, dtype=torch.bfloat16)
    k_pages, table = _paged(k, lengths_k, page, gen)
    v_pages = torch.zeros_like(k_pages)
    for b, n in enumerate(lengths_k):  # the same pages for v
        start = sum(lengths_k[:b])
        for j in range(n):
            v_pages[table[b, j // page], j % page] = v[start + j]
    args = (cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k))
    out, lse, _ = flashattn2.flash_attn_varlen_func(
        q, k_pages, v_pages, *args, block_table=table, return_attn_probs=True, **opts
    )
    dense, dense_lse, _ = flashattn2.flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True, **opts)
    assert out.shape == dense.shape and lse.shape == dense_lse.shape
    torch.testing.assert_close(out, dense, rtol=2e-2, atol=2e-2)
    finite = torch.isfinite(dense_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], dense_lse[finite], rtol=1e-3, atol=1e-3)
    from flashattn2.reference import attention_ref

    sq, sk = 0, 0
    for nq, nk in zip(lengths_q, lengths_k):
        ref, _ = attention_ref(q[None, sq : sq + nq], k[None, sk : sk + nk], v[None, sk : sk + nk], **opts)
        low, _ = attention_ref(
            q[None, sq : sq + nq], k[None, sk : sk + nk], v[None, sk : sk + nk], upcast=False, **opts
        )
        assert_close(f"sequence at {sq}", out[None, sq : sq + nq], ref, low, 5.0 if "alibi_slopes" in opts else 3.0)
        sq, sk = sq + nq, sk + nk
    assert torch.equal(out[sq:], torch.zeros_like(out[sq:])) and (lse[:, sq:] == float("inf")).all()


def test_window_past_the_cache_is_no_window():
    """flash_attn's rule: a window edge >= the cache length is -1, so a non-causal call with
    window (capacity, capacity) rotates all of q at cache_seqlens, like no window."""
    c = dict(
        dtype=torch.float32,
        paged=None,
        seqlen_new=2,
        rotary="neox",
        mask="none",
        softcap=0.0,
        alibi=False,
        group=2,
        seqlen_q=3,
        seqlens="tensor",
        batch_idx=False,
        leftpad=False,
        splits=1,
    )
    q, k_cache, v_cache, kwargs = make_case(c, 64, capacity=40)
    plain = run_ours(q, k_cache, v_cache, kwargs, 1)[0]
    wide = run_ours(q, k_cache, v_cache, {**kwargs, "window_size": (40, 40)}, 1)[0]
    torch.testing.assert_close(wide, plain)
    check(q, k_cache, v_cache, {**kwargs, "window_size": (40, 40)}, 1)


def decode_plan(q, k_cache, v_cache, block_table=None, num_splits=0, arch="sm90", leftpad=None, elem_bytes=None):
    """ops.planning's KV-cache plan of a flash_attn_with_kvcache call on (meta) tensors, on an H200-sized `arch`
    (132 SMs)."""
    from flashattn2.ops import planning
    from flashattn2.ops.request import spec
    from flashattn2.ops.request.request import KVCacheRequest

    r = KVCacheRequest(q, k_cache, v_cache, cache_leftpad=leftpad, block_table=block_table, num_splits=num_splits)
    s = spec.kvcache(r)
    return planning.decode(planning.kvcache_cache(s), arch, planning.Forced(), False, num_splits, 132)


def test_decode_plan():
    """The tile and split choice (no kernel runs: the cache tensors are meta). The points are
    the H200 measurements the table names (132 SMs, bf16, headdim 128, 32 query heads)."""
    from flashattn2.ops import planning

    def plan(batch, nheads_k, capacity, num_splits=0, page=None, group=None):
        shape = (batch * -(-capacity // page), page, nheads_k, 128) if page else (batch, capacity, nheads_k, 128)
        k = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        table = torch.empty(batch, -(-capacity // page), dtype=torch.int32, device="meta") if page else None
        rows = group if group is not None else 32 // nheads_k
        q = torch.empty(batch, 1, rows * nheads_k, 128, dtype=torch.bfloat16, device="meta")
        p = decode_plan(q, k, k, block_table=table, num_splits=num_splits)
        return (*astuple(p.tile)[:4], p.splits, p.chunk)

    # GQA-8 1 x 32k: 32 splits of 1024 keys, short splits take 64-key blocks
    assert plan(1, 8, 32768) == (16, 64, 4, 3, 32, 1024)
    # MHA 1 x 128k: 8 splits of 16k keys keep 128/4/2
    assert plan(1, 32, 131072) == (16, 128, 4, 2, 8, 16384)
    # no split: many programs (MHA 64 x 1k: 2048) take 3 resident per SM, fewer (GQA 64 x 8k) one
    assert plan(64, 32, 1024) == (16, 128, 4, 2, 1, 1024)
    assert plan(64, 8, 8192) == (16, 128, 4, 3, 1, 8192)
    assert plan(8, 32, 8192) == (16, 128, 4, 3, 1, 8192)
    # paged caches keep their own entries; num_splits=1 never splits; a forced count is kept
    assert plan(1, 8, 32768, page=16)[1:4] == astuple(planning.decode_row("page-row", True).tile)[1:4]
    assert plan(1, 8, 32768, num_splits=1)[4] == 1
    assert plan(1, 8, 32768, num_splits=5)[4] == 5
    rng = random.Random(0)
    for _ in range(300):
        batch, nheads_k, capacity = rng.choice([1, 2, 8, 64]), rng.choice([1, 8, 32]), rng.randint(1, 200000)
        page = rng.choice([None, 16, 256])
        block_m, block_n, _, _, splits, chunk = plan(
            batch, nheads_k, capacity, rng.choice([0, 0, 1, 3, 200]), page=page, group=rng.choice([1, 4, 16, 40])
        )
        capacity = -(-capacity // page) * page if page else capacity  # whole pages
        assert chunk % block_n == 0 and (splits - 1) * chunk < capacity <= splits * chunk, (capacity, splits, chunk)
        assert 1 <= splits <= planning.MAX_SPLITS
