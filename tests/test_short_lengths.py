"""Lengths of 1 and other short lengths, forward and backward, dense and varlen, against the
reference. Triton specializes an integer argument equal to 1 into a constant (and one divisible by 16
into an aligned one), so a one-token query or key sequence, or MHA's group size of 1, compiles a kernel
of its own: loops fold away and the compiler sees another program (a one-token prompt with GQA once
crashed the backward's compile at padded head dims). On the GPU the padded head dims that failed, with
FLASHATTN2_SHORT_SWEEP=1 every head dim the table buckets differently; on the CPU a small grid (the
compile itself is covered by tools/compile_check.py's length-one cases, tests/test_compile_targets.py)."""

import itertools
import os

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from conftest import ON_GPU
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

SWEEP = os.environ.get("FLASHATTN2_SHORT_SWEEP") == "1"
if ON_GPU:
    # every multiple of 8 to 256 (the buckets 64/128/256 and the padding inside them), odd ones, and 1
    HEAD_DIMS = sorted({*range(8, 257, 8), 1, 3, 40, 59, 111}) if SWEEP else [96, 160, 192]
    SEQLENS_Q, SEQLENS_K = (1, 2, 16), (1, 97)
    HEADS = [(12, 3), (12, 12)]  # GQA 4 and MHA
    CAUSAL = (False,) if SWEEP else (False, True)
    # (deterministic, layout): crossed
    MODES = list(itertools.product((False, True), ("dense", "varlen")))
else:
    HEAD_DIMS, SEQLENS_Q, SEQLENS_K = [40], (1, 2), (1, 7)
    HEADS = [(4, 1), (2, 2)]
    CAUSAL = (False, True)
    MODES = [(False, "dense"), (True, "varlen")]

CASES = [
    pytest.param(
        d,
        sq,
        sk,
        h,
        hk,
        causal,
        det,
        layout,
        id=f"d{d}-sq{sq}-sk{sk}-h{h}-hk{hk}-{'causal' if causal else 'full'}-{'det' if det else 'nondet'}-{layout}",
    )
    for d in HEAD_DIMS
    for sq in SEQLENS_Q
    for sk in SEQLENS_K
    for h, hk in HEADS
    for causal in CAUSAL
    for det, layout in MODES
]


@pytest.mark.parametrize("d, seqlen_q, seqlen_k, nheads, nheads_k, causal, deterministic, layout", CASES)
def test_short_lengths_forward_backward(d, seqlen_q, seqlen_k, nheads, nheads_k, causal, deterministic, layout):
    batch, dtype = 3, torch.float16
    if layout == "dense":
        q = randn(batch, seqlen_q, nheads, d, dtype=dtype, requires_grad=True)
        k, v = (randn(batch, seqlen_k, nheads_k, d, dtype=dtype, requires_grad=True) for _ in range(2))
        out, lse, _ = flashattn2.flash_attn_func(
            q, k, v, causal=causal, deterministic=deterministic, return_attn_probs=True
        )
        segments = [(slice(None), slice(None), slice(None))]
    else:
        # the longest sequence has the length under test; the others are shorter (or as long, at 1)
        lens_q = [seqlen_q, max(1, seqlen_q - 1), seqlen_q]
        lens_k = [seqlen_k, max(1, seqlen_k // 2), seqlen_k]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q = randn(sum(lens_q), nheads, d, dtype=dtype, requires_grad=True)
        k, v = (randn(sum(lens_k), nheads_k, d, dtype=dtype, requires_grad=True) for _ in range(2))
        out, lse, _ = flashattn2.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, causal=causal, deterministic=deterministic, return_attn_probs=True
        )
        segments = [
            (slice(None), slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item()))
            for b in range(batch)
        ]
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)

    def reference(upcast):
        """out, lse (lse as flash_attn lays it out for this layout), from attention_ref per segment"""
        outs, lses = [], []
        for _, rows_q, rows_k in segments:
            if layout == "dense":
                o, s = attention_ref(q, k, v, causal=causal, upcast=upcast)
            else:
                o, s = attention_ref(q[rows_q][None], k[rows_k][None], v[rows_k][None], causal=causal, upcast=upcast)
                o, s = o[0], s[0]
            outs.append(o)
            lses.append(s)
        return torch.cat(outs, dim=-3), torch.cat(lses, dim=-1)

    ref_out, ref_lse = reference(True)
    low_out, low_lse = reference(False)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    assert lse.shape == ref_lse.shape
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "rows without keys must have lse=+inf"
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    ref_grads = torch.autograd.grad((ref_out * do.to(ref_out.dtype)).sum(), (q, k, v))
    low_grads = torch.autograd.grad((low_out * do).sum(), (q, k, v))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)
