"""The direct launch path (ops.launcher.launch): its key must tell apart every pair of calls
that Triton compiles differently, and its relaunches must be Triton's own choice (GPU)."""

import itertools
import random

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from conftest import DEVICE, ON_GPU
from flashattn2.ops import launcher


def _kernel(A, B, n, m, x, C: tl.constexpr):
    pass


kernel = JITFunction(_kernel)  # not triton.jit: on the CPU that gives the interpreter's function


def _triton_spec(kernel, values, options):
    """What Triton's cache key holds for a call (runtime.jit.compute_cache_key), with the type of
    each constexpr made explicit (Triton's tuples compare True == 1)."""
    return tuple(
        (type(v), v) if p.is_constexpr else native_specialize_impl(BaseBackend, v, False, True, True)
        for p, v in zip(kernel.params, values)
    ) + (options,)


def _sample(kind, rng, base):
    if kind == "tensor":
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
        return base.to(dtype)[rng.choice([0, 0, 1, 8]) :]  # offsets 0 / 2-4 / 16-32 bytes
    if kind == "int":
        return rng.choice([0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**33 + 1, 2**63])
    if kind == "mixed":  # one position that takes an int, None, a float or a bool from call to call
        return rng.choice([3, 16, 1, None, 0.5, True, False])
    if kind == "float-or-none":
        return rng.choice([0.5, 1.0, None])
    return rng.choice([0.5, 1.0, 0.0])


def test_key_separates_triton_specializations():
    """Two calls share a key only if Triton would compile them alike; calls with the same
    argument types share it whenever Triton would."""
    rng = random.Random(0)
    base = torch.randn(64)
    kinds = ["tensor", "tensor", "int", "mixed", "float-or-none"]
    calls = []
    for _ in range(400):
        args = tuple(_sample(k, rng, base) for k in kinds)
        kwargs = {"C": rng.choice([1, 2, True]), "num_warps": rng.choice([4, 8])}
        key, launched = launcher._bound(kernel, args, kwargs)
        types = tuple(map(type, (*args, kwargs["C"])))
        calls.append((key, _triton_spec(kernel, (*args, kwargs["C"]), kwargs["num_warps"]), types))
        # pointers go to the launcher as integers, everything else as given
        assert launched[0] == args[0].data_ptr() and launched[2:] == (*args[2:], kwargs["C"])
    assert len({c[2] for c in calls}) > 8  # the sample did mix types at one call site
    for (k1, s1, t1), (k2, s2, t2) in itertools.combinations(calls, 2):
        if k1 == k2:
            assert s1 == s2, (s1, s2)
        if t1 == t2 and s1 == s2:
            assert k1 == k2, (s1, s2)
    # no options, constexprs by position
    args = (base, base, 3, 4, 0.5, 2)
    assert launcher._binder(kernel, args, {})(args, {})[1] == (base.data_ptr(), base.data_ptr(), 3, 4, 0.5, 2)


def test_key_separates_descriptor_specializations():
    """Host-built descriptors (HostDesc, and triton's TensorDescriptor): Triton specializes on their
    dtype and box; the key does too (and on nothing else), the launcher receives the descriptor
    itself, and Triton's path receives the TensorDescriptor a HostDesc stands for."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.randn(2, 64, 4, 32)
    calls = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = base.to(dtype)
        for rows in (16, 32):
            for n in (64, 48):
                shape, strides, box = (2, n, 128), (t.stride(0), t.stride(1), 1), (1, rows, 32)
                host = launcher.HostDesc((t, shape, strides, box, None))
                (desc,) = launcher._for_triton((host,))
                assert type(desc) is TensorDescriptor and desc.base is t
                assert (desc.shape, desc.strides, desc.block_shape) == (list(shape), list(strides), list(box))
                for d in (host, TensorDescriptor(t, list(shape), list(strides), list(box))):
                    args = (d, base, 3, 4, 0.5)
                    key, launched = launcher._bound(kernel, args, {"C": 1})
                    assert launched[0] is d
                    calls.append((key[-1], _triton_spec(kernel, (desc, *args[1:], 1), ())))
    assert len({s for _, s in calls}) == 6
    for (k1, s1), (k2, s2) in itertools.combinations(calls, 2):
        assert (k1 == k2) == (s1 == s2), (s1, s2)  # either type: the same key for the same specialization


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


def test_direct_launch_works_or_steps_aside(monkeypatch):
    """Against a stubbed Triton launch (the CPU has no driver): on the Triton release the direct path was written
    for (launcher.WRITTEN_FOR), a call's first launch goes through Triton and a repeat goes straight to the
    compiled kernel's launcher with its pointers as integers; on any other release every launch takes Triton's own
    path, untouched."""
    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        class src:  # no descriptor parameters
            signature = {"A": "*fp32", "B": "*fp32", "n": "i32", "m": "i32", "x": "fp32", "C": "constexpr"}

        @staticmethod
        def run(*args):
            calls.append(("direct", args))

    def triton_run(*args, grid, warmup, **kwargs):
        calls.append(("triton", args, kwargs))
        return Compiled

    stub = JITFunction(_kernel)
    monkeypatch.setattr(stub, "run", triton_run)
    monkeypatch.setattr(launcher, "DIRECT_LAUNCH", launcher.SUPPORTED)  # as at import, whatever the environment
    monkeypatch.setattr(launcher, "VERIFY_LAUNCH", False)  # the stub compiled nothing for Triton to choose
    monkeypatch.setattr(launcher._runtime, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    a, b = torch.randn(64), torch.randn(64)
    before = launcher.direct_launches
    for _ in range(2):
        launcher.launch(stub, (3, 2), a, b, 5, 17, 0.5, C=2)
    assert launcher.SUPPORTED == __import__("triton").__version__.startswith(launcher.WRITTEN_FOR)
    assert calls[0][0] == "triton" and calls[0][1] == (a, b, 5, 17, 0.5) and calls[0][2] == {"C": 2}
    if launcher.SUPPORTED:
        assert launcher.direct_launches == before + 1
        assert calls[1] == (
            "direct",
            (3, 2, 1, 7, "function", "metadata", None, None, None, a.data_ptr(), b.data_ptr(), 5, 17, 0.5, 2),
        )
    else:
        assert launcher.direct_launches == before
        assert calls[1] == calls[0]


@pytest.mark.skipif(not ON_GPU, reason="direct launches exist only on the GPU")
def test_relaunch_is_tritons_choice():
    """Launch the rotary kernel through shapes whose strides and sizes cross Triton's
    specialization boundaries; every relaunch is verified (VERIFY_LAUNCH) and exact."""
    from flashattn2.layers.rotary import apply_rotary_emb
    from flashattn2.reference.rotary import rotary_ref

    assert launcher.VERIFY_LAUNCH
    before = launcher.direct_launches
    for seqlen, nheads, aligned in [
        (16, 4, True),
        (16, 4, False),
        (17, 4, True),
        (16, 1, False),
        (33, 3, True),
        (17, 4, False),
    ]:
        shape = (2, seqlen, nheads, 64)
        flat = torch.randn(2 * seqlen * nheads * 64 + 1, device=DEVICE, dtype=torch.float16)
        # a base 16-byte aligned or 2 bytes off: two specializations of one shape
        x = (flat[:-1] if aligned else flat[1:]).view(shape)
        ang = torch.rand(80, 16, device=DEVICE)
        cos, sin = ang.cos().half(), ang.sin().half()
        # an int offset and a tensor of offsets: two argument-type combinations at one call site
        for offsets in (3, torch.tensor([0, 5], device=DEVICE, dtype=torch.int32)):
            for _ in range(2):
                out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
                ref = rotary_ref(x.float(), cos.float(), sin.float(), seqlen_offsets=offsets)
                torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    # each (shape, offsets) pair's second call at least was launched directly (and verified)
    assert launcher.direct_launches - before >= 12


@pytest.mark.skipif(not ON_GPU, reason="direct launches exist only on the GPU")
def test_host_descriptor_relaunch(monkeypatch):
    """Relaunches with host-built descriptors encode them here (ops.launcher._tma_map), not in
    Triton's launcher: forward and gradients equal Triton's own launches bit for bit, for new
    tensors at new addresses and shapes, and the encoding path was the one taken."""
    import flashattn2
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

    # seqlen 300 and 1000 are one class of int for Triton (not a multiple of 16), 256 another: the
    # first call of each class may go through Triton's path, the later ones launch directly
    for n, seed in ((256, 0), (256, 1), (300, 2), (256, 3), (1000, 4)):
        before = launcher.direct_launches
        direct = run(n, seed)
        assert launcher.direct_launches > before or (n, seed) in ((256, 0), (300, 2))
        with monkeypatch.context() as m:
            m.setattr(launcher, "DIRECT_LAUNCH", False)
            reference = run(n, seed)
        for a, b in zip(direct, reference):
            assert torch.equal(a, b)
    assert sum(isinstance(d, launcher._Described) for _, d in launcher._LAUNCHED.values()) >= 3  # fwd, dK/dV, dQ
