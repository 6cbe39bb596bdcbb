"""Removing and restoring padding, with flash_attn.bert_padding's functions and signatures.

Padded `(batch, seqlen, ...)` activations become `(total_tokens, ...)` plus `cu_seqlens` (int32,
`(batch + 1,)`, the cumulative sequence lengths the varlen functions take) and back. Pure
PyTorch; the gather and scatter have their own autograd so the backward is a scatter/gather too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class IndexFirstAxis(torch.autograd.Function):
    """input[indices] along the first axis; the backward scatters into zeros."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input.reshape(input.shape[0], -1)[indices].reshape(-1, *input.shape[1:])

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        flat = grad_output.reshape(grad_output.shape[0], -1)
        grad_input = flat.new_zeros(ctx.first_axis_dim, flat.shape[1])
        grad_input[indices] = flat
        return grad_input.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


index_first_axis = IndexFirstAxis.apply


class IndexPutFirstAxis(torch.autograd.Function):
    """A (first_axis_dim, ...) tensor of zeros with `values` written at `indices`."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        output = values.new_zeros(first_axis_dim, *values.shape[1:])
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


index_put_first_axis = IndexPutFirstAxis.apply


class IndexFirstAxisResidual(torch.autograd.Function):
    """index_first_axis that also returns its (detached) input, for callers that keep a residual."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        grad_input = (
            grad_residual.clone()
            if grad_residual is not None
            else grad_output.new_zeros(ctx.first_axis_dim, *grad_output.shape[1:])
        )
        grad_input.index_add_(0, indices, grad_output)
        return grad_input, None


index_first_axis_residual = IndexFirstAxisResidual.apply


def _cu_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Remove padding.

    Arguments:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), bool or int, 1 for tokens in use, 0 for padding.
        unused_mask: optional (batch, seqlen), 1 for tokens that are allocated but not in use
            (they are kept in the output and counted in cu_seqlens, but not in seqused).
    Returns:
        hidden_states: (total_nnz, ...), the kept tokens in batch-major order.
        indices: (total_nnz,), their positions in the flattened (batch * seqlen) input.
        cu_seqlens: (batch + 1,) int32, cumulative lengths of the kept tokens per sequence.
        max_seqlen_in_batch: int.
        seqused: (batch,) int32, the number of tokens in use per sequence.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Remove padding where each row of the batch packs several sequences.

    attention_mask_in_length: (batch, seqlen); row b lists the lengths of the sequences packed
    into row b, then zeros, e.g. [[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0]] for two rows holding
    sequences of lengths 2 and 3, and 3 and 2. Returns (hidden_states, indices, cu_seqlens,
    max_seqlen_in_batch), with one cu_seqlens entry per packed sequence.
    """
    lengths_per_row = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    positions = torch.arange(seqlen, device=attention_mask_in_length.device)
    in_use = positions[None, :] < lengths_per_row[:, None]
    flat_lengths = attention_mask_in_length.flatten()
    seqlens = flat_lengths[flat_lengths != 0].to(torch.int32)
    indices = torch.nonzero(in_use.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """Restore padding: (total_nnz, ...) -> (batch, seqlen, ...), zeros where nothing was kept."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])
