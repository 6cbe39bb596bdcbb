"""flashattn2.bert_padding: unpad/pad round trips, cu_seqlens, gradients."""

import torch

from cases import randn
from flashattn2 import bert_padding as bp


def random_mask(batch, seqlen):
    lengths = torch.randint(0, seqlen + 1, (batch,))
    lengths[0] = seqlen  # one full row
    return torch.arange(seqlen)[None, :] < lengths[:, None], lengths


def test_unpad_pad_round_trip_and_gradients():
    batch, seqlen = 4, 13
    mask, lengths = random_mask(batch, seqlen)
    x = randn(batch, seqlen, 3, 5, dtype=torch.float32, requires_grad=True)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = bp.unpad_input(x, mask.to(x.device))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert max_seqlen == int(lengths.max()) and seqused.tolist() == lengths.tolist()
    assert torch.equal(x_unpad, x[mask.to(x.device)])
    back = bp.pad_input(x_unpad, indices, batch, seqlen)
    assert torch.equal(back, x * mask.to(x.device)[:, :, None, None])
    grad = torch.randn_like(back)
    (gx,) = torch.autograd.grad(back, x, grad)
    assert torch.equal(gx, grad * mask.to(x.device)[:, :, None, None])


def test_unused_mask_counts_in_cu_seqlens_not_in_seqused():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    x = randn(2, 4, 6, dtype=torch.float32)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = bp.unpad_input(x, mask.to(x.device), unused.to(x.device))
    assert cu_seqlens.tolist() == [0, 3, 6] and seqused.tolist() == [2, 1] and max_seqlen == 3
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and x_unpad.shape == (6, 6)


def test_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = randn(3, 6, 4, dtype=torch.float32, requires_grad=True)
    x_unpad, indices, cu_seqlens, max_seqlen = bp.unpad_input_for_concatenated_sequences(x, lengths.to(x.device))
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(x_unpad, x.reshape(18, 4)[indices])


def test_index_first_axis_residual():
    x = randn(7, 3, dtype=torch.float32, requires_grad=True)
    idx = torch.tensor([5, 0, 2], device=x.device)
    out, residual = bp.index_first_axis_residual(x, idx)
    assert torch.equal(out, x[idx]) and torch.equal(residual, x.detach())
    go, gr = torch.randn_like(out), torch.randn_like(residual)
    (gx,) = torch.autograd.grad((out, residual), x, (go, gr))
    expected = gr.clone()
    expected[idx] += go
    assert torch.allclose(gx, expected)
