"""Without a GPU, `python -m flashattn2` runs the kernels through Triton's CPU interpreter on small
shapes, checks them against the reference and says what it checked; timings need a GPU."""

from __future__ import annotations

import time

import torch

import flashattn2
from ..reference import BWD_FACTOR, FWD_FACTOR, attention_ref, tolerance

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPES = [(1, 97, 97, 2, 2, 64), (2, 65, 130, 4, 2, 40), (1, 130, 65, 2, 1, 128)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

LEGEND = (
    "out err, grad err: flashattn2's largest absolute error against an fp32 reference (its output; the worst of dq, "
    "dk, dv).\ntorch err: plain PyTorch's, doing the same attention in the input's dtype (the worst of its output and "
    f"gradients): the yardstick.\nok: flashattn2's errors are at most {FWD_FACTOR:g}x (output) and {BWD_FACTOR:g}x "
    "(gradients) PyTorch's, plus one unit in the last place."
)


def run(dtypes=None, headdims=None, causals=(False, True)) -> bool:
    """The check over dtypes (names of DTYPES; default all), causal and not, and the SHAPES, each with its own head
    dim or, with headdims given, with each of those. True when every row passes."""
    dtypes = list(DTYPES) if dtypes is None else dtypes
    shapes = SHAPES if headdims is None else [s[:5] + (d,) for d in headdims for s in SHAPES]
    print(
        "No CUDA GPU: running flashattn2's kernels through Triton's interpreter on the CPU "
        "(small shapes; timings need a GPU)."
    )
    print(LEGEND)
    print(
        f"{'dtype':9} {'causal':6} {'shape (b, sq, sk, h, hk, d)':30} {'out err':>9} {'grad err':>9} "
        f"{'torch err':>9}  result"
    )
    ok_all = True
    for name in dtypes:
        for causal in causals:
            for shape in shapes:
                ok_all &= _check(shape, DTYPES[name], causal)
    print("all checks passed" if ok_all else "SOME CHECKS FAILED")
    return ok_all


def _check(shape, dtype, causal) -> bool:
    b, sq, sk, h, hk, d = shape
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    out = flashattn2.flash_attn_func(q, k, v, causal=causal)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    seconds = time.perf_counter() - start
    ref_out, _ = attention_ref(q, k, v, causal=causal)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    low_out, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    low_grads = torch.autograd.grad(low_out, (q, k, v), do)
    out_ok, out_err, _ = tolerance.check(out, ref_out, low_out, FWD_FACTOR)
    grad_checks = [tolerance.check(g, r, lo, BWD_FACTOR) for g, r, lo in zip(grads, ref_grads, low_grads)]
    ok = out_ok and all(c[0] for c in grad_checks)
    grad_err = max(c[1] for c in grad_checks)
    low_err = max(
        tolerance.max_error(low_out, ref_out), *(tolerance.max_error(lo, r) for lo, r in zip(low_grads, ref_grads))
    )
    print(
        f"{str(dtype)[6:]:9} {str(causal):6} {str(shape):30} {out_err:9.2e} {grad_err:9.2e} "
        f"{low_err:9.2e}  {'ok' if ok else 'FAIL'} ({seconds:.1f} s)"
    )
    return ok
