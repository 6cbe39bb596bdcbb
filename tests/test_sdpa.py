"""flashattn2 as torch's flash-attention kernel (integrations.sdpa): each function installed for an aten op, called
on the test device against the reference and SDPA's math backend; the ops through torch's dispatcher (installed for
CPU tensors here: torch's registry installs them for CUDA); the fallback rule; torch's registry round trip."""

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend
import torch.nn.functional as F

import flashattn2
from cases import cu_seqlens, make_qkv, randn
from conftest import DEVICE, ON_GPU
from flashattn2.integrations import sdpa as S
from flashattn2.integrations import sdpa_registration
from flashattn2.reference import FWD_FACTOR, attention_ref
from tolerance import assert_close, check_against_reference

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def sdpa_layout(*tensors):
    """(batch, seqlen, nheads, d) -> SDPA's (batch, nheads, seqlen, d), as views (strides of a transposed tensor)."""
    return tuple(t.transpose(1, 2) for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, causal, scale, dv",
    [
        pytest.param((2, 13, 13, 4, 4, 32), False, None, None, id="b2-s13-h4-d32"),
        pytest.param((1, 17, 17, 4, 2, 16), True, 0.3, None, id="b1-s17-h4-hk2-d16-causal-scale"),
        pytest.param((1, 9, 21, 2, 1, 24), False, None, 40, id="b1-sq9-sk21-h2-hk1-d24-dv40"),
        pytest.param((1, 5, 5, 2, 2, 256), True, None, None, id="b1-s5-h2-d256-causal"),
    ],
)
def test_sdpa_op_forward_backward(shape, causal, scale, dv, dtype):
    """_scaled_dot_product_flash_attention and its backward on SDPA's layout: out, logsumexp (batch, nheads,
    seqlen_q), gradients; GQA and a value head dim of its own."""
    q, k, v = make_qkv(shape, dtype)
    if dv is not None:
        v = randn(*v.shape[:-1], dv, dtype=dtype, requires_grad=True)
    result = S.scaled_dot_product_flash_attention(*sdpa_layout(q, k, v), 0.0, causal, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug_mask = result
    assert (cum_q, cum_k, max_q, max_k) == (None, None, shape[1], shape[2])
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,) and unused.shape == ()
    assert debug_mask.numel() == 0 and lse.shape == (shape[0], shape[3], shape[1])
    do = torch.randn_like(out)
    grads = S.scaled_dot_product_flash_attention_backward(
        do, *sdpa_layout(q, k, v), out, lse, None, None, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
    )
    assert [g.shape for g in grads] == [t.transpose(1, 2).shape for t in (q, k, v)]
    check_against_reference(
        q, k, v, out.transpose(1, 2), lse, [g.transpose(1, 2) for g in grads], do.transpose(1, 2),
        causal=causal, softmax_scale=scale,
    )  # fmt: skip


def test_sdpa_op_matches_sdpa_math_backend():
    """The same call through SDPA's math backend (enable_gqa): flashattn2's error against the float32 math is within
    the tolerance rule's bound of the half-precision math's."""
    q, k, v = sdpa_layout(*make_qkv((2, 11, 11, 4, 2, 32), torch.float16, requires_grad=False))
    out = S.scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        low = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close("out", out, ref, low, FWD_FACTOR)


@pytest.mark.parametrize(
    "opts",
    [
        pytest.param(dict(causal=True), id="causal-bottom-right"),
        pytest.param(dict(window_size=(5, 2)), id="window"),
        pytest.param(dict(causal=True, window_size=(4, -1)), id="causal-window"),
    ],
)
def test_flash_op_dense_options(opts):
    """_flash_attention_forward / _backward on flash's (batch, seqlen, nheads, d) layout with seqlen_q != seqlen_k:
    causal is bottom-right aligned (torch's flash kernel's), windows by flash_attn's rule."""
    q, k, v = make_qkv((2, 7, 19, 4, 2, 32), torch.bfloat16)
    causal, (left, right) = opts.get("causal", False), opts.get("window_size", (-1, -1))
    window = dict(window_size_left=left, window_size_right=right)
    out, lse, rng_state, unused, _ = S.flash_attention_forward(q, k, v, None, None, 7, 19, 0.0, causal, False, **window)
    do = torch.randn_like(out)
    grads = S.flash_attention_backward(
        do, q, k, v, out, lse, None, None, 7, 19, 0.0, causal, rng_state, unused, **window
    )
    check_against_reference(q, k, v, out, lse, grads, do, **opts)


def test_flash_op_alibi_forward():
    """alibi_slopes in the forward (the backward's schema carries none: torch's kernel's neither)."""
    q, k, v = make_qkv((1, 9, 12, 4, 4, 16), torch.float16, requires_grad=False)
    slopes = torch.rand(4, device=DEVICE) * 0.5
    out, lse = S.flash_attention_forward(q, k, v, None, None, 9, 12, 0.0, True, False, alibi_slopes=slopes)[:2]
    check_against_reference(q, k, v, out, lse, None, None, causal=True, alibi_slopes=slopes)


def test_flash_op_ragged_and_inplace():
    """Ragged inputs (cum_seq_q / cum_seq_k): logsumexp (nheads, total_q), gradients; the in-place op writes out."""
    lengths_q, lengths_k = [5, 9], [8, 6]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q = randn(sum(lengths_q), 4, 32, dtype=torch.float16, requires_grad=True)
    k = randn(sum(lengths_k), 2, 32, dtype=torch.float16, requires_grad=True)
    v = randn(sum(lengths_k), 2, 32, dtype=torch.float16, requires_grad=True)
    window = dict(window_size_left=-1, window_size_right=0)  # varlen_attn's causal
    out, lse, rng_state, unused, _ = S.flash_attention_forward(q, k, v, cu_q, cu_k, 9, 8, 0.0, False, False, **window)
    assert lse.shape == (4, sum(lengths_q))
    do = torch.randn_like(out)
    dq, dk, dv = S.flash_attention_backward(
        do, q, k, v, out, lse, cu_q, cu_k, 9, 8, 0.0, False, rng_state, unused, **window
    )
    written = torch.full_like(out, float("nan"))
    lse_inplace = S.flash_attention_forward_no_dropout_inplace(
        written, q, k, v, cu_q, cu_k, 9, 8, 0.0, False, False, **window
    )
    assert torch.equal(written, out) and torch.equal(lse_inplace, lse)
    for b in range(2):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts = [t[None] for t in (q[sq].detach(), k[sk].detach(), v[sk].detach())]
        parts = [t.requires_grad_() for t in parts]
        grads = [g[None] for g in (dq[sq], dk[sk], dv[sk])]
        check_against_reference(
            *parts, out[sq][None], lse[:, sq][None], grads, do[sq][None], window_size=(-1, 0), name=f"seq{b}"
        )


def test_dropout_mask_replayed_by_backward():
    """Dropout: rng_state (2,) uint64 holds the seed the backward replays; out and gradients match the reference
    run with the mask read from debug_attn_mask's signs; the same torch seed gives the same result."""
    p = 0.2
    q, k, v = make_qkv((1, 15, 15, 2, 2, 32), torch.float16)
    torch.manual_seed(1234)
    result = S.scaled_dot_product_flash_attention(*sdpa_layout(q, k, v), p, False, True)
    out, lse, rng_state, unused, debug_mask = result[0], result[1], *result[6:]
    assert rng_state.dtype == torch.uint64 and rng_state[0] != 0
    torch.manual_seed(1234)
    again = S.scaled_dot_product_flash_attention(*sdpa_layout(q, k, v), p, False, True)
    assert torch.equal(again[6], rng_state) and torch.equal(again[0], out)
    mask = (debug_mask[:, :, :15, :15] >= 0).to(q.device)
    assert 0.6 < mask.float().mean().item() < 0.95
    do = torch.randn_like(out)
    grads = S.scaled_dot_product_flash_attention_backward(
        do, *sdpa_layout(q, k, v), out, lse, None, None, 15, 15, p, False, rng_state, unused
    )
    check_against_reference(
        q, k, v, out.transpose(1, 2), lse, [g.transpose(1, 2) for g in grads], do.transpose(1, 2),
        dropout_mask=mask, dropout_p=p,
    )  # fmt: skip


def _paged(k, page_size):
    """k (batch, seqlen, nheads, d) as pages (batch * seqlen / page_size, page_size, nheads, d) in shuffled order,
    with its block_table (batch, seqlen / page_size) int32."""
    batch, seqlen = k.shape[:2]
    per_seq = seqlen // page_size
    order = torch.randperm(batch * per_seq, device=k.device)
    pages = torch.empty(batch * per_seq, page_size, *k.shape[2:], dtype=k.dtype, device=k.device)
    pages[order] = k.reshape(batch * per_seq, page_size, *k.shape[2:])
    return pages, order.reshape(batch, per_seq).to(torch.int32)


def test_paged_kv_and_seqused_k():
    """block_table (paged K/V) with seqused_k: dense queries (a KV cache) and ragged ones (varlen_attn's
    cum_seq_k=None); seqused_k on unpaged keys, dense and ragged; each against the reference on its sequence's first
    seqused_k keys."""
    q, k, v = make_qkv((2, 3, 32, 2, 1, 16), torch.float16, requires_grad=False)
    k_pages, table = _paged(k, 16)
    v_pages = torch.empty_like(k_pages)
    v_pages[table.reshape(-1).long()] = v.reshape(-1, 16, *v.shape[2:])
    used = torch.tensor([20, 29], dtype=torch.int32, device=q.device)
    dense_out, dense_lse = S.flash_attention_forward(
        q, k_pages, v_pages, None, None, 3, 32, 0.0, True, False, seqused_k=used, block_table=table
    )[:2]
    cu_q = cu_seqlens([3, 3])
    ragged_out, ragged_lse = S.flash_attention_forward(
        q.reshape(6, 2, 16), k_pages, v_pages, cu_q, None, 3, 29, 0.0, True, False, seqused_k=used, block_table=table
    )[:2]
    unpaged = S.flash_attention_forward(q, k, v, None, None, 3, 32, 0.0, True, False, seqused_k=used)
    unpaged_out, unpaged_lse = unpaged[:2]
    packed = [t.reshape(64, 1, 16) for t in (k, v)]
    ragged_unpaged = S.flash_attention_forward(
        q.reshape(6, 2, 16), *packed, cu_q, cu_seqlens([32, 32]), 3, 32, 0.0, True, False, seqused_k=used
    )
    for b in range(2):
        n = int(used[b])
        parts = (q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n])
        check_against_reference(*parts, dense_out[b : b + 1], dense_lse[b : b + 1], None, None, causal=True)
        check_against_reference(*parts, unpaged_out[b : b + 1], unpaged_lse[b : b + 1], None, None, causal=True)
        rows = slice(3 * b, 3 * b + 3)
        check_against_reference(*parts, ragged_out[rows][None], ragged_lse[:, rows][None], None, None, causal=True)
        out, lse = ragged_unpaged[0][rows][None], ragged_unpaged[1][:, rows][None]
        check_against_reference(*parts, out, lse, None, None, causal=True, name="ragged-unpaged")


class FakeKernel:
    """torch's previous kernel as serving() holds it: records its calls."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        return "torch's result"


def test_fallback_rule():
    """What flashattn2 cannot serve goes to the kernel torch had, with the same arguments, and is counted by reason;
    what it serves never reaches that kernel; with no kernel to fall back to, the error names the op and why."""
    S.fallbacks(reset=True)
    previous = FakeKernel()
    op = "_scaled_dot_product_flash_attention"
    kernel = S.serving(op, S.scaled_dot_product_flash_attention, previous)
    q32 = torch.randn(1, 2, 5, 16, device=DEVICE)
    assert kernel("keyset", q32, q32, q32, 0.0, False, False, scale=0.5) == "torch's result"
    assert previous.calls == [("keyset", (q32, q32, q32, 0.0, False, False), {"scale": 0.5})]
    q16 = q32.half()
    assert kernel("keyset", q16, q16, q16, 0.0, False, True) == "torch's result"  # a debug mask without dropout
    served = kernel("keyset", q16, q16, q16)
    assert served[0].shape == q16.shape and len(previous.calls) == 2
    wide = torch.randn(1, 2, 3, 520, device=DEVICE, dtype=torch.float16)  # flashattn2's NotImplementedError
    assert kernel("keyset", wide, wide, wide) == "torch's result" and len(previous.calls) == 3
    quantized = S.serving(op + ".quantized", S.scaled_dot_product_flash_attention_quantized, previous)
    assert quantized("keyset", q16, q16, q16, None, None, None)[0].shape == q16.shape  # 16-bit: the plain op's
    d = torch.ones(1, 2, device=DEVICE)
    assert quantized("keyset", q16, q16, q16, d, None, None) == "torch's result"  # descales with 16-bit inputs
    counts = S.fallbacks(reset=True)
    assert counts == {
        f"{op}: dtype torch.float32 (torch's flash kernel takes float16 and bfloat16)": 1,
        f"{op}: return_debug_mask without dropout (torch's kernel refuses it)": 1,
        f"{op}: headdim 520 > 512 is not supported": 1,
        f"{op}.quantized: descales with torch.float16 inputs (flashattn2's FP8 forward takes float8_e4m3fn)": 1,
    }
    assert flashattn2.sdpa_fallbacks() == {}
    with pytest.raises(NotImplementedError, match=f"aten::{op}: flashattn2 leaves this call to torch .dtype"):
        S.serving(op, S.scaled_dot_product_flash_attention, None)("keyset", q32, q32, q32)
    S.fallbacks(reset=True)


def test_quantized_ops_run_the_fp8_forward():
    """The `.quantized` overloads (FA3's FP8 SDPA): float8_e4m3fn inputs with (batch, nheads_k) descales give
    flashattn2's FP8 forward's output (bf16) and logsumexp, dense in SDPA's layout and ragged; dropout falls back."""
    from flashattn2.reference.fp8 import quantize

    q, k, v = (quantize(torch.randn(2, 24, h, 32, device=DEVICE) * 2) for h in (4, 2, 2))
    qd, kd, vd = (torch.rand(2, 2, device=DEVICE) + 0.5 for _ in range(3))
    want, want_lse, _ = flashattn2.flash_attn_func(
        q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
    )
    out, lse, *_ = S.scaled_dot_product_flash_attention_quantized(*sdpa_layout(q, k, v), qd, kd, vd, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out.transpose(1, 2), want) and torch.equal(lse, want_lse)
    cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=DEVICE)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    out, lse, *_ = S.flash_attention_forward_quantized(*flat, cu, cu, 24, 24, 0.0, True, False, qd, kd, vd)
    assert torch.equal(out, want.flatten(0, 1))
    with pytest.raises(S.Unsupported, match="dropout"):
        S.flash_attention_forward_quantized(*flat, cu, cu, 24, 24, 0.1, True, False, qd, kd, vd)


@pytest.mark.skipif(ON_GPU, reason="installs the kernels for CPU tensors: the CPU run's dispatcher test")
def test_through_the_dispatcher_on_cpu():
    """Installed for the CPU key, torch's ops and autograd reach flashattn2: _scaled_dot_product_flash_attention and
    its derivative, varlen_attn forward and backward; removing the handle gives torch its kernels back."""
    handle = S.install("CPU")
    try:
        q, k, v = make_qkv((1, 6, 6, 2, 2, 16), torch.float16)
        out = torch.ops.aten._scaled_dot_product_flash_attention(*sdpa_layout(q, k, v), 0.0, True)[0]
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref_q, ref_k, ref_v = (t.detach().requires_grad_() for t in (q, k, v))
        ref = attention_ref(ref_q, ref_k, ref_v, causal=True)[0]
        ref_grads = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), do.transpose(1, 2).float())
        for g, r in zip((out.transpose(1, 2), *grads), (ref, *ref_grads)):
            torch.testing.assert_close(g.float(), r.float(), atol=2e-2, rtol=2e-2)
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens([2, 4])
        flat = [t.detach().reshape(6, 2, 16).requires_grad_() for t in (q, k, v)]
        varlen = varlen_attn(*flat, cu, cu, 4, 4, window_size=(-1, 0))
        varlen.sum().backward()
        assert flat[0].grad is not None and torch.isfinite(flat[0].grad).all()
        second = attention_ref(*(t[None, 2:] for t in flat), causal=True)[0][0]  # the second sequence
        torch.testing.assert_close(varlen[2:].float(), second.float(), atol=2e-2, rtol=2e-2)
    finally:
        handle.remove()
    with pytest.raises(NotImplementedError):
        torch.ops.aten._scaled_dot_product_flash_attention(*sdpa_layout(q, k, v))


def test_registry_round_trip():
    """torch's registry: flashattn2 is listed; activate, restore, activate again; flashattn2.sdpa() for a scope
    restores what was active before it."""
    attention = S.torch_attention()
    assert sdpa_registration.NAME in attention.list_flash_attention_impls()
    assert sdpa_registration.register() and sdpa_registration.register()  # idempotent
    previous = attention.current_flash_attention_impl()
    try:
        for _ in range(2):
            attention.activate_flash_attention_impl("flashattn2")
            assert attention.current_flash_attention_impl() == "flashattn2"
            if not torch.cuda.is_available():  # a CPU build has no CUDA kernel of its own: ours is the only one
                assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_flash_attention_forward", "CUDA")
            attention.restore_flash_attention_impl()
            assert attention.current_flash_attention_impl() is None
            if not torch.cuda.is_available():
                assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_flash_attention_forward", "CUDA")
        with flashattn2.sdpa():
            assert attention.current_flash_attention_impl() == "flashattn2"
            with flashattn2.sdpa():
                assert attention.current_flash_attention_impl() == "flashattn2"
            assert attention.current_flash_attention_impl() == "flashattn2"
        assert attention.current_flash_attention_impl() is None
    finally:
        if previous is not None:
            attention.activate_flash_attention_impl(previous)


def start_cuda() -> None:
    """CUDA started in this process where there is one (an xdist worker may not have used it yet), so that activation
    orders the backends at once rather than at CUDA's lazy start."""
    if torch.cuda.is_available():
        torch.cuda.init()


def test_activation_puts_flash_first_and_restores_the_order():
    """Activating flashattn2 (torch's activate_flash_attention_impl, or flashattn2.sdpa()) puts SDPA's flash backend
    first in torch's priority order -- torch tries cuDNN's first on Hopper, so a plain scaled_dot_product_attention
    call would not reach flashattn2 -- and restoring puts the order back as it was. CUDA started first where there is
    one (activation before CUDA's start defers the order to it: test_activation_before_cuda_starts_puts_flash_first_when_it_does)."""
    start_cuda()
    attention = S.torch_attention()
    flash, cudnn = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)
    previous = attention.current_flash_attention_impl()
    if previous is not None:  # (the test starts from torch's own kernels)
        attention.restore_flash_attention_impl()
    original = list(torch._C._get_sdp_priority_order())
    cudnn_first = [cudnn, *(b for b in original if b != cudnn)]  # (Hopper's order)
    torch._C._set_sdp_priority_order(cudnn_first)
    try:
        with flashattn2.sdpa():
            order = list(torch._C._get_sdp_priority_order())
            assert order[0] == flash and sorted(order) == sorted(cudnn_first), order
        assert list(torch._C._get_sdp_priority_order()) == cudnn_first
        attention.activate_flash_attention_impl("flashattn2")
        assert list(torch._C._get_sdp_priority_order())[0] == flash
        attention.restore_flash_attention_impl()
        assert list(torch._C._get_sdp_priority_order()) == cudnn_first
        # an order changed while flashattn2 was active stays (the handle does not put back a stale one)
        attention.activate_flash_attention_impl("flashattn2")
        torch._C._set_sdp_priority_order(original)
        attention.restore_flash_attention_impl()
        assert list(torch._C._get_sdp_priority_order()) == original
    finally:
        if previous is not None:
            attention.activate_flash_attention_impl(previous)
        torch._C._set_sdp_priority_order(original)


def test_flash_stays_first_past_torchs_first_backend_choice(monkeypatch):
    """torch sets its default priority order (cuDNN first on Hopper) lazily, at the process's first SDPA backend
    choice, over any order set before: activation makes that choice before it puts flash first, so that the first
    scaled_dot_product_attention call in the scope keeps flash first. torch's lazy default emulated here (the GPU's
    case: test_a_fresh_process_reaches_flashattn2_kernels)."""
    start_cuda()
    flash, cudnn = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)
    original = list(torch._C._get_sdp_priority_order())
    chosen = []

    def first_choice():  # torch's priority_order(): its default set on the first choice only
        if not chosen:
            torch._C._set_sdp_priority_order([cudnn, *(b for b in original if b != cudnn)])
        chosen.append(True)

    monkeypatch.setattr(S, "first_backend_choice", first_choice)
    try:
        with flashattn2.sdpa():
            first_choice()  # the scope's first F.scaled_dot_product_attention
            assert list(torch._C._get_sdp_priority_order())[0] == flash
        assert list(torch._C._get_sdp_priority_order())[0] == cudnn  # torch's default back, not the unsettled one
    finally:
        torch._C._set_sdp_priority_order(original)


def test_activation_before_cuda_starts_puts_flash_first_when_it_does(monkeypatch):
    """Activated before the process has used CUDA (the README's order: activate, then load the model), flashattn2
    does not start CUDA: it settles torch's order and puts flash first at CUDA's lazy start (torch.cuda._lazy_call),
    before any SDPA call can choose; a handle removed before then leaves the order alone. CUDA's start emulated."""
    flash, cudnn = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)
    original = list(torch._C._get_sdp_priority_order())
    queued, chosen = [], []

    def first_choice():  # torch's priority_order(): its default set on the first choice only
        if not chosen:
            torch._C._set_sdp_priority_order([cudnn, *(b for b in original if b != cudnn)])
        chosen.append(True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(S, "first_backend_choice", first_choice)
    try:
        with flashattn2.sdpa():  # removed before CUDA starts
            pass
        queued.pop()()
        assert not chosen and list(torch._C._get_sdp_priority_order()) == original
        with flashattn2.sdpa():
            assert len(queued) == 1 and list(torch._C._get_sdp_priority_order()) == original  # CUDA not started
            queued.pop()()  # CUDA starts: torch's default settled, then flash first
            first_choice()  # the scope's first F.scaled_dot_product_attention
            assert chosen and list(torch._C._get_sdp_priority_order())[0] == flash
        assert list(torch._C._get_sdp_priority_order())[0] == cudnn
    finally:
        torch._C._set_sdp_priority_order(original)


@pytest.mark.skipif(not ON_GPU, reason="SDPA's CUDA backend choice")
def test_a_fresh_process_reaches_flashattn2_kernels():
    """In a process that has not called SDPA yet (so torch's lazy default order is not set), activation -- before the
    process has used CUDA, and after -- and then a plain F.scaled_dot_product_attention(q, k, v, is_causal=True) run
    flashattn2's kernels (the profiler's names), not
    cuDNN's or torch's flash kernels; restoring gives torch's choice back."""
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "import flashattn2\n"
        "activate = lambda: torch.nn.attention.activate_flash_attention_impl('flashattn2')\n"
        "if sys.argv[1] == 'before-cuda':\n"
        "    activate()\n"
        "    assert not torch.cuda.is_initialized()  # activation does not start CUDA\n"
        "q, k, v = (torch.randn(2, 4, 256, 64, device='cuda', dtype=torch.bfloat16) for _ in range(3))\n"
        "if sys.argv[1] == 'after-cuda':\n"
        "    activate()\n"
        "def kernels():\n"
        "    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:\n"
        "        F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "        torch.cuda.synchronize()\n"
        "    return ','.join(e.key.replace(',', ' ') for e in prof.key_averages())\n"
        "print(kernels())\n"
        "torch.nn.attention.restore_flash_attention_impl()\n"
        "print(kernels())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    for when in ("before-cuda", "after-cuda"):
        run = subprocess.run([sys.executable, "-c", code, when], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        active, restored = (line.split(",") for line in run.stdout.splitlines()[-2:])
        theirs = ("cudnn", "flash_fwd", "fmha")
        assert any(n.startswith("attn_fwd") for n in active), (when, active)
        assert not any(s in n.lower() for n in active for s in theirs), (when, active)
        assert not any(n.startswith("attn_fwd") for n in restored), (when, restored)


def test_torch_without_registry(monkeypatch):
    """On a torch whose torch.nn.attention lacks the registry, registering is a no-op and flashattn2.sdpa() says
    which torch it needs."""
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    assert not sdpa_registration.register()
    needs = r"register_flash_attention_impl.*torch 2\.11, 2\.13 and 2\.14.*this is torch"
    with pytest.raises(RuntimeError, match=needs):
        with flashattn2.sdpa():
            pass


def test_import_registers_before_and_after_torch():
    """`import flashattn2` registers the name whether torch comes before or after it (an import hook then), and
    leaves a torch without the registry alone."""
    code = (
        "import sys\n"
        "order = sys.argv[1]\n"
        "if order == 'after':\n"
        "    import flashattn2\n"
        "    assert 'torch' not in sys.modules\n"
        "import torch.nn.attention as attention\n"
        "if order == 'old':\n"
        "    del attention.register_flash_attention_impl\n"
        "import flashattn2\n"
        "print(order, 'flashattn2' in getattr(attention, 'list_flash_attention_impls', list)())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src")]))
    for order, listed in (("after", True), ("before", True), ("old", False)):
        run = subprocess.run([sys.executable, "-c", code, order], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split() == [order, str(listed)]
