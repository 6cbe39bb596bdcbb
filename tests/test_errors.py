"""Bad input raises a clear error naming the argument; options not implemented yet are refused."""

import pytest
import torch

import flashattn2
from cases import randn
from conftest import DEVICE, ON_GPU

f16 = torch.float16


def qkv(b=1, sq=16, sk=16, h=2, hk=2, d=32, dtype=f16):
    make = lambda s, n: randn(b, s, n, d, dtype=torch.float32).to(dtype)
    return make(sq, h), make(sk, hk), make(sk, hk)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        pytest.param(
            lambda: (randn(16, 2, 32, dtype=f16), *qkv()[1:]), ValueError, "q must have 4 dimensions", id="q-ndim"
        ),
        pytest.param(
            lambda: (qkv()[0], randn(1, 16, 2, dtype=f16), qkv()[2]), ValueError, "k must have 4", id="k-ndim"
        ),
        pytest.param(lambda: (qkv()[0].tolist(), *qkv()[1:]), TypeError, "q must be a torch.Tensor", id="q-type"),
        pytest.param(lambda: qkv(dtype=torch.int32), TypeError, "dtype", id="int-dtype"),
        pytest.param(lambda: qkv(dtype=torch.float64), TypeError, "dtype", id="fp64"),
        pytest.param(
            lambda: (qkv()[0], qkv(dtype=torch.bfloat16)[1], qkv()[2]), TypeError, "one dtype", id="mixed-dtype"
        ),
        pytest.param(lambda: (qkv()[0], qkv(b=2)[1], qkv(b=2)[2]), ValueError, "batch", id="batch-mismatch"),
        pytest.param(lambda: (qkv()[0], qkv(d=64)[1], qkv(d=64)[2]), ValueError, "headdim", id="headdim-mismatch"),
        pytest.param(lambda: (qkv()[0], qkv(sk=9)[1], qkv()[2]), ValueError, "same shape", id="kv-shape"),
        pytest.param(lambda: qkv(h=6, hk=4), ValueError, "multiple of nheads", id="gqa-ratio"),
        pytest.param(lambda: qkv(d=520), NotImplementedError, "headdim 520", id="headdim-520"),
        pytest.param(lambda: qkv(h=0, hk=0), ValueError, ">= 1", id="no-heads"),
    ],
)
def test_bad_inputs(case, exc, match):
    with pytest.raises(exc, match=match):
        flashattn2.flash_attn_func(*case())


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 0), (0, 7), (0, 0)])
def test_empty_sequences_as_flash_attn(seqlen_q, seqlen_k):
    """flash_attn accepts a dense seqlen of 0: out zeros, lse +inf, gradients zeros; packed too."""
    q, k, v = (t.requires_grad_() for t in qkv(b=2, sq=seqlen_q, sk=seqlen_k, h=4, hk=2))
    out, lse, s_dmask = flashattn2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, seqlen_q) and s_dmask.numel() == 0
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    grads = torch.autograd.grad((out.float() + 1).sum() + lse.nan_to_num(posinf=0).sum(), (q, k, v), allow_unused=True)
    for t, g in zip((q, k, v), grads):
        assert g.shape == t.shape and torch.all(g == 0)
    _, _, s_dmask = flashattn2.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 128 * bool(seqlen_q), 128 * bool(seqlen_k))
    kv = torch.stack((k, v), dim=2).detach().requires_grad_()
    out = flashattn2.flash_attn_kvpacked_func(q, kv)
    assert out.shape == q.shape and torch.all(out == 0)
    (dkv,) = torch.autograd.grad(out.sum(), kv)
    assert dkv.shape == kv.shape
    if seqlen_q == seqlen_k:
        qkv_packed = randn(2, seqlen_q, 3, 4, 32, dtype=f16, requires_grad=True)
        out = flashattn2.flash_attn_qkvpacked_func(qkv_packed)
        assert out.shape == q.shape and torch.autograd.grad(out.sum(), qkv_packed)[0].shape == qkv_packed.shape


def test_argument_errors_are_runtime_errors_too():
    """flash_attn reports bad arguments from C++ as RuntimeError and code written for it catches
    RuntimeError: flashattn2's are ArgumentError (ValueError + RuntimeError) and ArgumentTypeError
    (TypeError + RuntimeError); NotImplementedError is a RuntimeError already."""
    from flashattn2 import ArgumentError, ArgumentTypeError

    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, RuntimeError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, RuntimeError)
    q, k, v = qkv()
    for call, exc in (
        (lambda: flashattn2.flash_attn_func(q, k[:, :3], v), ArgumentError),
        (lambda: flashattn2.flash_attn_func(q.tolist(), k, v), ArgumentTypeError),
        (lambda: flashattn2.flash_attn_func(q, k, v, dropout_p=0.1, softcap=5.0), NotImplementedError),
    ):
        for caught in (RuntimeError, exc):
            with pytest.raises(caught):
                call()
    # what flash_attn's own tests catch: a block_table too short for cache_seqlens + seqlen_new
    k_cache = torch.zeros(2, 16, 2, 32, device=DEVICE, dtype=f16)
    table = torch.tensor([[0]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="block_table"):
        flashattn2.flash_attn_with_kvcache(
            q[:, :1], k_cache, k_cache, k[:, :1], v[:, :1], cache_seqlens=16, block_table=table
        )


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        pytest.param(dict(dropout_p=0.1, softcap=5.0), NotImplementedError, "softcap", id="dropout-softcap"),
        pytest.param(dict(dropout_p=1.0), ValueError, "dropout_p", id="dropout-range"),
        pytest.param(dict(window_size=(-2, 0)), ValueError, "window_size", id="window-range"),
        pytest.param(dict(window_size=(1.5, 0)), ValueError, "window_size", id="window-float"),
        pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
        pytest.param(
            dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "alibi_slopes", id="alibi-dtype"
        ),
        pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes", id="alibi-shape"),
        pytest.param(dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes", id="alibi-type"),
        pytest.param(dict(softmax_scale=-0.1), NotImplementedError, "softmax_scale", id="negative-scale"),
    ],
)
def test_unsupported_options(kwargs, exc, match):
    if isinstance(kwargs.get("alibi_slopes"), torch.Tensor):
        kwargs = dict(kwargs, alibi_slopes=kwargs["alibi_slopes"].to(DEVICE))
    for fn, args in (
        (flashattn2.flash_attn_func, qkv()),
        (flashattn2.flash_attn_qkvpacked_func, (torch.stack(qkv(), dim=2),)),
        (flashattn2.flash_attn_kvpacked_func, (qkv()[0], torch.stack(qkv()[1:], dim=2))),
    ):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device beside the CPU")
def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flashattn2.flash_attn_func(q, k.cpu(), v)


def _cpu_calls():
    """Every public entry point that launches a Triton kernel, called on CPU tensors (the attention functions, the
    rotary functions and MHA's rotary path, a ring's merge)."""
    from flashattn2 import parallel
    from flashattn2.layers import rotary
    from flashattn2.modules.mha import MHA
    from flashattn2.ops.launch.merge import merge_

    q, k, v = (t.cpu() for t in qkv())
    cos = sin = torch.randn(16, 8, dtype=f16)
    acc, lse = torch.zeros(1, 16, 2, 32), torch.zeros(1, 2, 16)
    shards = [torch.stack([t, t]) for t in (q, k, v)]
    mha = MHA(64, 2, causal=True, rotary_emb_dim=16, use_flash_attn=True, dtype=f16)
    return {
        "flash_attn_func": lambda: flashattn2.flash_attn_func(q, k, v),
        "flash_attn_with_kvcache": lambda: flashattn2.flash_attn_with_kvcache(q, k, v),
        "apply_rotary_emb": lambda: rotary.apply_rotary_emb(q, cos, sin),
        "apply_rotary_emb_qkv_": lambda: rotary.apply_rotary_emb_qkv_(torch.stack([q, k, v], dim=2), cos, sin),
        "apply_rotary_emb_kv_": lambda: rotary.apply_rotary_emb_kv_(torch.stack([k, v], dim=2), cos, sin),
        "MHA-rotary": lambda: mha(torch.randn(1, 16, 64, dtype=f16)),
        "ring": lambda: parallel.ring_flash_attn_func(*shards, group=parallel.SimulatedGroup(2)),
        "merge_": lambda: merge_(acc, lse, acc, lse, True),
    }


ENTRY_POINTS = ["flash_attn_func", "flash_attn_with_kvcache", "apply_rotary_emb", "apply_rotary_emb_qkv_"]
ENTRY_POINTS += ["apply_rotary_emb_kv_", "MHA-rotary", "ring", "merge_"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_cpu_tensor_without_interpreter(monkeypatch, entry):
    """A CPU tensor without the interpreter is flashattn2's ArgumentError naming TRITON_INTERPRET at every entry
    point that launches a kernel (the rotary path raised Triton's "0 active drivers")."""
    from flashattn2.ops import _runtime

    calls = _cpu_calls()
    assert sorted(calls) == sorted(ENTRY_POINTS)
    call = calls[entry]
    monkeypatch.setattr(_runtime, "interpreted", lambda: False)

    def no_driver():  # what a launch meets on a CPU-only machine without the interpreter
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(_runtime, "kernels", no_driver)
    with pytest.raises(flashattn2.ArgumentError, match="TRITON_INTERPRET=1 is set before"):
        call()


def _plain(x):
    return x


def test_interpreter_set_after_triton_is_named(monkeypatch):
    """Kernels built for the interpreter beside Triton's own functions built for the GPU (TRITON_INTERPRET set after
    triton was imported), or the other way round, raise an error that names TRITON_INTERPRET and when to set it,
    not the interpreter's "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from flashattn2.ops import _runtime

    interpreted, compiled = InterpretedFunction(_plain), JITFunction(_plain)
    _runtime._check_interpreter_setting(interpreted if isinstance(tl.standard.cdiv, InterpretedFunction) else compiled)
    monkeypatch.setattr(tl.standard, "cdiv", compiled)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET was set to 1 after triton was imported"):
        _runtime._check_interpreter_setting(interpreted)
    monkeypatch.setattr(tl.standard, "cdiv", interpreted)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET was unset after triton was imported"):
        _runtime._check_interpreter_setting(compiled)


@pytest.mark.skipif(ON_GPU, reason="the CPU's case: a GPU process runs without the interpreter")
def test_interpreter_set_after_import_end_to_end():
    """As a script does it: triton imported (by flashattn2's functions), then TRITON_INTERPRET=1, then a call."""
    import os
    import subprocess
    import sys

    script = (
        "import os\nfrom flashattn2.ops import _runtime\nos.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n    _runtime.kernels()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "TRITON_INTERPRET was set to 1 after triton was imported" in run.stdout, run.stdout + run.stderr[-2000:]


def test_empty_batch():
    q, k, v = qkv(b=0)
    out = flashattn2.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.device.type == DEVICE
