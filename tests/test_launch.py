"""The direct launch path (ops._runtime.launch): its key must tell apart every pair of calls
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
from flashattn2.ops import _runtime


def _kernel(A, B, n, m, x, C: tl.constexpr):
    pass


kernel = JITFunction(_kernel)  # not triton.jit: on the CPU that gives the interpreter's function


def _triton_spec(kernel, values):
    return tuple(v if p.is_constexpr else native_specialize_impl(BaseBackend, v, False, True, True)
                 for p, v in zip(kernel.params, values))


def _sample(kind, rng, base):
    if kind == "tensor":
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
        return base.to(dtype)[rng.choice([0, 0, 1, 8]):]  # offsets 0 / 2-4 / 16-32 bytes
    if kind == "int":
        return rng.choice([0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**33 + 1, 2**63])
    return rng.choice([0.5, 1.0, 0.0])


def test_key_separates_triton_specializations():
    rng = random.Random(0)

    base = torch.randn(64)
    kinds = ["tensor", "tensor", "int", "int", "float"]
    calls = []
    for _ in range(300):
        args = tuple(_sample(k, rng, base) for k in kinds)
        const = rng.choice([1, 2])
        bind = _runtime._binder(kernel, args, {"C": const, "num_warps": 4})
        key, launched = bind(args, {"C": const, "num_warps": 4})
        calls.append((key, _triton_spec(kernel, (*args, const))))
        # pointers go to the launcher as integers, everything else as given
        assert launched[0] == args[0].data_ptr() and launched[2:] == (*args[2:], const)
    for (k1, s1), (k2, s2) in itertools.combinations(calls, 2):
        assert (k1 == k2) == (s1 == s2), (s1, s2)
    # an argument of another type than the first call's: no key, Triton's own path
    args = (base, base, 1.5, 3, 0.5)
    assert bind(args, {"C": 1, "num_warps": 4}) is None
    # a call site whose argument types change gets a binder per combination
    other = (base, base, 1.5, 3, 0.5)
    _runtime._binder(kernel, other, {"C": 1, "num_warps": 4})(other, {"C": 1, "num_warps": 4})
    # no options, constexprs by position
    args = (base, base, 3, 4, 0.5, 2)
    assert _runtime._binder(kernel, args, {})(args, {})[1] == (base.data_ptr(), base.data_ptr(), 3, 4, 0.5, 2)


@pytest.mark.skipif(not ON_GPU, reason="direct launches exist only on the GPU")
def test_relaunch_is_tritons_choice():
    """Launch the rotary kernel through shapes whose strides and sizes cross Triton's
    specialization boundaries; every relaunch is verified (VERIFY_LAUNCH) and exact."""
    from flashattn2.layers.rotary import apply_rotary_emb
    from flashattn2.reference.rotary import rotary_ref

    assert _runtime.VERIFY_LAUNCH
    before = _runtime.direct_launches
    for seqlen, nheads in [(16, 4), (17, 4), (16, 1), (33, 3), (16, 4), (17, 4)]:
        x = torch.randn(2, seqlen, nheads, 64, device=DEVICE, dtype=torch.float16)
        ang = torch.rand(80, 16, device=DEVICE)
        cos, sin = ang.cos().half(), ang.sin().half()
        # an int offset and a tensor of offsets: two argument-type combinations at one call site
        for offsets in (3, torch.tensor([0, 5], device=DEVICE, dtype=torch.int32)):
            for _ in range(2):
                out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets)
                ref = rotary_ref(x.float(), cos.float(), sin.float(), seqlen_offsets=offsets)
                torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    # each (shape, offsets) pair's second call at least was launched directly (and verified)
    assert _runtime.direct_launches - before >= 12
