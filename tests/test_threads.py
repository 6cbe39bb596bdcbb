"""A call from a server's threads is as safe as one from a script: every module-level cache and counter a call touches
(the prepared calls, the cu_seqlens memory, the error flags, the launcher's) under 8 threads calling every entry
point at once, launches stubbed (ops.launch.launcher.stubbed: the host's path alone, as fast as it runs), thread
switches forced often."""

import sys
import threading

import pytest
import torch

import flashattn2
from cases import randn
from conftest import DEVICE
from flashattn2.flash_attn_interface import _flash_attn_backward, _flash_attn_forward, _flash_attn_varlen_forward
from flashattn2.ops.run import call as calls
from flashattn2.ops.request import checks, seqlens
from flashattn2.ops.launch import launcher

THREADS = 8
CALLS = 60


def _work(index: int, errors: list, barrier: threading.Barrier) -> None:
    """Every entry point, CALLS times, each varlen call with a fresh cu_seqlens (the cu_seqlens memory's evictions),
    shapes that differ between threads (new prepared calls while others read)."""
    try:
        i32 = dict(dtype=torch.int32, device=DEVICE)
        seqlen = 3 + index % 4
        q, k, v = (randn(1, seqlen, 2, 16, dtype=torch.float16) for _ in range(3))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        qkv = randn(1, seqlen, 3, 2, 16, dtype=torch.float16)
        kc, vc = randn(2, 32, 1, 16, dtype=torch.float16), randn(2, 32, 1, 16, dtype=torch.float16)
        q1, kn, vn = randn(2, 1, 2, 16, dtype=torch.float16), *(randn(2, 1, 1, 16, dtype=torch.float16) for _ in "kv")
        qv = randn(2 * seqlen, 2, 16, dtype=torch.float16)
        out, lse = _flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)[:2]
        grads = [torch.empty_like(t) for t in (q, k, v)]
        barrier.wait()
        for n in range(CALLS):
            flashattn2.flash_attn_func(q, k, v, causal=n % 2 == 0)
            flashattn2.flash_attn_func(qg, kg, vg, window_size=(n % 3, -1)).sum().backward()
            flashattn2.flash_attn_qkvpacked_func(qkv)
            cu = torch.tensor([0, n % seqlen, 2 * seqlen], **i32)  # a new tensor each call
            flashattn2.flash_attn_varlen_func(qv, qv, qv, cu, cu, 2 * seqlen, 2 * seqlen)
            _flash_attn_varlen_forward(qv, qv, qv, cu, cu, 2 * seqlen, 2 * seqlen, 0.0, None, True)
            seqlens_k = torch.tensor([n % 20, 5], **i32)
            flashattn2.flash_attn_with_kvcache(q1, kc, vc, kn, vn, cache_seqlens=seqlens_k, causal=True)
            flashattn2.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=n % 20)
            _flash_attn_backward(out, q, k, v, out, lse, *grads, 0.0, None, False, -1, -1, 0.0, None, False)
    except BaseException as exc:  # noqa: BLE001 -- reported by the test
        errors.append((index, repr(exc)))


@pytest.mark.parametrize("checked", [False, True], ids=["no-value-checks", "value-checks"])
def test_concurrent_calls(checked, monkeypatch):
    previous = checks.set_value_checks(checked)
    monkeypatch.setattr(seqlens, "_SEEN_MAX", 8)  # evictions on most calls
    monkeypatch.setattr(calls.Calls, "LIMIT", 16)  # prepared calls cleared while others read
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list = []
    try:
        with launcher.stubbed():
            barrier = threading.Barrier(THREADS)
            threads = [threading.Thread(target=_work, args=(i, errors, barrier)) for i in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(switch)
        checks.set_value_checks(previous)
        calls.clear()
    assert not errors, errors
