"""A call's options by name: Options from the API to the custom ops (whose parameters they are, in order), and
ScoreMods, how the kernels form and mask the scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import AttentionRequest

_new = tuple.__new__


@dataclass(frozen=True)
class Options:
    """flashattn2::fwd's (and bwd's) arguments between v and alibi_slopes: the sequences of a varlen call
    (cu_seqlens None: dense), dropout with its Philox seed, the scale and the score modifiers. op_args() gives
    them in the ops' order."""

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,): drawn from torch's generator with dropout
    softmax_scale: float = 1.0
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def op_args(self) -> tuple:
        return (
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.dropout_p,
            self.seed,
            self.softmax_scale,
            self.causal,
            self.window_left,
            self.window_right,
            self.softcap,
        )

    def request(self, q, k, v, alibi_slopes, learnable_sink, deterministic: bool = False) -> AttentionRequest:
        """The attention request these options stand for (their window's edges as they are:
        ops.run.call.from_options)."""
        return _new(  # (in the request's fields' order: keywords would cost a microsecond a ring block)
            AttentionRequest,
            (q, k, v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k, self.dropout_p,
             self.softmax_scale, self.causal, (self.window_left, self.window_right), self.softcap, alibi_slopes,
             deterministic, False, None, learnable_sink, None, None, None),
        )  # fmt: skip

    def tensors(self) -> tuple:
        """The tensors among the options (what autograd saves): cu_seqlens_q, cu_seqlens_k, seed."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.seed

    def without_tensors(self) -> "Options":
        return Options(
            None,
            None,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.dropout_p,
            None,
            self.softmax_scale,
            self.causal,
            self.window_left,
            self.window_right,
            self.softcap,
        )

    def with_tensors(self, cu_seqlens_q, cu_seqlens_k, seed) -> "Options":
        return Options(
            cu_seqlens_q,
            cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.dropout_p,
            seed,
            self.softmax_scale,
            self.causal,
            self.window_left,
            self.window_right,
            self.softcap,
        )


N_OP_ARGS = len(Options().op_args())


@dataclass(frozen=True)
class ScoreMods:
    """How scores are formed and masked, resolved from flash_attn's arguments.

    causal=True sets the window's right edge to 0 (flash_attn's rule); a window that is only
    that becomes the CAUSAL path, any other finite edge the LOCAL path, where an unbounded edge
    is replaced by one that cannot bind (seqlen_q + seqlen_k).
    """

    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # int64 (1,): the Philox seed, drawn from torch's generator
    # float32 (nheads,): one learnable logit per query head in every row's softmax denominator, with no value
    sinks: torch.Tensor | None = None

    def kernel_args(self, seqlen_q: int, seqlen_k: int, like: torch.Tensor):
        """(pointer/runtime arguments, constexpr flags) for the kernels."""
        left, right = self.window_left, 0 if self.causal else self.window_right
        causal = left < 0 and right == 0
        local = not causal and (left >= 0 or right >= 0)
        far = seqlen_q + seqlen_k
        alibi = self.alibi_slopes
        runtime = dict(
            Alibi=alibi if alibi is not None else like,
            stride_alibi_b=alibi.stride(0) if alibi is not None and alibi.dim() == 2 else 0,
            window_left=left if left >= 0 else far,
            window_right=right if right >= 0 else far,
            softcap=self.softcap if self.softcap > 0 else 1.0,
            Seed=self.seed if self.dropout_p > 0 else like,
            dropout_p=self.dropout_p,
            Sinks=self.sinks if self.sinks is not None else like,
        )
        flags = dict(
            CAUSAL=causal,
            LOCAL=local,
            SOFTCAP=self.softcap > 0,
            ALIBI=alibi is not None,
            DROPOUT=self.dropout_p > 0,
            SINK=self.sinks is not None,
        )
        return runtime, flags

    @staticmethod
    def only_causal(flags: dict) -> bool:
        """Whether kernel_args' flags ask for nothing beyond a causal mask and a sink (what the Gluon kernels do)."""
        return not (flags["LOCAL"] or flags["SOFTCAP"] or flags["ALIBI"] or flags["DROPOUT"])
