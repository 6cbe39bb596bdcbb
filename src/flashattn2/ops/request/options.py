"""A call's options by name: Options from the API to the custom ops (whose parameters they are, in order)."""

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
        return tuple(getattr(self, name) for name in _FIELDS)  # (torch.compile traces it: no attrgetter)

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
        """The tensors among the options (TENSORS: what autograd saves)."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.seed

    def without_tensors(self) -> "Options":
        return self.with_tensors(None, None, None)

    def with_tensors(self, cu_seqlens_q, cu_seqlens_k, seed) -> "Options":
        """These options with other tensors (what autograd saved): a copy of the fields, these three replaced
        (dataclasses.replace would run __init__ again: a few microseconds a private forward)."""
        new = object.__new__(Options)
        new.__dict__.update(self.__dict__, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seed=seed)
        return new


_FIELDS = tuple(Options.__dataclass_fields__)
# the fields that hold tensors, which autograd saves: a new one stops the import here until tensors() and
# with_tensors() take it (kept in ctx.options instead, it would escape save_for_backward)
TENSORS = tuple(name for name, f in Options.__dataclass_fields__.items() if "Tensor" in str(f.type))
assert TENSORS == ("cu_seqlens_q", "cu_seqlens_k", "seed"), f"Options.tensors() and with_tensors() name {TENSORS}"
N_OP_ARGS = len(Options().op_args())
