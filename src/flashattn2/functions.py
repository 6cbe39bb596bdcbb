"""flash_attn's autograd classes (FlashAttnFunc and the others) as flash_attn_interface exports them: `.apply` with
flash_attn 2.8's positional arguments runs the public function, whose autograd.Function is flashattn2's (they are not
torch.autograd.Function subclasses)."""

from __future__ import annotations

import contextlib

import torch

from .api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)


def _grad_mode(is_grad_enabled):
    """flash_attn 2.8's Functions take torch.is_grad_enabled() as their last argument and save
    nothing for the backward when it is False: here that call runs under no_grad."""
    return torch.no_grad() if is_grad_enabled is not None and not is_grad_enabled else contextlib.nullcontext()


class FlashAttnFunc:
    """flash_attn's FlashAttnFunc: `.apply` takes its positional arguments and runs
    flash_attn_func. (is_grad_enabled, 2.8's last argument, may be left out as before 2.7.)"""

    @staticmethod
    def apply(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_func(
                q,
                k,
                v,
                dropout_p,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                deterministic,
                return_softmax,
            )


class FlashAttnQKVPackedFunc:
    """flash_attn's FlashAttnQKVPackedFunc: `.apply` runs flash_attn_qkvpacked_func."""

    @staticmethod
    def apply(
        qkv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_qkvpacked_func(
                qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_softmax
            )


class FlashAttnKVPackedFunc:
    """flash_attn's FlashAttnKVPackedFunc: `.apply` runs flash_attn_kvpacked_func."""

    @staticmethod
    def apply(
        q,
        kv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_kvpacked_func(
                q,
                kv,
                dropout_p,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                deterministic,
                return_softmax,
            )


class FlashAttnVarlenFunc:
    """flash_attn's FlashAttnVarlenFunc: `.apply` runs flash_attn_varlen_func."""

    @staticmethod
    def apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        block_table,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                deterministic,
                return_softmax,
                block_table,
            )


class FlashAttnVarlenQKVPackedFunc:
    """flash_attn's FlashAttnVarlenQKVPackedFunc: `.apply` runs flash_attn_varlen_qkvpacked_func."""

    @staticmethod
    def apply(
        qkv,
        cu_seqlens,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_varlen_qkvpacked_func(
                qkv,
                cu_seqlens,
                max_seqlen,
                dropout_p,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                deterministic,
                return_softmax,
            )


class FlashAttnVarlenKVPackedFunc:
    """flash_attn's FlashAttnVarlenKVPackedFunc: `.apply` runs flash_attn_varlen_kvpacked_func."""

    @staticmethod
    def apply(
        q,
        kv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled=None,
    ):
        with _grad_mode(is_grad_enabled):
            return flash_attn_varlen_kvpacked_func(
                q,
                kv,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                deterministic,
                return_softmax,
            )
