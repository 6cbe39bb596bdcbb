"""The fuzzer (tests/fuzz_cases.py) for a fixed time, and each failure it has found as a test of its own.

test_fuzz_long draws cases from a seed (FLASHATTN2_FUZZ_SEED, else a fresh one) for FLASHATTN2_FUZZ_SECONDS of wall
time (default 40; on the CPU interpreter at tiny sizes, on a GPU at realistic ones), runs them all, then fails listing
every case that failed, each as the `Case(...)` that replays it: `python tools/fuzz.py --seed S --case I`, or the
Case pasted into a test. The budget is time, not a count of cases, so a loaded machine runs fewer cases in the same
time; its timeout (300 s) leaves a wide margin over it. test_fuzz does the same for 10 s in the suite's first tier
(tests/tiers.py: the long one is in the second).
"""

import os
import random
import time

import pytest
import torch

import flashattn2
import fuzz_cases
from conftest import DEVICE, ON_GPU
from flashattn2.reference.kvcache import kvcache_ref

SECONDS = float(os.environ.get("FLASHATTN2_FUZZ_SECONDS", "40"))  # the long fuzz's
FIRST_TIER_SECONDS = 10


def _fuzz(seconds: float) -> None:
    seed = int(os.environ.get("FLASHATTN2_FUZZ_SEED", random.SystemRandom().randrange(2**31)))
    sizes = fuzz_cases.GPU if ON_GPU else fuzz_cases.CPU
    print(f"fuzz seed={seed} ({seconds:.0f} s; replay one case: python tools/fuzz.py --seed {seed} --case I)")
    start = time.monotonic()
    count, failures = fuzz_cases.fuzz(seed, seconds, sizes, DEVICE)
    print(f"fuzz seed={seed}: {count} cases in {time.monotonic() - start:.1f} s, {len(failures)} failed")
    assert count, "the fuzzer ran no case"
    assert not failures, f"fuzz seed={seed}: {len(failures)} of {count} cases failed:\n" + "\n".join(
        f"case {seed}:{i} ({type(e).__name__}: {str(e)[:300]})\n  {case}" for i, case, e in failures
    )


@pytest.mark.timeout(300)
def test_fuzz():
    _fuzz(FIRST_TIER_SECONDS)


@pytest.mark.timeout(max(300, 6 * SECONDS))
def test_fuzz_long():
    _fuzz(SECONDS)


# Each failure the fuzzer found, reproduced.


def test_rotary_append_of_strided_new_keys():
    """New keys whose memory is not in (batch, seqlen, heads) order, appended with rotary: the interpreter rotated
    them in a copy that kept their strides and read it as if contiguous (the cache got other tokens' keys)."""
    dtype = torch.float16
    q = torch.randn(2, 1, 2, 32, dtype=dtype, device=DEVICE)
    k_cache, v_cache = (torch.randn(2, 16, 1, 32, dtype=dtype, device=DEVICE) for _ in range(2))
    k = torch.randn(2, 1, 2, 32, dtype=dtype, device=DEVICE).permute(2, 0, 1, 3)  # batch innermost
    v = torch.randn(2, 2, 1, 32, dtype=dtype, device=DEVICE)
    angle = torch.rand(18, 8, device=DEVICE) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    seqlens = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    kc, vc = k_cache.clone(), v_cache.clone()
    flashattn2.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens)
    _, _, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, cos, sin, seqlens)
    torch.testing.assert_close(kc, ref_k, rtol=1e-2, atol=1e-2)
    assert torch.equal(vc, ref_v)


@pytest.mark.usefixtures("value_checks")
@pytest.mark.parametrize("skipped_by", ["window", "leftpad"])
def test_checked_block_table_entry_in_a_page_not_read(skipped_by):
    """With the value checks on and nothing appended, a block-table entry out of range in a page the sequence uses
    but does not read (before its window, or its left padding) raises as it does with an append; the kernels found
    only the pages they read."""
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    pages = torch.randn(20, 3, 1, 32, dtype=torch.float16, device=DEVICE)
    table = torch.arange(18, dtype=torch.int32, device=DEVICE)[None]
    table[0, 2] = 25  # keys 6-8
    seqlens = torch.tensor([50], dtype=torch.int32, device=DEVICE)
    kwargs = {"window_size": (10, 0)} if skipped_by == "window" else {"cache_leftpad": seqlens - 20}
    with pytest.raises(ValueError, match="block_table entries"):
        flashattn2.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table, **kwargs)


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_kvcache_without_keys(splits):
    """A cache of no positions (seqlen_cache 0): every row sees no key (zeros, lse +inf; with a sink, lse the sink).
    The plan divided by its zero-key chunk (ZeroDivisionError)."""
    q = torch.randn(2, 3, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    k_cache = torch.randn(2, 0, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    sink = torch.randn(4, device=DEVICE)
    out, lse = flashattn2.flash_attn_with_kvcache(q, k_cache, k_cache, num_splits=splits, return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    out, lse = flashattn2.flash_attn_with_kvcache(
        q, k_cache, k_cache, num_splits=splits, return_softmax_lse=True, learnable_sink=sink
    )
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink[None, :, None].expand_as(lse))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd-bwd"])
def test_batch_invariant_varlen_without_keys(backward):
    """The batch-invariant mode on a varlen call whose k and v have no rows (every sequence keyless): zeros, lse +inf,
    zero gradients, as outside the mode. Its plan (the KV-cache kernel's, k as a cache of 0 positions) divided by
    zero."""
    q = torch.randn(33, 2, 32, device=DEVICE, requires_grad=backward)
    k = torch.randn(0, 1, 32, device=DEVICE, requires_grad=backward)
    cu_q = torch.tensor([0, 0, 33], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    with flashattn2.batch_invariant():
        out, lse, _ = flashattn2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 33, 0, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    if backward:
        dq, dk = torch.autograd.grad(out, (q, k), torch.randn_like(out))
        assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


@pytest.mark.parametrize("path", ["batch-invariant", "paged"])
def test_rows_past_the_last_sequence_without_keys_and_a_sink(path):
    """A varlen call whose keys are none at all (k of no rows in the batch-invariant mode; a block table of no pages),
    with a sink: the sequences' rows have lse = the sink, the rows past cu_seqlens_q[-1] lse +inf and output 0, as
    with keys (the sink was written into those rows too)."""
    q = torch.randn(34, 3, 16, device=DEVICE)
    sink = torch.randn(3, device=DEVICE)
    cu_q = torch.tensor([0, 31], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    if path == "paged":
        pages, table = torch.randn(2, 4, 1, 16, device=DEVICE), torch.zeros(1, 0, dtype=torch.int32, device=DEVICE)
        out, lse, _ = flashattn2.flash_attn_varlen_func(
            q, pages, pages, cu_q, cu_k, 31, 0, return_attn_probs=True, learnable_sink=sink, block_table=table
        )
    else:
        k = torch.randn(0, 1, 16, device=DEVICE)
        with flashattn2.batch_invariant():
            out, lse, _ = flashattn2.flash_attn_varlen_func(
                q, k, k, cu_q, cu_k, 38, 7, return_attn_probs=True, learnable_sink=sink
            )
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse[:, :31], sink[:, None].expand(3, 31)) and torch.isposinf(lse[:, 31:]).all()
