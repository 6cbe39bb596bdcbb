"""Launches (ops.launch.launcher.Launch): a prepared call's kernel goes through Triton once and straight to the compiled
kernel after that, which is right only if the call's spec fixes everything Triton specializes the kernel on. On the CPU:
the second launch's arguments to the compiled kernel, and (through the interpreter's calls with launches watched) that
calls with equal specs hand every kernel arguments Triton specializes alike. On the GPU: relaunches verified against
Triton's choice (VERIFY_LAUNCH), with descriptors encoded once, bit for bit equal to Triton's own launches."""

import random

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

import flashattn2
from conftest import DEVICE, ON_GPU
from flashattn2.ops.run import call as calls
from flashattn2.ops.launch import launcher
from flashattn2.ops.request import spec
from flashattn2.ops.request.request import AttentionRequest, KVCacheRequest


def _kernel(A, B, n, m, x, C: tl.constexpr):
    pass


def test_first_launch_through_triton_then_direct(monkeypatch):
    """Against a stubbed Triton launch (the CPU has no driver), on any Triton release: the first launch goes through
    Triton and keeps the compiled kernel; the next goes straight to its run with the pointers as integers and the
    constexprs after the other arguments."""
    calls_ = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        class src:  # no descriptor parameters
            signature = {"A": "*fp32", "B": "*fp32", "n": "i32", "m": "i32", "x": "fp32", "C": "constexpr"}

        @staticmethod
        def run(*args):
            calls_.append(("direct", args))

    def triton_run(*args, grid, warmup, **kwargs):
        calls_.append(("triton", args, kwargs))
        return Compiled

    stub = JITFunction(_kernel)  # not triton.jit: on the CPU that gives the interpreter's function
    monkeypatch.setattr(stub, "run", triton_run)
    monkeypatch.setattr(launcher, "VERIFY_LAUNCH", False)  # the stub compiled nothing for Triton to choose
    monkeypatch.setattr(launcher._runtime, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    a, b = torch.randn(64), torch.randn(64)
    launch = launcher.Launch(stub, C=2, num_warps=4)
    for _ in range(2):
        launch((3, 2), a, b, 5, 17, 0.5)
    assert calls_[0] == ("triton", (a, b, 5, 17, 0.5), {"C": 2, "num_warps": 4})
    assert calls_[1] == (
        "direct",
        (3, 2, 1, 7, "function", "metadata", None, None, None, a.data_ptr(), b.data_ptr(), 5, 17, 0.5, 2),
    )
    with launcher.stubbed(record := []):
        launch((3, 2), a, b, 5, 17, 0.5)
    assert record == [("_kernel", (3, 2))] and len(calls_) == 2


def test_gluon_host_descriptor():
    """A HostDesc with a shared-memory layout stands for Gluon's TensorDescriptor (the Gluon
    forward's arguments), carrying that layout; without one, for triton's."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.randn(2, 64, 4, 32).half()
    layout = gl.NVMMASharedLayout.get_default_for([1, 16, 32], gl.float16)
    shape, strides, box = (2, 64, 128), (t.stride(0), t.stride(1), 1), (1, 16, 32)
    gluon, plain = launcher._for_triton(
        (launcher.HostDesc((t, shape, strides, box, layout)), launcher.HostDesc((t, shape, strides, box, None)))
    )
    assert type(gluon) is GluonDescriptor and gluon.layout == layout and gluon.base is t
    assert (gluon.shape, gluon.strides, gluon.block_shape, gluon.padding) == (
        list(shape),
        list(strides),
        list(box),
        "zero",
    )
    assert type(plain) is TensorDescriptor


def _specialization(value):
    """What Triton's cache key holds of a runtime argument (a tuple's elements each)."""
    if isinstance(value, tuple):
        return tuple(_specialization(v) for v in value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    return native_specialize_impl(BaseBackend, value, False, True, True)


def _random_call(rng: random.Random):
    """A random flash_attn_func / varlen / with_kvcache call on small CPU tensors whose strides, offsets (16-byte
    aligned or not), lengths (1, multiples of 16 or neither) and options vary; returns (spec, a function making the
    call)."""
    kind = rng.choice(["func", "varlen", "kvcache"])
    dtype = rng.choice([torch.float16, torch.float32])
    d = rng.choice([16, 32])
    h, hk = rng.choice([(2, 2), (2, 1), (4, 2)])
    offset = rng.choice([0, 0, 1, 8])  # elements: 2-4 bytes off, or 16-32
    causal = rng.random() < 0.5
    window = rng.choice([(-1, -1), (3, 1)])

    def tensor(*shape):
        flat = torch.randn(offset + torch.Size(shape).numel(), dtype=dtype, device=DEVICE)
        t = flat[offset:].view(shape)
        return t.transpose(-2, -3).contiguous().transpose(-2, -3) if rng.random() < 0.3 and t.dim() == 4 else t

    if kind == "kvcache":
        batch, seqlen_q, cache = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([16, 17, 32])
        q, kc, vc = tensor(batch, seqlen_q, h, d), tensor(batch, cache, hk, d), tensor(batch, cache, hk, d)
        seqlens = rng.choice([rng.choice([1, 3, 16]), torch.tensor([3] * batch, dtype=torch.int32, device=DEVICE)])
        options = dict(cache_seqlens=seqlens, causal=causal, window_size=window, num_splits=rng.choice([0, 1, 2]))
        return spec.kvcache(KVCacheRequest(q, kc, vc, **options)), lambda: flashattn2.flash_attn_with_kvcache(
            q, kc, vc, **options
        )
    if kind == "varlen":
        total = rng.choice([16, 17, 33])
        q, k, v = tensor(total, h, d), tensor(total, hk, d), tensor(total, hk, d)
        cu = torch.tensor([0, total // 2, total], dtype=torch.int32, device=DEVICE)
        m = total - total // 2
        s = spec.attention(AttentionRequest(q, k, v, cu, cu, m, m, causal=causal, window_size=window))
        return s, lambda: flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=causal, window_size=window)
    batch, sq, sk = rng.choice([1, 2]), rng.choice([1, 16, 17]), rng.choice([1, 16, 19])
    q, k, v = tensor(batch, sq, h, d), tensor(batch, sk, hk, d), tensor(batch, sk, hk, d)
    s = spec.attention(AttentionRequest(q, k, v, causal=causal, window_size=window))
    return s, lambda: flashattn2.flash_attn_func(q, k, v, causal=causal, window_size=window)


def test_equal_specs_launch_alike():
    """Calls with equal specs hand every kernel they launch arguments Triton specializes alike (dtypes, pointer
    alignment, integers of value 1, multiples of 16 or neither), with the same constexprs and grid: so the kernel a
    prepared call's first launch finds is the one Triton would find for every later call of its spec. A random
    sample of dense, varlen and KV-cache calls, their launches watched, not run."""
    rng = random.Random(0)
    seen: dict = {}
    specs = set()
    for _ in range(300):
        s, call = _random_call(rng)
        launched = []
        with launcher.stubbed(), launcher.watched(lambda k, grid, args, kw: launched.append((k, grid, args, kw))):
            call()
        signature = [
            (k.__name__, tuple(grid), tuple(_specialization(a) for a in args), tuple(sorted(kw.items(), key=str)))
            for k, grid, args, kw in launched
        ]
        specs.add(s)
        if s in seen:
            assert seen[s] == signature, s
        seen[s] = signature
    assert 30 < len(specs) < 300  # specs repeated and differed
    calls.clear()


@pytest.mark.skipif(not ON_GPU, reason="direct launches exist only on the GPU")
def test_relaunch_is_tritons_choice():
    """Calls whose strides, offsets and lengths cross Triton's specialization boundaries, each repeated: every
    relaunch is verified (VERIFY_LAUNCH: Triton's own choice for the arguments) and equal to the first."""
    assert launcher.VERIFY_LAUNCH
    rng = random.Random(1)
    for _ in range(60):
        _, call = _random_call(rng)
        first = call()
        torch.testing.assert_close(call(), first, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="direct launches exist only on the GPU")
def test_host_descriptor_relaunch(monkeypatch):
    """Relaunches with host-built descriptors (encoded once per address on triton 3.6, by the compiled kernel's run
    elsewhere): forward and gradients equal Triton's own launches bit for bit, for new tensors at new addresses and
    shapes."""
    from flashattn2.ops import planning

    def run(n, seed):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        q, k, v = (
            torch.randn(2, n, 4, 64, device=DEVICE, dtype=torch.float16, generator=gen).requires_grad_()
            for _ in range(3)
        )
        with planning.force(tma=True, host_desc=True):  # deterministic: the Triton dK/dV and dQ kernels
            out = flashattn2.flash_attn_func(q, k, v, causal=True, deterministic=True)
            return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    for n, seed in ((256, 0), (256, 1), (300, 2), (256, 3), (1000, 4)):
        direct = run(n, seed)
        with monkeypatch.context() as m:
            m.setattr(launcher.Launch, "__call__", lambda self, grid, *args: self._first(grid, args))
            reference = run(n, seed)
        for a, b in zip(direct, reference):
            assert torch.equal(a, b)
