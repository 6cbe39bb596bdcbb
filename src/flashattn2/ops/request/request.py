"""Requests: a public function's arguments, named once.

A public function keeps flash_attn's signature and makes one frozen request from its arguments at its door (in the
signature's order: tests/test_signatures.py holds the fields to it); everything after the door -- the checks, the
spec, the prepared call, the custom op and the run -- takes the request and reads its fields by name. A new keyword
is a field here, a parameter of the public function and the code that reads it; the custom op's schema follows
(op_schema).

The custom op takes a request's fields in their order, each as itself but where the dispatcher cannot carry it or
the op needs it resolved (_OP_FORMS): window_size as (window_left, window_right), an int-or-tensor cache_seqlens as
(cache_seqlens, cache_seqlen_int), softmax_scale as the float it resolves to; an output choice
(return_softmax_lse) is not carried (the op returns every output).
"""

from __future__ import annotations

import inspect
import typing
from typing import NamedTuple, Optional, Union

import torch

Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


# (a property both requests share: a NamedTuple takes no mixin)
_DESCALES = property(
    lambda r: (r.q_descale, r.k_descale, r.v_descale), doc="(q_descale, k_descale, v_descale): FP8's, FA3's (None: 1)"
)


class KVCacheRequest(NamedTuple):
    """flash_attn_with_kvcache's arguments (api.flash_attn_with_kvcache says what each means)."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    k: OptTensor = None
    v: OptTensor = None
    rotary_cos: OptTensor = None
    rotary_sin: OptTensor = None
    cache_seqlens: Union[torch.Tensor, int, None] = None
    cache_batch_idx: OptTensor = None
    cache_leftpad: OptTensor = None
    block_table: OptTensor = None
    softmax_scale: Optional[float] = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    rotary_interleaved: bool = True
    alibi_slopes: OptTensor = None
    num_splits: int = 0
    return_softmax_lse: bool = False
    learnable_sink: OptTensor = None
    q_descale: OptTensor = None
    k_descale: OptTensor = None
    v_descale: OptTensor = None

    descales = _DESCALES

    @property
    def capacity(self) -> int:
        """The positions a sequence's cache holds: its pages' (max_num_blocks_per_seq * page_size), or the rows'."""
        block_table, k_cache = self.block_table, self.k_cache
        return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


class AttentionRequest(NamedTuple):
    """flash_attn_varlen_func's arguments (api.flash_attn_varlen_func says what each means); flash_attn_func's and
    the packed forms' (q, k and v views of the packed tensor) are the same without the sequences (cu_seqlens None,
    the max_seqlens 0) and block_table. The ops and the private functions make one from their Options (from_options:
    the window's edges as given)."""

    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens_q: OptTensor = None
    cu_seqlens_k: OptTensor = None
    max_seqlen_q: Union[int, torch.Tensor] = 0
    max_seqlen_k: Union[int, torch.Tensor] = 0
    dropout_p: float = 0.0
    softmax_scale: Optional[float] = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: OptTensor = None
    deterministic: bool = False
    return_attn_probs: bool = False
    block_table: OptTensor = None
    learnable_sink: OptTensor = None
    q_descale: OptTensor = None
    k_descale: OptTensor = None
    v_descale: OptTensor = None

    descales = _DESCALES


def with_qkv(r: AttentionRequest, q, k, v) -> AttentionRequest:
    """The attention request with other q, k, v (its first three fields: tests/test_request.py), what a copy for the
    kernels makes (NamedTuple._replace costs microseconds)."""
    return _new(AttentionRequest, (q, k, v, *r[3:]))


_new = tuple.__new__

# the fields a dense door (flash_attn_func and its packed forms) does not have: it makes its request without them
VARLEN_ONLY = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_table")


# ---- the custom ops' form of a request -----------------------------------------------------------------------------


def _scale(r, value) -> tuple:
    return (float(r.q.shape[-1] ** -0.5 if value is None else value),)


def _window(r, value) -> tuple:
    return tuple(int(w) for w in value)


def _seqlens(r, value) -> tuple:
    """A tensor travels as itself; an int (or None: the whole cache) as the int, with no tensor."""
    if isinstance(value, torch.Tensor):
        return value, 0
    return None, r.capacity if value is None else int(value)


# field -> (the op's parameters for it (name, type), from the request's value, back to the field's value)
_OP_FORMS = {
    "softmax_scale": ((("softmax_scale", float),), _scale, lambda scale: scale),
    "window_size": ((("window_left", int), ("window_right", int)), _window, lambda left, right: (left, right)),
    "cache_seqlens": (
        (("cache_seqlens", OptTensor), ("cache_seqlen_int", int)),
        _seqlens,
        lambda tensor, n: n if tensor is None else tensor,
    ),
    "return_softmax_lse": ((), lambda r, value: (), lambda: True),
    "return_attn_probs": ((), lambda r, value: (), lambda: True),
    "max_seqlen_q": ((("max_seqlen_q", int),), lambda r, value: (int(value),), lambda n: n),
    "max_seqlen_k": ((("max_seqlen_k", int),), lambda r, value: (int(value),), lambda n: n),
}
_SCALARS = (bool, int, float)


def _forms(request_type) -> list[tuple[str, tuple, object, object]]:
    """(field, the op's (name, type) parameters, encode, decode) for each field of a request type, in order."""
    hints = typing.get_type_hints(request_type)
    forms = []
    for field in request_type._fields:
        if field in _OP_FORMS:
            params, encode, decode = _OP_FORMS[field]
        else:
            ty = hints[field]
            cast = ty if ty in _SCALARS else None
            params, decode = ((field, ty),), lambda value: value
            encode = (lambda r, value, cast=cast: (cast(value),)) if cast else (lambda r, value: (value,))
        forms.append((field, params, encode, decode))
    return forms


_FORMS = {KVCacheRequest: _forms(KVCacheRequest), AttentionRequest: _forms(AttentionRequest)}


def op_schema(request_type, result, optional: tuple[str, ...] = ()) -> inspect.Signature:
    """The custom op's signature: the request's fields in their op form; the parameters named in `optional` (added
    to the op after the others) default to None."""
    P = inspect.Parameter
    params = [
        P(name, P.POSITIONAL_OR_KEYWORD, annotation=ty, default=None if name in optional else P.empty)
        for _, form, _, _ in _FORMS[request_type]
        for name, ty in form
    ]
    return inspect.Signature(params, return_annotation=result)


def op_args(request) -> tuple:
    """A request's fields as the custom op takes them (op_schema's order)."""
    return tuple(
        value for (field, _, encode, _), item in zip(_FORMS[type(request)], request) for value in encode(request, item)
    )


def from_op_args(request_type, args: tuple):
    """The request a custom op's arguments (op_args') stand for (a trailing optional parameter may be absent)."""
    values, i = [], 0
    for _, form, _, decode in _FORMS[request_type]:
        n = len(form)
        part = args[i : i + n]
        values.append(decode(*part, *(None,) * (n - len(part))))
        i += n
    return request_type._make(values)
