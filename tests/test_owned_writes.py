"""A bad index tensor never writes memory that another index names. With the value checks off (the default),
flash_attn_with_kvcache's append drops a write whose target is out of range instead of clamping it onto a real row,
page or slot: a sequence whose cache_batch_idx is out of range writes nothing, a token on a block_table entry out of
range or at a position cache_seqlens + i outside [0, capacity) is not written (its other tokens are), and
cache_leftpad never steers a write (the tokens go to cache_seqlens + i, as in flash_attn). Each case runs a batch
of three sequences, the middle one bad, over a cache of known contents: every cache entry outside the writes the
valid indices name is bit-identical afterwards, those writes are there, and the good sequences' outputs are the
reference's. With the checks on, the same calls raise naming the argument and write nothing."""

import pytest
import torch

import flashattn2
from conftest import DEVICE
from flashattn2.ops.request import checks
from flashattn2.reference.kvcache import kvcache_ref
from flashattn2.reference.rotary import rotary_ref
from tolerance import assert_close

HEADS, HEADS_K, D, ROTARY_DIM = 4, 2, 32, 16
SEQLEN_Q, NEW = 2, 3
CAPACITY = 16  # a contiguous row's positions; paged: 4 pages of 4
PAGE, WIDTH, NUM_PAGES = 4, 4, 14
SEQLENS = [5, 3, 9]
# pages 0 and 13 belong to no sequence: where a clamp of a bad entry (below 0, past the end) would land
TABLE = [[6, 2, 11, 4], [8, 1, 12, 5], [3, 10, 7, 9]]
# rows 0, 3 and 4 belong to no sequence (the clamps' targets)
ROWS, BATCH_IDX = 5, [2, 1, 1]
GOOD = [0, 2]

# name -> (layouts, the bad value's argument and sequence 1's value, what the checked call's error names)
CASES = {
    "batch_idx-past-the-end": (["contiguous"], ("cache_batch_idx", 7), "cache_batch_idx"),
    "batch_idx-negative": (["contiguous"], ("cache_batch_idx", -1), "cache_batch_idx"),
    "block_table-past-the-end": (["paged"], ("block_table", 99), "block_table"),
    "block_table-negative": (["paged"], ("block_table", -5), "block_table"),
    "seqlens-partly-past-capacity": (["contiguous", "paged"], ("cache_seqlens", CAPACITY - 1), "cache_seqlens"),
    "seqlens-past-capacity": (["contiguous", "paged"], ("cache_seqlens", CAPACITY + 1), "cache_seqlens"),
    "seqlens-near-2**31": (["contiguous", "paged"], ("cache_seqlens", 2**31 - 1), "cache_seqlens"),
    "seqlens-negative": (["contiguous", "paged"], ("cache_seqlens", -2), "cache_seqlens"),
    "leftpad-negative": (["contiguous", "paged"], ("cache_leftpad", -1), "cache_leftpad"),
    "leftpad-past-seqlens": (["contiguous", "paged"], ("cache_leftpad", 9), "cache_leftpad"),
}
PARAMS = [pytest.param(name, layout, id=f"{name}-{layout}") for name, (ls, _, _) in CASES.items() for layout in ls]


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _case(name, layout, rotary):
    """(q, k_cache, v_cache, kwargs, index): the call's tensors, its index tensors as Python lists (index)."""
    dtype = torch.float32 if rotary else torch.float16  # (the interpreter rotates 16-bit keys in torch)
    arg, value = CASES[name][1]
    index = {"cache_seqlens": list(SEQLENS)}
    if layout == "paged":
        index["block_table"] = [list(row) for row in TABLE]
        shape = (NUM_PAGES, PAGE, HEADS_K, D)
    elif arg == "cache_batch_idx":
        index["cache_batch_idx"] = list(BATCH_IDX)
        shape = (ROWS, CAPACITY, HEADS_K, D)
    else:
        shape = (len(SEQLENS), CAPACITY, HEADS_K, D)
    if arg == "cache_leftpad":
        index["cache_leftpad"] = [1, 0, 2]
    if arg == "block_table":
        index["block_table"][1][1] = value  # sequence 1's positions 4..7, where its append's last two tokens go
    else:
        index[arg][1] = value
    kwargs = {name: _i32(values) for name, values in index.items()}
    kwargs["k"], kwargs["v"] = (torch.randn(len(SEQLENS), NEW, HEADS_K, D, dtype=dtype, device=DEVICE) for _ in "kv")
    if rotary:
        angle = torch.rand(CAPACITY + SEQLEN_Q, ROTARY_DIM // 2, device=DEVICE) * 6.28
        kwargs.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype), rotary_interleaved=False)
    q = torch.randn(len(SEQLENS), SEQLEN_Q, HEADS, D, dtype=dtype, device=DEVICE)
    k_cache, v_cache = (torch.randn(shape, dtype=dtype, device=DEVICE) for _ in "kv")
    return q, k_cache, v_cache, kwargs, index


def _owned_writes(k_cache, v_cache, kwargs, index):
    """The cache after the append as the valid indices name it (a write out of range dropped), and the mask of the
    entries written."""
    k_after, v_after = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    k, v = kwargs["k"], kwargs["v"]
    for b, start in enumerate(index["cache_seqlens"]):
        for i in range(NEW):
            pos = start + i
            if not 0 <= pos < CAPACITY:
                continue
            if "block_table" in index:
                row, slot = index["block_table"][b][pos // PAGE], pos % PAGE
            else:
                row, slot = index.get("cache_batch_idx", range(len(SEQLENS)))[b], pos
            if not 0 <= row < k_cache.shape[0]:
                continue
            key = k[b : b + 1, i : i + 1]
            if "rotary_cos" in kwargs:
                key = rotary_ref(key, kwargs["rotary_cos"], kwargs["rotary_sin"], False, pos)
            k_after[row, slot], v_after[row, slot] = key[0, 0], v[b, i]
            written[row, slot] = True
    return k_after, v_after, written


def _good(kwargs):
    """kwargs for the good sequences alone (in their own cache rows)."""
    good = {n: t[GOOD] if isinstance(t, torch.Tensor) and t.shape[0] == len(SEQLENS) else t for n, t in kwargs.items()}
    if "block_table" not in good and "cache_batch_idx" not in good:
        good["cache_batch_idx"] = _i32(GOOD)
    return good


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("name, layout", PARAMS)
def test_bad_index_writes_only_what_valid_indices_name(name, layout, rotary, invariant, monkeypatch):
    q, k_cache, v_cache, kwargs, index = _case(name, layout, rotary)
    k_want, v_want, written = _owned_writes(k_cache, v_cache, kwargs, index)
    k_after, v_after = k_cache.clone(), v_cache.clone()
    if layout == "paged" and max(index["cache_seqlens"]) + NEW > CAPACITY:
        # flash_attn's one check of a paged call (a read of max(cache_seqlens)) raises first, writing nothing; the
        # kernels' guard below is what holds where that read is not made (torch.compile, CUDA-graph capture)
        with flashattn2.batch_invariant(invariant), pytest.raises(RuntimeError, match="block_table"):
            flashattn2.flash_attn_with_kvcache(q, k_after, v_after, causal=True, **kwargs)
        assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache)
        monkeypatch.setattr(checks, "host_reads_allowed", lambda t: False)
    with flashattn2.batch_invariant(invariant):
        out = flashattn2.flash_attn_with_kvcache(q, k_after, v_after, causal=True, **kwargs)
    for what, after, before, want in (("k", k_after, k_cache, k_want), ("v", v_after, v_cache, v_want)):
        changed = (after != before).flatten(2).any(-1) & ~written
        assert not changed.any(), f"{what}_cache entries (row/page, slot) no index names: {changed.nonzero().tolist()}"
        if rotary and what == "k":  # rotated in fp32 by both, rounded once
            torch.testing.assert_close(after[written], want[written])
        else:
            assert torch.equal(after[written], want[written]), f"{what}_cache: a valid write is missing"
    good = _good(kwargs)
    ref, _, _, _ = kvcache_ref(q[GOOD], k_cache, v_cache, causal=True, **good)
    low, _, _, _ = kvcache_ref(q[GOOD], k_cache, v_cache, causal=True, upcast=False, **good)
    assert_close("the good sequences' out", out[GOOD], ref, low, 3.0)


@pytest.mark.usefixtures("value_checks")
@pytest.mark.parametrize("name, layout", PARAMS)
def test_bad_index_with_checks_raises_and_writes_nothing(name, layout):
    q, k_cache, v_cache, kwargs, _ = _case(name, layout, False)
    k_after, v_after = k_cache.clone(), v_cache.clone()
    with pytest.raises(flashattn2.ArgumentError, match=CASES[name][2]):
        flashattn2.flash_attn_with_kvcache(q, k_after, v_after, causal=True, **kwargs)
    assert torch.equal(k_after, k_cache) and torch.equal(v_after, v_cache)
