"""An attention call's rows as the kernels take them, worked out once per prepared call (ops.run.call) from its spec:
sizes, each tensor's (batch, row, head) strides, the outputs' shapes and strides, the score arguments and flags.
Every call of the spec launches with these; only its tensors are its own."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...kernels.constexprs import AttnScore, AttnShape, Mods
from ..request import spec as specs
from ..planning.geometry import Geometry, Varlen
from ..request.checks import E4M3, compute_dtype
from ..planning import out_dtype, window


class ForwardTensors(NamedTuple):
    """A forward's tensors by name, from the API, the op or an autograd Function down to a forward launch: q, k, v, a
    varlen call's sequences, ALiBi's slopes, the learnable sink, dropout's seed and an FP8 call's (q_descale,
    k_descale, v_descale) (each None where the call has none)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    descale: tuple | None = None


class BackwardTensors(NamedTuple):
    """A backward's tensors by name, from the autograd Function or the op down to a backward launch: the output's
    gradient and the lse's (None: none), the forward's inputs and outputs, where dq, dk, dv (and the sink's gradient)
    go, and a varlen call's sequences, ALiBi's slopes, the sink and dropout's seed (each None where the call has
    none)."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    dsink: torch.Tensor | None = None


def rows_strides(t: specs.TensorSpec, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements; varlen tensors have no batch stride."""
    s = t.stride
    return (0, s[0], s[1]) if varlen else (s[0], s[1], s[2])


def contiguous_strides(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


class Layout:
    """The static part of an attention call (see the module docstring)."""

    __slots__ = (
        "varlen", "batch", "nheads", "nheads_k", "head_dim", "head_dim_v", "max_seqlen_q", "max_seqlen_k", "arch",
        "dtype", "out_dtype", "device", "upcast", "q_strides", "k_strides", "v_strides", "out_shape", "out_strides",
        "lse_shape", "lse_strides", "shape", "score", "mods", "alibi_stride", "geometry", "out_spec", "grad_specs",
        "grad_dtype", "result_dtype", "descale_strides", "v_keys",
    )  # fmt: skip

    def __init__(self, spec: specs.AttentionSpec, softmax_scale: float):
        self.varlen = varlen = spec.varlen
        q, k, v = spec.q, spec.k, spec.v
        self.nheads, self.head_dim = q.shape[-2:]
        self.nheads_k, self.head_dim_v = k.shape[-2], v.shape[-1]
        if varlen:
            self.batch = spec.cu_seqlens_q.shape[0] - 1
            self.max_seqlen_q, self.max_seqlen_k = spec.max_seqlen_q, spec.max_seqlen_k
            self.lse_shape = (self.nheads, q.shape[0])
        else:
            self.batch, self.max_seqlen_q, self.max_seqlen_k = q.shape[0], q.shape[1], k.shape[1]
            self.lse_shape = (self.batch, self.nheads, q.shape[1])
        self.arch, self.dtype, self.device = spec.modes.arch, q.dtype, q.device
        self.out_dtype = out_dtype(q.dtype, self.arch)
        self.result_dtype = compute_dtype(q.dtype)  # the output's: q's, bf16 for FP8 inputs
        # the interpreter's bf16 arithmetic is wrong (TRITON-ON-CPU.md): it computes in fp32 (FP8 tiles: as
        # Path.FP8 says)
        fp8 = q.dtype == E4M3
        self.upcast = (self.arch == "interp" or q.dtype == torch.float32) and not fp8
        # FP8: the (batch, kv head) strides of q's, k's and v's descales (0, 0: none given, a 1 read in its place)
        self.descale_strides = None
        if fp8:
            self.descale_strides = specs.descale_strides(spec.descales[:3] if spec.descales else (None, None, None))
        self.q_strides, self.k_strides, self.v_strides = (rows_strides(t, varlen) for t in (q, k, v))
        self.v_keys = v.shape[0] if varlen else v.shape[1]  # v's key rows (a varlen pack's total)
        self.out_shape = (*q.shape[:-1], self.head_dim_v)
        out = contiguous_strides(self.out_shape)
        self.out_strides = (0, out[0], out[1]) if varlen else out[:3]
        lse = contiguous_strides(self.lse_shape)
        self.lse_strides = (0, lse[0]) if varlen else (lse[0], lse[1])
        self.shape = AttnShape(
            batch=self.batch,
            nheads=self.nheads,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            group_size=self.nheads // self.nheads_k,
        )
        w = window(spec.causal, *spec.window)
        # an unbounded edge: one that cannot bind; an edge past it binds no more (an Options' edge is any int), and
        # taken as it keeps the kernels' position sums within int32 (checks.MAX_POSITIONS)
        far = self.max_seqlen_q + self.max_seqlen_k
        softcap = float(spec.softcap)
        self.score = AttnScore(
            window_left=min(w.left, far) if w.left >= 0 else far,
            window_right=min(w.right, far) if w.right >= 0 else far,
            sm_scale=softmax_scale,
            softcap=softcap if softcap > 0 else 1.0,
            dropout_p=float(spec.dropout_p),
        )
        alibi = spec.alibi
        self.mods = Mods(w.causal, w.local, softcap > 0, alibi is not None, spec.dropout_p > 0, spec.sink is not None)
        self.alibi_stride = alibi.shape[-1] if alibi is not None and len(alibi.shape) == 2 else 0  # contiguous
        self.out_spec = specs.TensorSpec(torch.Size(self.out_shape), out, self.result_dtype, q.device)  # the forward's
        # the autograd Functions' gradients (ops.run.registry.Attention): contiguous, q's, k's and v's shapes; the
        # interpreter's in fp32 (its 16-bit stores truncate), which autograd casts to the inputs' dtype
        self.grad_dtype = torch.float32 if self.arch == "interp" else q.dtype
        self.grad_specs = tuple(
            specs.TensorSpec(t.shape, contiguous_strides(t.shape), self.grad_dtype, t.device) for t in (q, k, v)
        )
        lengths = Varlen(None, None, self.max_seqlen_q, self.max_seqlen_k) if varlen else None
        self.geometry = Geometry(
            self.batch, self.nheads, self.nheads_k, self.head_dim, self.max_seqlen_q, self.max_seqlen_k, lengths,
            self.head_dim_v,
        )  # fmt: skip
