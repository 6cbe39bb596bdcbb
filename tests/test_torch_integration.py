"""torch.library registration: opcheck, and torch.compile(fullgraph=True) without graph breaks."""

import pytest
import torch

import flashattn2
from cases import make_qkv, randn
from flashattn2.ops.run import registry


OPTIONS = [
    pytest.param((False, -1, -1, 0.0, False), id="full"),
    pytest.param((True, -1, -1, 0.0, False), id="causal"),
    pytest.param((True, 9, -1, 2.0, True), id="causal-window-softcap-alibi"),
]


def _args(options, nheads=4):
    """fwd's arguments after v, for a dense call with softmax_scale 0.25."""
    causal, left, right, softcap, alibi = options
    slopes = torch.rand(nheads, device=randn(1, dtype=torch.float32).device) if alibi else None
    return (None, None, 0, 0, 0.0, None, 0.25, causal, left, right, softcap, slopes)


@pytest.mark.parametrize("options", OPTIONS)
def test_opcheck_fwd(options):
    q, k, v = make_qkv((1, 33, 47, 4, 2, 32), torch.float16)
    torch.library.opcheck(registry.fwd, (q, k, v, *_args(options)))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_opcheck_bwd(with_dlse, options):
    q, k, v = make_qkv((1, 33, 47, 4, 2, 32), torch.float16, requires_grad=False)
    args = _args(options)
    out, lse = registry.fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(registry.bwd, (dout, q, k, v, out, lse, dlse, dq, dk, dv, *args, None, None))


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=64, heads=2, packing=None):
        super().__init__()
        self.heads, self.packing = heads, packing
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, -1)
        if self.packing == "qkv":
            out = flashattn2.flash_attn_qkvpacked_func(qkv, causal=True)
        elif self.packing == "kv":
            out = flashattn2.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True)
        else:
            slopes = torch.full((self.heads,), 0.25, device=x.device)
            out = flashattn2.flash_attn_func(
                *qkv.unbind(2), causal=True, window_size=(16, -1), softcap=3.0, alibi_slopes=slopes
            )
        return out.reshape(b, s, -1)


@pytest.mark.parametrize(
    "backend, packing",
    [
        pytest.param("inductor", None, id="inductor-unpacked"),
        pytest.param("aot_eager", "qkv", id="aot_eager-qkvpacked"),
        pytest.param("aot_eager", "kv", id="aot_eager-kvpacked"),
    ],
)
def test_compile_fullgraph(backend, packing):
    torch._dynamo.reset()
    model = TinyAttention(packing=packing).to(randn(1, dtype=torch.float32).device)
    x = randn(2, 40, 64, dtype=torch.float32, requires_grad=True)
    eager_out = model(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), [x, *model.parameters()])
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_opcheck_varlen():
    cu = torch.tensor([0, 20, 21, 50], dtype=torch.int32, device=randn(1, dtype=torch.float32).device)
    q, k, v = (randn(50, h, 32, dtype=torch.float16, requires_grad=True) for h in (4, 2, 2))
    seed = torch.tensor([1234], dtype=torch.int64, device=cu.device)
    args = (cu, cu, 29, 29, 0.1, seed, 0.25, True, -1, -1, 0.0, None)
    torch.library.opcheck(registry.fwd, (q, k, v, *args))
    out, lse = registry.fwd(q.detach(), k.detach(), v.detach(), *args)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(
        registry.bwd,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, dq, dk, dv, *args, None, None),
    )


def test_compile_fullgraph_varlen():
    torch._dynamo.reset()
    cu = torch.tensor([0, 20, 21, 50], dtype=torch.int32, device=randn(1, dtype=torch.float32).device)

    def step(q, k, v):
        return flashattn2.flash_attn_varlen_func(q, k, v, cu, cu, 29, 29, causal=True).square().sum()

    q, k, v = (randn(50, 4, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for g, e in zip(compiled, eager):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_opcheck_with_a_sink():
    """The sink is fwd's last argument; bwd writes its gradient into dsink (a mutated argument)."""
    q, k, v = make_qkv((1, 33, 47, 4, 2, 32), torch.float16, requires_grad=False)
    sink = torch.randn(4, device=q.device)
    args = _args((True, -1, -1, 0.0, False))
    torch.library.opcheck(registry.fwd, (q, k, v, *args, sink))
    out, lse = registry.fwd(q, k, v, *args, sink)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = torch.empty_like(sink)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, None, dq, dk, dv, *args, sink, dsink, True)
    torch.library.opcheck(registry.bwd, bwd_args)
    assert torch.isfinite(dsink).all()


def test_compile_fullgraph_with_a_sink():
    """torch.compile traces the op with its sink; the compiled backward (the op's register_autograd) returns the
    sink's gradient, equal to eager's."""
    torch._dynamo.reset()
    q, k, v = (randn(2, 40, 4, 32, dtype=torch.float32, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, device=q.device).requires_grad_()

    def step(q, k, v, sink):
        return flashattn2.flash_attn_func(q, k, v, causal=True, learnable_sink=sink).square().sum()

    eager = torch.autograd.grad(step(q, k, v, sink), (q, k, v, sink))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v, sink), (q, k, v, sink))
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
