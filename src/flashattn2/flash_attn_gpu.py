"""flash_attn's raw extension entry points (flash_attn 2.8's `flash_attn_2_cuda`, imported by its interface as
`flash_attn_gpu`) on flashattn2: `from flash_attn.flash_attn_interface import flash_attn_gpu` then
`flash_attn_gpu.fwd(...)` as libraries that call the extension directly do. Each takes the C++ functions' positional
arguments in their order and returns their list, through flashattn2's private functions (flash_attn_interface) and
flash_attn_with_kvcache:

    fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, generator)                              -> [out, softmax_lse, S_dmask, rng_state]
    varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
        max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
        window_size_right, softcap, return_softmax, generator, num_splits=0) -> [out, softmax_lse, S_dmask, rng_state]
    bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, generator, rng_state) -> [dq, dk, dv, softmax_d]
    varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
        max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right, softcap,
        deterministic, generator, rng_state)                            -> [dq, dk, dv, softmax_d]
    fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
        is_rotary_interleaved, num_splits)                               -> [out, softmax_lse]

`out` (and the backward's dq, dk, dv), given, receive the result and are returned (checked: the result's shape, dtype
and device); None allocates. `generator` is the slot flash_attn keeps for its old RNG argument: anything but None
raises RuntimeError, as flash_attn's check. softmax_lse and softmax_d are the private functions' (module
flash_attn_interface): (batch, nheads, seqlen_q), or (nheads, total_q), where flash_attn's C++ pads the rows (to 128
per sequence); the values callers read are the same.
"""

from __future__ import annotations

import torch

from .api import flash_attn_with_kvcache
from .errors import ArgumentError
from .flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _grad_buffers,
    _like,
)


def _no_generator(generator) -> None:
    if generator is not None:
        raise ArgumentError(
            "flash-attn: the RNG `generator` argument is no longer supported and must be None; dropout (when "
            "enabled) uses the default generator"
        )


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """The result in the caller's preallocated `out` (returned; its shape, dtype and device the result's), or as it
    is."""
    if out is None:
        return result
    _like("out", out, result.shape, result.dtype, result.device)
    out.copy_(result)
    return out


def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, generator):  # fmt: skip
    _no_generator(generator)
    o, lse, s_dmask, rng_state = _flash_attn_forward(
        q, k, v, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    )  # fmt: skip
    return [_into(out, o), lse, s_dmask, rng_state]


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, generator, num_splits=0):  # fmt: skip
    _no_generator(generator)
    o, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
        zero_tensors, num_splits,
    )  # fmt: skip
    return [_into(out, o), lse, s_dmask, rng_state]


def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, generator, rng_state):  # fmt: skip
    _no_generator(generator)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)  # (the caller's, or new ones returned)
    softmax_d = _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale, is_causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip
    return [dq, dk, dv, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
               max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
               softcap, deterministic, generator, rng_state):  # fmt: skip
    _no_generator(generator)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)  # (the caller's, or new ones returned)
    softmax_d = _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        deterministic, rng_state, zero_tensors,
    )  # fmt: skip
    return [dq, dk, dv, softmax_d]


def fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                is_rotary_interleaved, num_splits):  # fmt: skip
    o, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, is_causal, (window_size_left, window_size_right), softcap, is_rotary_interleaved,
        alibi_slopes, num_splits, return_softmax_lse=True,
    )  # fmt: skip
    return [_into(out, o), lse]
