"""flashattn2.flash_attn_interface: flash_attn 2.8's module, the private block functions that
ring-attention libraries call (against the reference, and merged over key blocks by the logsumexp
as ring-flash-attention merges them) and the autograd classes' .apply."""

import pytest
import torch

import flashattn2
from cases import cu_seqlens
from conftest import DEVICE, ON_GPU
from flashattn2 import flash_attn_interface as fai
from flashattn2.errors import ArgumentError, ArgumentTypeError
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref
from tolerance import assert_close

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
SHAPE = (2, 300, 500, 4, 2, 64) if ON_GPU else (2, 37, 45, 4, 2, 32)
OPTIONS = [
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window=(9, -1), softcap=2.0, alibi=True), id="causal-window-softcap-alibi"),
]


def qkv(shape=SHAPE, dtype=torch.float16):
    b, sq, sk, h, hk, d = shape
    g = lambda *s: torch.randn(*s, device=DEVICE, dtype=dtype)
    return g(b, sq, h, d), g(b, sk, hk, d), g(b, sk, hk, d)


def private_args(opts, nheads):
    """The private functions' option arguments (causal, left, right, softcap, alibi_slopes) and the
    reference's keyword arguments for the same options."""
    left, right = opts.get("window", (-1, -1))
    alibi = torch.rand(nheads, device=DEVICE) * 0.5 if opts.get("alibi") else None
    causal, softcap = opts.get("causal", False), opts.get("softcap", 0.0)
    ref = dict(causal=causal, window_size=(left, right), softcap=softcap, alibi_slopes=alibi)
    return (causal, left, right, softcap, alibi), ref


def reference(q, k, v, do, **ref):
    """(fp32 oracle, PyTorch in the input dtype), each (out, lse, (dq, dk, dv))."""
    results = []
    for upcast in (True, False):
        q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attention_ref(q_, k_, v_, upcast=upcast, **ref)
        grads = torch.autograd.grad(out, (q_, k_, v_), do.to(out.dtype))
        results.append((out.detach(), lse, grads))
    return results


def nan_like(t):
    return torch.full_like(t, float("nan"))


@pytest.mark.parametrize("opts", OPTIONS)
def test_forward_backward_against_reference(opts):
    q, k, v = qkv()
    (causal, left, right, softcap, alibi), ref = private_args(opts, q.shape[2])
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(
        q, k, v, 0.0, None, causal, left, right, softcap, alibi, False
    )
    b, sq, h = q.shape[:3]
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and out.dtype == q.dtype
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    do = torch.randn_like(out)
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = reference(q, k, v, do, **ref)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert_close("lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)

    grads = [nan_like(t) for t in (q, k, v)]
    pointers = [g.data_ptr() for g in grads]
    softmax_d = fai._flash_attn_backward(
        do, q, k, v, out, lse, *grads, 0.0, None, causal, left, right, softcap, alibi, False, rng_state
    )
    assert [g.data_ptr() for g in grads] == pointers  # written in place
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)
    assert softmax_d.shape == (b, h, sq) and softmax_d.dtype == torch.float32
    ref_d = (do.double() * ref_out.double()).sum(-1).transpose(1, 2)
    low_d = (do * low_out).sum(-1).transpose(1, 2)
    assert_close("softmax_d", softmax_d, ref_d, low_d.float(), FWD_FACTOR)


def test_backward_into_views_of_one_packed_gradient():
    q, k, v = qkv((1, 24, 24, 2, 2, 16))
    out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    do = torch.randn_like(out)
    dqkv = torch.full((*q.shape[:2], 3, *q.shape[2:]), float("nan"), device=DEVICE, dtype=q.dtype)
    fai._flash_attn_backward(
        do, q, k, v, out, lse, *dqkv.unbind(2), 0.0, None, True, -1, -1, 0.0, None, True, rng_state
    )
    apart = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(do, q, k, v, out, lse, *apart, 0.0, None, True, -1, -1, 0.0, None, True, rng_state)
    assert torch.equal(dqkv, torch.stack(apart, dim=2))


def test_s_dmask_renormalized_by_its_key_block_is_the_softmax():
    """flash_attn's tests turn S_dmask into probabilities block by block (_get_block_size_n's width, each block's
    values exp(score - the running max)); flashattn2's one block spanning the row must give the softmax."""
    q, k, v = qkv()
    d, (sq, sk) = q.shape[-1], (q.shape[1], k.shape[1])
    _, lse, s_dmask, _ = fai._flash_attn_forward(q, k, v, 0.2, None, False, -1, -1, 0.0, None, True)
    width = fai._get_block_size_n(q.device, d, True, False)
    assert width >= 2**16 and fai.USE_TRITON_ROCM is False
    kv = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kv.float()) * d**-0.5
    blocks = scores.split(width, dim=-1)
    assert len(blocks) == 1
    running = torch.stack([b.amax(-1) for b in blocks], -1).flip(-1).cummax(-1).values.flip(-1).unbind(-1)
    unnorm = s_dmask[:, :, :sq, :sk].abs().float().split(width, dim=-1)
    probs = torch.cat([a * torch.exp(m - lse)[..., None] for a, m in zip(unnorm, running)], dim=-1)
    torch.testing.assert_close(probs, scores.softmax(-1), atol=2e-3, rtol=1e-2)
    with pytest.raises(ArgumentError, match="head_dim"):
        fai._get_block_size_n(q.device, 288, False, False)


def test_dropout_rng_state_replays_the_mask():
    p = 0.2
    q, k, v = qkv()
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, p, None, False, -1, -1, 0.0, None, True)
    assert rng_state.shape == (2,) and rng_state[1] == 0
    sq, sk = q.shape[1], k.shape[1]
    keep = s_dmask[:, :, :sq, :sk] >= 0
    do = torch.randn_like(out)
    ref = dict(dropout_mask=keep, dropout_p=p)
    (ref_out, _, ref_grads), (low_out, _, low_grads) = reference(q, k, v, do, **ref)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    softmax_d = fai._flash_attn_backward(
        do, q, k, v, out, lse, *grads, p, None, False, -1, -1, 0.0, None, False, rng_state
    )
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)
    # flash_attn's softmax_d carries the keep probability
    expected = (1 - p) * (do.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d, expected)
    with pytest.raises(ArgumentError, match="rng_state"):
        fai._flash_attn_backward(do, q, k, v, out, lse, *grads, p, None, False, -1, -1, 0.0, None, False, None)


def update_out_and_lse(out, lse, block_out, block_lse):
    """ring-flash-attention's merge (ring_flash_attn/utils.py): out fp32, lse (b, s, h, 1)."""
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(1, 2).unsqueeze(dim=-1)
    if out is None:
        return block_out, block_lse
    new_lse = lse + torch.log(1 + torch.exp(block_lse - lse))
    return torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out, new_lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_over_two_key_blocks(causal):
    """Rank 1 of a ring of two: its queries are the second half of the sequence; it sees key block
    0 without a mask and its own block 1 causally (ring-flash-attention's steps 1 and 0). Merged
    by the logsumexp, that is the attention over all keys (bottom-right causal alignment), and the
    per-block backwards with the merged out and lse sum to its gradients."""
    b, s, h, hk, d = (2, 256, 4, 2, 64) if ON_GPU else (1, 40, 2, 1, 32)
    q, k, v = qkv((b, s, 2 * s, h, hk, d))
    blocks = [(k[:, :s], v[:, :s], False), (k[:, s:], v[:, s:], causal)]
    out = lse = None
    for kb, vb, block_causal in blocks:
        block_out, block_lse, _, _ = fai._flash_attn_forward(
            q, kb, vb, 0.0, None, block_causal, -1, -1, 0.0, None, False
        )
        out, lse = update_out_and_lse(out, lse, block_out, block_lse)
    out = out.to(q.dtype)
    lse = lse.squeeze(dim=-1).transpose(1, 2)  # (b, h, s), not contiguous: as ring-flash-attention passes it
    do = torch.randn_like(out)
    (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = reference(q, k, v, do, causal=causal)
    assert_close("out", out, ref_out, low_out, FWD_FACTOR)
    assert_close("lse", lse, ref_lse, low_lse, FWD_FACTOR)

    dq = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    dks, dvs = [], []
    buffers = [torch.empty_like(q), torch.empty_like(blocks[0][0]), torch.empty_like(blocks[0][1])]
    for kb, vb, block_causal in blocks:
        fai._flash_attn_backward(do, q, kb, vb, out, lse, *buffers, 0.0, None, block_causal, -1, -1, 0.0, None, False)
        dq += buffers[0]
        dks.append(buffers[1].clone())
        dvs.append(buffers[2].clone())
    grads = (dq.to(q.dtype), torch.cat(dks, dim=1), torch.cat(dvs, dim=1))
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(name, g, r, lo.to(g.dtype), BWD_FACTOR)


@pytest.mark.parametrize("opts", OPTIONS[:2])
def test_varlen_forward_backward_against_each_sequence(opts):
    lengths_q, lengths_k = ([40, 0, 1, 17], [30, 9, 0, 17]) if not ON_GPU else ([700, 0, 1, 333], [500, 9, 0, 999])
    h, hk, d, extra = 2, 1, 32, 3
    g = lambda n, heads: torch.randn(n, heads, d, device=DEVICE, dtype=torch.float16)
    q, k, v = g(sum(lengths_q) + extra, h), g(sum(lengths_k), hk), g(sum(lengths_k), hk)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    (causal, left, right, softcap, alibi), ref = private_args(opts, h)
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    out, lse, s_dmask, rng_state = fai._flash_attn_varlen_forward(
        q, k, v, *varlen, 0.0, None, causal, zero_tensors=True
    )
    assert lse.shape == (h, q.shape[0]) and s_dmask.numel() == 0
    assert torch.all(out[-extra:] == 0) and torch.all(lse[:, -extra:] == float("-inf"))  # zero_tensors' fill
    do = torch.randn_like(out)
    grads = [nan_like(t) for t in (q, k, v)]
    softmax_d = fai._flash_attn_varlen_backward(
        do, q, k, v, out, lse, *grads, *varlen, 0.0, None, causal, left, right, softcap, alibi, False, rng_state
    )
    assert softmax_d.shape == (h, q.shape[0]) and torch.all(grads[0][-extra:] == 0)
    for i in range(len(lengths_q)):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if rq.stop == rq.start:
            continue
        (ref_out, ref_lse, ref_grads), (low_out, low_lse, low_grads) = reference(
            q[None, rq], k[None, rk], v[None, rk], do[None, rq], **ref
        )
        assert_close(f"out[{i}]", out[None, rq], ref_out, low_out, FWD_FACTOR)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isposinf(lse[None, :, rq]), torch.isposinf(ref_lse))
        assert_close(f"lse[{i}]", lse[None, :, rq][finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
        for name, gr, r, lo in zip(
            ("dq", "dk", "dv"), (grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]), ref_grads, low_grads
        ):
            assert_close(f"{name}[{i}]", gr, r, lo.to(gr.dtype), BWD_FACTOR)
        ref_d = (do[None, rq].double() * ref_out.double()).sum(-1).transpose(1, 2)
        low_d = (do[None, rq] * low_out).sum(-1).transpose(1, 2)
        assert_close(f"softmax_d[{i}]", softmax_d[None, :, rq], ref_d, low_d.float(), FWD_FACTOR)


def test_varlen_forward_with_block_table_matches_flash_attn_varlen_func():
    lengths = [20, 7]
    h, d, page = 2, 32, 16
    q = torch.randn(sum(lengths), h, d, device=DEVICE, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(6, page, h, d, device=DEVICE, dtype=torch.float16) for _ in range(2))
    block_table = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32, device=DEVICE)
    cu = cu_seqlens(lengths)
    out, lse, s_dmask, _ = fai._flash_attn_varlen_forward(
        q, k_cache, v_cache, cu, cu, 20, 20, 0.0, None, True, block_table=block_table
    )
    ref_out, ref_lse, _ = flashattn2.flash_attn_varlen_func(
        q, k_cache, v_cache, cu, cu, 20, 20, causal=True, return_attn_probs=True, block_table=block_table
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and s_dmask.numel() == 0


def test_unsupported_varlen_arguments_raise_not_implemented():
    q, k, v = (t.flatten(0, 1) for t in qkv((1, 8, 8, 2, 2, 16)))
    cu = cu_seqlens([8])
    used = torch.tensor([8], device=DEVICE, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.0, None, False, leftpad_k=used)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.1, None, False, seqused_k=used)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_forward_seqused_k(paged):
    """seqused_k (flash_attn's: sequence b uses its first seqused_k[b] keys), on packed keys and on pages: each
    sequence against the reference over those keys; bad seqused_k raises naming it."""
    lengths_q, lengths_k, used = [3, 1, 5], [20, 9, 16], [11, 9, 1]
    h, hk, d, page = 4, 2, 32, 8
    q = torch.randn(sum(lengths_q), h, d, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(sum(lengths_k), hk, d, device=DEVICE, dtype=torch.float16) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    keys, values, table = k, v, None
    if paged:  # each sequence's keys on its own pages, a page of another sequence between them
        pages_per_seq = 3
        keys, values = (
            torch.randn(len(used) * pages_per_seq, page, hk, d, device=DEVICE, dtype=torch.float16) for _ in range(2)
        )
        table = torch.arange(len(used) * pages_per_seq, dtype=torch.int32, device=DEVICE).view(pages_per_seq, -1).T
        table = table.contiguous()
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, keys, values, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.0, None, True, block_table=table,
        seqused_k=seqused,
    )  # fmt: skip
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b, n in enumerate(used):
        rq = slice(starts_q[b], starts_q[b + 1])
        if paged:
            kb, vb = (t[table[b].long()].flatten(0, 1)[:n] for t in (keys, values))
        else:
            kb, vb = k[starts_k[b] : starts_k[b] + n], v[starts_k[b] : starts_k[b] + n]
        ref, ref_lse = attention_ref(q[None, rq], kb[None], vb[None], causal=True)
        low, _ = attention_ref(q[None, rq], kb[None], vb[None], causal=True, upcast=False)
        assert_close(f"sequence {b}", out[None, rq], ref, low, FWD_FACTOR)
        torch.testing.assert_close(lse[:, rq], ref_lse[0].float(), atol=1e-3, rtol=0)  # (+inf: rows seeing no key)
    with pytest.raises(ArgumentTypeError, match="seqused_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 20, 0.0, None, True, seqused_k=seqused.long())
    with pytest.raises(ArgumentError, match="seqused_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 20, 0.0, None, True, seqused_k=seqused[:2])


def test_varlen_forward_num_splits():
    """num_splits (a speed knob in flash_attn) leaves the result as it is; a negative one is refused."""
    q, k, v = (t.flatten(0, 1) for t in qkv((1, 8, 8, 2, 2, 16)))
    cu = cu_seqlens([8])
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.0, None, False)
    split, split_lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.0, None, False, num_splits=4)
    assert torch.equal(out, split) and torch.equal(lse, split_lse)
    with pytest.raises(ArgumentError, match="num_splits"):
        fai._flash_attn_varlen_forward(q, k, v, cu, cu, 8, 8, 0.0, None, False, num_splits=-1)
    # flash_attn's paged path takes no split count
    pages, table = k.unflatten(0, (2, 4)), torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        fai._flash_attn_varlen_forward(q, pages, pages, cu, cu, 8, 8, 0.0, None, False, block_table=table, num_splits=2)


def test_bad_arguments():
    q, k, v = qkv((1, 8, 8, 2, 2, 16))
    fwd = lambda *a, return_softmax=False: fai._flash_attn_forward(
        *a, 0.0, None, False, -1, -1, 0.0, None, return_softmax
    )
    with pytest.raises(ArgumentError, match="return_softmax"):
        fwd(q, k, v, return_softmax=True)
    with pytest.raises(ArgumentTypeError, match="q"):
        fwd(q.tolist(), k, v)
    out, lse, _, rng_state = fwd(q, k, v)
    bwd = lambda dq, dk, dv, lse=lse: fai._flash_attn_backward(
        out, q, k, v, out, lse, dq, dk, dv, 0.0, None, False, -1, -1, 0.0, None, False, rng_state
    )
    with pytest.raises(ArgumentError, match="dk"):
        bwd(torch.empty_like(q), torch.empty_like(q[:, :4]), torch.empty_like(v))
    with pytest.raises(ArgumentTypeError, match="dv"):
        bwd(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v, dtype=torch.float64))
    with pytest.raises(ArgumentError, match="dq"):
        bwd(
            torch.empty(*q.shape[:2], q.shape[3], q.shape[2], device=DEVICE, dtype=q.dtype).transpose(-1, -2),
            torch.empty_like(k),
            torch.empty_like(v),
        )
    with pytest.raises(ArgumentError, match="softmax_lse"):
        bwd(None, None, None, lse=lse[:, :, :4])
    with pytest.raises(RuntimeError):  # flash_attn's callers catch RuntimeError
        bwd(None, None, None, lse=lse.half())
    assert bwd(None, None, None).shape == lse.shape  # None buffers are allocated (as in flash_attn)


def test_private_functions_refuse_float32_as_flash_attn():
    """flash_attn's private functions take fp16/bf16 only, and ring-attention libraries rely on it (their
    `.to(torch.float32)` accumulators alias a float32 input, so the next block's backward would overwrite the running
    sum: wrong gradients, no error): each refuses float32 with flash_attn's message, a RuntimeError as flash_attn's;
    the public functions keep float32."""
    q, k, v = (t.float() for t in qkv((1, 8, 8, 2, 2, 16)))
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    scalars = (0.0, None, False, -1, -1, 0.0, None)
    packed = [t[0] for t in (q, k, v)]
    calls = {
        "_flash_attn_forward": lambda: fai._flash_attn_forward(q, k, v, *scalars, False),
        "_flash_attn_varlen_forward": lambda: fai._flash_attn_varlen_forward(*packed, cu, cu, 8, 8, *scalars[:3]),
        "_flash_attn_backward": lambda: fai._flash_attn_backward(
            q, q, k, v, q, q.new_zeros(1, 2, 8), None, None, None, *scalars, False
        ),
        "_flash_attn_varlen_backward": lambda: fai._flash_attn_varlen_backward(
            packed[0], *packed, packed[0], q.new_zeros(2, 8), None, None, None, cu, cu, 8, 8, *scalars, False
        ),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"only support fp16 and bf16 data type \(q is torch.float32\)"):
            call()
    out = flashattn2.flash_attn_func(q, k, v)
    assert out.dtype == torch.float32 and not out.isnan().any()


def test_autograd_classes_apply_with_2_8_positional_arguments():
    q, k, v = (t.requires_grad_() for t in qkv((2, 12, 16, 2, 1, 16)))
    common = (0.0, None, True, (-1, -1), 0.0, None, True)  # deterministic: bitwise-comparable gradients
    out = fai.FlashAttnFunc.apply(q, k, v, *common, False, True)
    expected = flashattn2.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, expected)
    do = torch.randn_like(out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(expected, (q, k, v), do))
    )
    out, lse, s_dmask = fai.FlashAttnFunc.apply(q, k, v, *common, True, False)  # is_grad_enabled=False
    assert not out.requires_grad and lse.shape == (2, 2, 12) and s_dmask.numel() == 0

    kv = torch.stack((k, v), dim=2).detach().requires_grad_()
    assert torch.equal(fai.FlashAttnKVPackedFunc.apply(q, kv, *common, False, True), expected)
    qkv_ = torch.stack((q, q, q), dim=2).detach()
    assert torch.equal(
        fai.FlashAttnQKVPackedFunc.apply(qkv_, *common, False, True), flashattn2.flash_attn_func(q, q, q, causal=True)
    )

    cu_q, cu_k = cu_seqlens([12, 12]), cu_seqlens([16, 16])
    flat = lambda t: t.flatten(0, 1)
    varlen = (cu_q, cu_k, 12, 16)
    out = fai.FlashAttnVarlenFunc.apply(flat(q), flat(k), flat(v), *varlen, *common, False, None, True)
    assert torch.equal(out, flat(expected))
    out = fai.FlashAttnVarlenKVPackedFunc.apply(flat(q), flat(kv), *varlen, *common, False, True)
    assert torch.equal(out, flat(expected))
    out = fai.FlashAttnVarlenQKVPackedFunc.apply(flat(qkv_), cu_q, 12, *common, False, True)
    assert torch.equal(out, flat(flashattn2.flash_attn_func(q, q, q, causal=True)))


def test_install_as_flash_attn_stands_in_for_every_module():
    """In a fresh interpreter: every flash_attn module path a library imports resolves to flashattn2's, the version
    reads flash_attn's, a second call is a no-op, and a flash_attn imported before raises RuntimeError."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, types
        import flashattn2
        flashattn2.install_as_flash_attn()
        flashattn2.install_as_flash_attn()
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func
        from flash_attn.flash_attn_interface import _flash_attn_forward
        from flash_attn.bert_padding import unpad_input
        from flash_attn.layers.rotary import apply_rotary_emb
        from flash_attn.modules.mha import MHA
        from flash_attn.utils.generation import InferenceParams
        from flash_attn.flash_attn_interface import flash_attn_gpu
        import flash_attn_2_cuda
        import flashattn2.flash_attn_interface as fai
        assert flash_attn_gpu is flash_attn_2_cuda is flashattn2.flash_attn_gpu
        assert flash_attn.__version__ == flashattn2.FLASH_ATTN_VERSION == "2.8.3"
        assert flash_attn_func is flashattn2.flash_attn_func and _flash_attn_forward is fai._flash_attn_forward
        assert flash_attn.flash_attn_interface is fai and MHA is flashattn2.modules.mha.MHA
        del sys.modules["flash_attn"]
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")
        try:
            flashattn2.install_as_flash_attn()
        except RuntimeError as e:
            assert "already imported" in str(e)
        else:
            raise AssertionError("no RuntimeError over another flash_attn")
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_flash_attn_gpu_entry_points():
    """flash_attn_gpu (flash_attn's extension module as its interface calls it): each entry point with the C++
    positional arguments returns what the private function (or flash_attn_with_kvcache) returns, writes a given
    out / dq, dk, dv, and refuses a generator (RuntimeError with flash_attn's message)."""
    from flashattn2.flash_attn_interface import flash_attn_gpu as gpu

    q, k, v = qkv((2, 12, 12, 4, 2, 32))
    scale = 32**-0.5
    out, lse, _, rng = gpu.fwd(q, k, v, None, None, 0.0, scale, True, -1, -1, 0.0, False, None)
    want = fai._flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    given = torch.empty_like(q)
    assert gpu.fwd(q, k, v, given, None, 0.0, scale, True, -1, -1, 0.0, False, None)[0] is given
    assert torch.equal(given, out)
    dout = torch.randn_like(out)
    dq, dk, dv, softmax_d = gpu.bwd(
        dout, q, k, v, out, lse, None, None, None, None, 0.0, scale, True, -1, -1, 0.0, True, None, rng
    )  # fmt: skip (deterministic: bitwise comparable on a GPU)
    wq, wk, wv = (torch.empty_like(t) for t in (q, k, v))
    want_d = fai._flash_attn_backward(dout, q, k, v, out, lse, wq, wk, wv, 0.0, scale, True, -1, -1, 0.0, None, True)
    assert all(torch.equal(a, b) for a, b in ((dq, wq), (dk, wk), (dv, wv), (softmax_d, want_d)))
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    cu = cu_seqlens([12, 12])
    vout, vlse, _, _ = gpu.varlen_fwd(flat(q), flat(k), flat(v), None, cu, cu, None, None, None, None, 12, 12, 0.0,
                                      scale, False, True, -1, -1, 0.0, False, None, 0)  # fmt: skip
    assert torch.equal(vout, flat(out))
    vdq = gpu.varlen_bwd(flat(dout), flat(q), flat(k), flat(v), vout, vlse, None, None, None, cu, cu, None, 12, 12,
                         0.0, scale, False, True, -1, -1, 0.0, True, None, None)[0]  # fmt: skip
    assert torch.equal(vdq, flat(wq))
    seqlens = torch.tensor([12, 7], dtype=torch.int32, device=DEVICE)
    kv_out, kv_lse = gpu.fwd_kvcache(q[:, :1], k, v, None, None, seqlens, None, None, None, None, None, None, None,
                                     scale, True, -1, -1, 0.0, True, 0)  # fmt: skip
    want_out, want_lse = flashattn2.flash_attn_with_kvcache(
        q[:, :1], k, v, cache_seqlens=seqlens, softmax_scale=scale, causal=True, return_softmax_lse=True
    )
    assert torch.equal(kv_out, want_out) and torch.equal(kv_lse, want_lse)
    bad = torch.empty(1, device=DEVICE)
    match = r"generator` argument is no longer supported"
    with pytest.raises(RuntimeError, match=match):
        gpu.fwd(q, k, v, None, None, 0.0, scale, True, -1, -1, 0.0, False, bad)
    with pytest.raises(RuntimeError, match=match):
        gpu.bwd(q, q, k, v, q, lse, None, None, None, None, 0.0, scale, True, -1, -1, 0.0, False, bad, None)
    with pytest.raises(RuntimeError, match=match):
        gpu.varlen_fwd(flat(q), flat(k), flat(v), None, cu, cu, None, None, None, None, 12, 12, 0.0, scale, False,
                       True, -1, -1, 0.0, False, bad, 0)  # fmt: skip
    with pytest.raises(RuntimeError, match=match):
        gpu.varlen_bwd(flat(q), flat(q), flat(k), flat(v), flat(q), vlse, None, None, None, cu, cu, None, 12, 12,
                       0.0, scale, False, True, -1, -1, 0.0, False, bad, None)  # fmt: skip
