"""flash_attn_with_kvcache's bad arguments: each error names its argument and is raised before anything is written
(value checks on: the kernels' flag read back once); without the value checks, a bad index value writes nothing
another sequence owns and the other sequences' outputs are right; flash_attn's one check of a paged call (its
capacity)."""

import pytest
import torch

import flashattn2
from cases import randn
from conftest import DEVICE


def _errors():
    q = randn(2, 1, 4, 32, dtype=torch.float16)
    kc, vc = randn(2, 16, 2, 32, dtype=torch.float16), randn(2, 16, 2, 32, dtype=torch.float16)
    k, v = randn(2, 3, 2, 32, dtype=torch.float16), randn(2, 3, 2, 32, dtype=torch.float16)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    cos = torch.ones(16, 8, dtype=torch.float16, device=DEVICE)
    pages = randn(6, 4, 2, 32, dtype=torch.float16)
    return [
        ((q, kc.float(), vc), {}, TypeError, "q's dtype"),
        ((q, kc, vc[:, :, :1]), {}, ValueError, "one shape"),
        ((randn(2, 1, 3, 32, dtype=torch.float16), kc, vc), {}, ValueError, "GQA"),
        ((q, kc, vc, k), {"cache_seqlens": 1}, ValueError, "together"),
        ((q, kc, vc, k, v), {}, ValueError, "needs cache_seqlens"),
        ((q, kc, vc, k, v), {"cache_seqlens": torch.tensor([3, 14], **i32)}, ValueError, "capacity of 16"),
        (
            (q, kc, vc, k, v),
            {"cache_seqlens": torch.tensor([3, 4], dtype=torch.int64, device=DEVICE)},
            TypeError,
            "cache_seqlens must be",
        ),
        (
            (q, kc, vc),
            {"cache_seqlens": 3, "cache_batch_idx": torch.tensor([0, 2], **i32)},
            ValueError,
            "cache_batch_idx must index",
        ),
        (
            (q, kc, vc),
            {"cache_seqlens": torch.tensor([3, 4], **i32), "cache_leftpad": torch.tensor([4, 0], **i32)},
            ValueError,
            "cache_leftpad",
        ),
        (
            (q, kc, vc, k, v),
            {"cache_seqlens": 1, "rotary_cos": cos, "rotary_sin": cos[:, :4]},
            ValueError,
            "rotary_cos/rotary_sin must be",
        ),
        (
            (q, kc, vc, k, v),
            {
                "cache_seqlens": 1,
                "rotary_cos": torch.ones(16, 20, dtype=torch.float16, device=DEVICE),
                "rotary_sin": torch.ones(16, 20, dtype=torch.float16, device=DEVICE),
            },
            ValueError,
            "rotary_dim 40",
        ),
        (
            (q, kc, vc, k, v),
            {"cache_seqlens": 10, "rotary_cos": cos[:12], "rotary_sin": cos[:12]},
            ValueError,
            "12 positions",
        ),
        ((q, kc, vc), {"cache_seqlens": 1, "rotary_cos": cos, "rotary_sin": cos}, ValueError, "need the new k/v"),
        (
            (q, pages, pages),
            {"cache_seqlens": 5, "block_table": torch.tensor([[0, 1], [2, 9]], **i32)},
            ValueError,
            "block_table entries",
        ),
        (
            (q, pages, pages),
            {"cache_seqlens": 9, "block_table": torch.tensor([[0, 1], [2, 3]], **i32)},
            ValueError,
            "capacity of 8",
        ),
        (
            (q, pages, pages),
            {
                "cache_seqlens": 5,
                "block_table": torch.tensor([[0, 1], [2, 3]], **i32),
                "cache_batch_idx": torch.tensor([0, 1], **i32),
            },
            NotImplementedError,
            "cache_batch_idx",
        ),
        ((q, kc, vc), {"cache_seqlens": 3, "num_splits": -1}, ValueError, "num_splits"),
        ((q, kc, vc), {"cache_seqlens": 3, "window_size": (-2, 0)}, ValueError, "window_size"),
        (
            (randn(3, 1, 4, 32, dtype=torch.float16), kc, vc),
            {"cache_seqlens": 3},
            ValueError,
            "2 rows for a batch of 3",
        ),
        # values found by the kernels' own check (tensor cache_seqlens): the append writes nothing
        (
            (q, kc, vc, k, v),
            {"cache_seqlens": torch.tensor([3, 10], **i32), "rotary_cos": cos[:12], "rotary_sin": cos[:12]},
            ValueError,
            "12 positions",
        ),
        (
            (q, pages, pages, k, v),
            {"cache_seqlens": torch.tensor([1, 4], **i32), "block_table": torch.tensor([[0, 1], [2, 9]], **i32)},
            ValueError,
            "block_table entries",
        ),
        ((q, kc, vc), {"cache_seqlens": torch.tensor([3, 17], **i32)}, ValueError, "capacity of 16"),
        (
            (q, kc, vc, k, v),
            {"cache_seqlens": torch.tensor([3, 4], **i32), "cache_leftpad": torch.tensor([0, -1], **i32)},
            ValueError,
            "cache_leftpad",
        ),
        # a bad page that the append does not write to but attention reads: still nothing written
        (
            (q, pages, pages, k, v),
            {"cache_seqlens": torch.tensor([4, 1], **i32), "block_table": torch.tensor([[9, 1, 3], [2, 4, 5]], **i32)},
            ValueError,
            "block_table entries",
        ),
        (
            (q, kc, vc, randn(2, 17, 2, 32, dtype=torch.float16), randn(2, 17, 2, 32, dtype=torch.float16)),
            {"cache_seqlens": torch.tensor([0, 0], **i32)},
            ValueError,
            "seqlen_new=17",
        ),
        ((q[:, :0], kc, vc), {"cache_seqlens": torch.tensor([3, 99], **i32)}, ValueError, "capacity of 16"),
    ]


@pytest.mark.usefixtures("value_checks")
@pytest.mark.parametrize("index", range(26))
def test_bad_arguments_raise_before_writing(index):
    cases = _errors()
    assert len(cases) == 26
    args, kwargs, exc, match = cases[index]
    caches = [t.clone() for t in args[1:3]]
    with pytest.raises(exc, match=match):
        flashattn2.flash_attn_with_kvcache(*args, **kwargs)
    for before, after in zip(caches, args[1:3]):
        assert torch.equal(before, after), "the cache was written before the error"


@pytest.mark.usefixtures("value_checks")
def test_error_flag_is_clear_after_an_error():
    """The device-side error flag is kept between calls: after a call that raised on a bad
    cache_seqlens, the next (valid) call on the same stream must not raise, and must append."""
    q = randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache, v_cache = randn(2, 20, 2, 32, dtype=torch.float16), randn(2, 20, 2, 32, dtype=torch.float16)
    k, v = randn(2, 1, 2, 32, dtype=torch.float16), randn(2, 1, 2, 32, dtype=torch.float16)
    for _ in range(2):
        bad = torch.tensor([3, 25], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match="cache_seqlens"):
            flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=bad)
        good = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)
        flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=good)
        assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(v_cache[1, 7], v[1, 0])


@pytest.mark.usefixtures("value_checks")  # restores the setting whatever happens below
def test_unchecked_calls_do_not_raise():
    """Without value checks (the default): a valid call gives the checked call's result; an
    out-of-range cache_seqlens does not raise (nothing is read back), its append is dropped,
    the reads are clamped, and the other sequences are unaffected (tests/test_owned_writes.py:
    every index tensor). set_kvcache_checks is set_value_checks' other name; only a bool is
    taken."""
    q = randn(2, 1, 4, 32, dtype=torch.float16)
    k_cache, v_cache = randn(2, 20, 2, 32, dtype=torch.float16), randn(2, 20, 2, 32, dtype=torch.float16)
    k, v = randn(2, 1, 2, 32, dtype=torch.float16), randn(2, 1, 2, 32, dtype=torch.float16)
    good = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)
    bad = torch.tensor([3, 25], dtype=torch.int32, device=DEVICE)
    checked = flashattn2.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=good)
    with pytest.raises(TypeError, match="enabled"):
        flashattn2.set_value_checks(0)
    assert flashattn2.set_kvcache_checks(False) is True
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flashattn2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=good)
    assert torch.equal(out, checked)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flashattn2.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad)
    assert torch.isfinite(out).all()
    assert torch.equal(kc[0, 3], k[0, 0]) and torch.equal(out[0], checked[0])
    assert torch.equal(kc[1], k_cache[1]) and torch.equal(vc[1], v_cache[1]), "an append past the capacity is dropped"
    out = flashattn2.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([3, 99], dtype=torch.int32, device=DEVICE)
    )
    assert torch.isfinite(out).all()
    # a block-table entry out of range is read as a real page, not followed
    pages = randn(6, 4, 2, 32, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device=DEVICE)
    out = flashattn2.flash_attn_with_kvcache(
        q,
        pages,
        pages.clone(),
        k,
        v,
        cache_seqlens=torch.tensor([1, 5], dtype=torch.int32, device=DEVICE),
        block_table=table,
    )
    assert torch.isfinite(out).all()
    assert flashattn2.set_value_checks(True) is False
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=bad)


@pytest.mark.parametrize("seqlen_new", [0, 3])
def test_paged_call_past_its_pages_raises(seqlen_new):
    """flash_attn's one check of a paged call: max(cache_seqlens) + seqlen_new past block_table's capacity
    (max_num_blocks_per_seq * page_size) raises RuntimeError naming block_table, before anything is written; at the
    capacity exactly, the call runs."""
    page, pages_per_seq, batch = 4, 3, 2
    capacity = page * pages_per_seq
    k_cache = torch.randn(batch * pages_per_seq, page, 2, 16, device=DEVICE, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=DEVICE).view(batch, pages_per_seq)
    q = torch.randn(batch, 1, 2, 16, device=DEVICE, dtype=torch.float16)
    new = {} if not seqlen_new else {"k": torch.randn(batch, seqlen_new, 2, 16, device=DEVICE, dtype=torch.float16)}
    if new:
        new["v"] = torch.randn_like(new["k"])
    k_before = k_cache.clone()
    for end, raises in ((capacity + 1, True), (capacity, False)):
        seqlens = torch.tensor([1, end - seqlen_new], dtype=torch.int32, device=DEVICE)
        kc = k_before.clone()
        if raises:
            with pytest.raises(RuntimeError, match="block_table"):
                flashattn2.flash_attn_with_kvcache(q, kc, v_cache, cache_seqlens=seqlens, block_table=table, **new)
            assert torch.equal(kc, k_before)
        else:
            out = flashattn2.flash_attn_with_kvcache(q, kc, v_cache, cache_seqlens=seqlens, block_table=table, **new)
            assert out.isfinite().all()
    # a negative cache_seqlens is no capacity error: without the value checks the kernels clamp it (flash_attn's too)
    seqlens = torch.tensor([-2, -3], dtype=torch.int32, device=DEVICE)
    flashattn2.flash_attn_with_kvcache(q, k_before.clone(), v_cache, cache_seqlens=seqlens, block_table=table, **new)
