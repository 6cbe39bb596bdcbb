"""The name "flashattn2" in torch's flash-attention registry, put there by `import flashattn2` without importing
torch: registering only, as torch asks of providers (`torch.nn.attention.activate_flash_attention_impl("flashattn2")`
or `flashattn2.sdpa()` activates). This module imports neither torch nor triton: the implementation
(`integrations.sdpa`) is imported when torch activates it.

Where torch is already imported the name is registered at once; else a one-shot import hook registers it right
after torch executes `torch.nn.attention` (which `import torch` does), so that a user who imports flashattn2 first
finds the name there too. A torch without the registry (before its FA4 provider) is left alone: `import flashattn2` works,
and `flashattn2.sdpa()` says which torch it needs."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

NAME = "flashattn2"
MODULE = "torch.nn.attention"


def activate():
    """torch's register_fn: install flashattn2's kernels in the dispatcher (called by activate_flash_attention_impl;
    returns the handle torch keeps and removes on restore)."""
    from . import sdpa

    return sdpa.install()


def register(attention=None) -> bool:
    """Put NAME in torch's registry (idempotent: the registry is a dict); False on a torch without one."""
    attention = sys.modules.get(MODULE) if attention is None else attention
    register_impl = getattr(attention, "register_flash_attention_impl", None)
    if register_impl is None:
        return False
    register_impl(NAME, register_fn=activate)
    return True


class _AfterTorchAttention(importlib.abc.MetaPathFinder):
    """Registers NAME once torch.nn.attention has executed, then leaves sys.meta_path."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            register(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object: no other module is touched
        return spec


def register_on_import() -> None:
    """`import flashattn2`'s step: register now if torch.nn.attention is loaded, else when torch loads it."""
    if MODULE in sys.modules:
        register()
    elif not any(isinstance(finder, _AfterTorchAttention) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchAttention())
