"""flash_attn's autograd classes (FlashAttnFunc and the others) as flash_attn_interface exports them: `.apply` with
flash_attn 2.8's positional arguments runs the public function, whose autograd.Function is flashattn2's (they are not
torch.autograd.Function subclasses)."""

from __future__ import annotations

import contextlib
import inspect

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


def _autograd_class(name: str, fn) -> type:
    """flash_attn's class `name`, whose `.apply` takes fn's positional parameters (all required; flash_attn calls
    return_attn_probs return_softmax) then is_grad_enabled, 2.8's last argument (left out as before 2.7), and runs
    fn under that grad mode."""
    P = inspect.Parameter
    params = [
        p.replace(name="return_softmax" if p.name == "return_attn_probs" else p.name, default=P.empty)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is P.POSITIONAL_OR_KEYWORD
    ]
    signature = inspect.Signature([*params, P("is_grad_enabled", P.POSITIONAL_OR_KEYWORD, default=None)])
    n = len(params)

    def apply(*args, **kwargs):
        if kwargs or not n <= len(args) <= n + 1:
            args = signature.bind(*args, **kwargs).args  # raises TypeError naming what is missing or extra
        with _grad_mode(args[n] if len(args) > n else None):
            return fn(*args[:n])

    apply.__signature__ = signature
    apply.__qualname__ = f"{name}.apply"
    doc = f"flash_attn's {name}: `.apply` takes its positional arguments and runs {fn.__name__}."
    return type(name, (), {"__doc__": doc, "__module__": __name__, "apply": staticmethod(apply)})


FlashAttnFunc = _autograd_class("FlashAttnFunc", flash_attn_func)
FlashAttnQKVPackedFunc = _autograd_class("FlashAttnQKVPackedFunc", flash_attn_qkvpacked_func)
FlashAttnKVPackedFunc = _autograd_class("FlashAttnKVPackedFunc", flash_attn_kvpacked_func)
FlashAttnVarlenFunc = _autograd_class("FlashAttnVarlenFunc", flash_attn_varlen_func)
FlashAttnVarlenQKVPackedFunc = _autograd_class("FlashAttnVarlenQKVPackedFunc", flash_attn_varlen_qkvpacked_func)
FlashAttnVarlenKVPackedFunc = _autograd_class("FlashAttnVarlenKVPackedFunc", flash_attn_varlen_kvpacked_func)
