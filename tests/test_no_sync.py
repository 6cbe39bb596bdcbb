"""No entry point waits for the GPU by default (the value checks are opt-in: flashattn2.set_value_checks), but
flash_attn's one: a paged flash_attn_with_kvcache reads max(cache_seqlens) once, against block_table's capacity
(READS).

On the GPU each call runs for real under torch.cuda.set_sync_debug_mode("error"), which raises on any
synchronizing CUDA call; it runs once before (the kernels compile) with other index tensors, so that the timed
call meets its cu_seqlens for the first time. On the CPU the kernels are not launched (ops.launch.launcher.stubbed) and
every Python-level read of a tensor's values (item, tolist, bool, int, float, numpy, cpu) raises: the host path of
each call is checked to read nothing."""

import os
import subprocess
import sys

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from conftest import DEVICE, ON_GPU
from flashattn2 import flash_attn_interface as fai
from flashattn2.ops.request import checks
from flashattn2.ops.launch import launcher

B, S, H, HK, D = (2, 300, 8, 2, 64) if ON_GPU else (2, 40, 4, 2, 32)
DT = torch.bfloat16
I32 = dict(dtype=torch.int32, device=DEVICE)


def _dense():
    return [randn(B, S, n, D, dtype=DT, requires_grad=True) for n in (H, HK, HK)]


def _packed(n):
    lengths = [S - 7, S]
    cu = cu_seqlens(lengths)
    return [randn(sum(lengths), h, D, dtype=DT, requires_grad=True) for h in (H, n, n)], cu, max(lengths)


def _backward(out):
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


def _func():
    q, k, v = _dense()
    return lambda: _backward(flashattn2.flash_attn_func(q, k, v, causal=True))


def _func_dropout():
    q, k, v = _dense()
    return lambda: _backward(flashattn2.flash_attn_func(q, k, v, dropout_p=0.1, window_size=(16, 0)))


def _qkvpacked():
    qkv = randn(B, S, 3, H, D, dtype=DT, requires_grad=True)
    return lambda: _backward(flashattn2.flash_attn_qkvpacked_func(qkv, causal=True))


def _kvpacked():
    q, k, v = _dense()
    kv = torch.stack((k, v), 2).detach().requires_grad_()
    return lambda: _backward(flashattn2.flash_attn_kvpacked_func(q, kv, causal=True))


def _varlen():
    (q, k, v), cu, m = _packed(HK)
    return lambda: _backward(flashattn2.flash_attn_varlen_func(q, k, v, cu, cu.clone(), m, m, causal=True))


def _varlen_qkvpacked():
    (q, k, v), cu, m = _packed(H)
    qkv = torch.stack((q, k, v), 1).detach().requires_grad_()
    return lambda: _backward(flashattn2.flash_attn_varlen_qkvpacked_func(qkv, cu, m, causal=True))


def _varlen_paged():
    (q, _, _), cu, m = _packed(HK)
    blocks = -(-S // 32)
    pages = [randn(2 * blocks, 32, HK, D, dtype=DT) for _ in range(2)]
    table = torch.randperm(2 * blocks, device=DEVICE).view(2, blocks).to(torch.int32)
    return lambda: flashattn2.flash_attn_varlen_func(q.detach(), *pages, cu, cu, m, m, causal=True, block_table=table)


def _kvcache(paged=False, batch_idx=False):
    q = randn(B, 1, H, D, dtype=DT)
    k, v = randn(B, 1, HK, D, dtype=DT), randn(B, 1, HK, D, dtype=DT)
    rows = B + 1 if batch_idx else B
    if paged:
        caches = [randn(rows * 2, S // 2 + 1, HK, D, dtype=DT) for _ in range(2)]
        extra = {"block_table": torch.arange(rows * 2, **I32).view(rows, 2)[:B]}
    else:
        caches = [randn(rows, S + 1, HK, D, dtype=DT) for _ in range(2)]
        extra = {"cache_batch_idx": torch.tensor([2, 0], **I32)} if batch_idx else {}
    cos = torch.rand(S + 1, D // 2, device=DEVICE, dtype=DT)
    seqlens = torch.tensor([S - 9, S - 2], **I32)
    pad = None if paged else torch.tensor([3, 0], **I32)
    return lambda: flashattn2.flash_attn_with_kvcache(
        q,
        *caches,
        k,
        v,
        rotary_cos=cos,
        rotary_sin=cos,
        cache_seqlens=seqlens,
        cache_leftpad=pad,
        causal=True,
        return_softmax_lse=True,
        **extra,
    )


def _private():
    q, k, v = (t.detach() for t in _dense())
    (vq, vk, vv), cu, m = _packed(HK)
    vq, vk, vv = (t.detach() for t in (vq, vk, vv))

    def run():
        out, lse, _, rng = fai._flash_attn_forward(q, k, v, 0.0, D**-0.5, True, -1, -1, 0.0, None, False)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        fai._flash_attn_backward(out, q, k, v, out, lse, *grads, 0.0, D**-0.5, True, -1, -1, 0.0, None, False, rng)
        out, lse, _, rng = fai._flash_attn_varlen_forward(vq, vk, vv, cu, cu, m, m, 0.0, D**-0.5, True)
        grads = [torch.empty_like(t) for t in (vq, vk, vv)]
        fai._flash_attn_varlen_backward(
            out, vq, vk, vv, out, lse, *grads, cu, cu, m, m, 0.0, D**-0.5, True, -1, -1, 0.0, None, False, rng
        )

    return run


def _invariant():
    q, k, v = _dense()
    (vq, vk, vv), cu, m = _packed(HK)
    decode = _kvcache()

    def run():
        with flashattn2.batch_invariant():
            _backward(flashattn2.flash_attn_func(q, k, v, causal=True))
            _backward(flashattn2.flash_attn_varlen_func(vq, vk, vv, cu, cu, m, m, causal=True))
            decode()

    return run


CASES = {
    "func": _func,
    "func-dropout-window": _func_dropout,
    "qkvpacked": _qkvpacked,
    "kvpacked": _kvpacked,
    "varlen": _varlen,
    "varlen-qkvpacked": _varlen_qkvpacked,
    "varlen-paged": _varlen_paged,
    "kvcache": _kvcache,
    "kvcache-paged": lambda: _kvcache(paged=True),
    "kvcache-batch-idx": lambda: _kvcache(batch_idx=True),
    "private": _private,
    "batch-invariant": _invariant,
}


# the calls that read values on the host by default, and how many times: flash_attn's check of a paged KV-cache call
READS = {"kvcache-paged": 1}


@pytest.mark.parametrize("name", list(CASES))
def test_no_host_sync(name, monkeypatch):
    assert not checks.value_checks(), "the value checks must be off by default"
    if ON_GPU:
        CASES[name]()()  # compiles the kernels; the call below meets new index tensors
        torch.cuda.synchronize()
        call = CASES[name]()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if name not in READS else "default")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return
    call = CASES[name]()
    reads = []
    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        original = getattr(torch.Tensor, method)

        def read(t, *args, _method=method, _original=original, **kwargs):
            reads.append(_method)
            if len(reads) > READS.get(name, 0):
                raise AssertionError(f"the call read a tensor's values on the host ({reads})")
            return _original(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, read)
    with launcher.stubbed():
        call()
    assert len(reads) == READS.get(name, 0), reads


def test_value_checks_read_the_environment():
    """Off unless FLASHATTN2_VALUE_CHECKS says on."""
    probe = "import flashattn2; print(flashattn2.set_value_checks(False))"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_CHECKS")}
    for extra, expected in (({}, "False"), ({"FLASHATTN2_VALUE_CHECKS": "1"}, "True")):
        run = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == expected, (extra, run.stdout)
