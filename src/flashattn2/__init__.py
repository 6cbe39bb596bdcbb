"""flashattn2: FlashAttention-2 in Triton, a drop-in for flash_attn 2.x's functions.

The public names are imported on first use (PEP 562): `import flashattn2` alone imports neither torch nor triton,
so `python -m flashattn2 --help` answers at once; the first name used (`flashattn2.flash_attn_func`,
`from flashattn2 import ...`) imports them all, as an eager package would have.

Importing the package also registers "flashattn2" in torch's flash-attention registry, without importing torch
(integrations.sdpa_registration): `torch.nn.attention.activate_flash_attention_impl("flashattn2")` or
`with flashattn2.sdpa():` then runs SDPA's flash backend on flashattn2."""

from typing import TYPE_CHECKING

from .errors import ArgumentError, ArgumentTypeError
from .integrations import sdpa_registration

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "set_kvcache_checks",
    "set_value_checks",
    "batch_invariant",
    "set_batch_invariant",
    "ArgumentError",
    "ArgumentTypeError",
    "FLASH_ATTN_VERSION",
    "install_as_flash_attn",
    "explain",
    "sdpa",
    "sdpa_fallbacks",
    "__version__",
]

sdpa_registration.register_on_import()

if TYPE_CHECKING:  # for type checkers and editors: the names __getattr__ brings
    from .api import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache,
        set_kvcache_checks,
    )
    from .compat import FLASH_ATTN_VERSION, install_as_flash_attn
    from .explain import explain
    from .integrations.sdpa import fallbacks as sdpa_fallbacks
    from .integrations.sdpa import sdpa
    from .ops.request.checks import set_value_checks
    from .ops.request.invariance import batch_invariant, set_batch_invariant


def _load() -> None:
    """Import the public names into the package, all at once (the modules an eager __init__ imported)."""
    import importlib

    # import_module, not `from . import api`: that asks this module for the attribute first (__getattr__ again)
    api, compat, checks, invariance, explain, sdpa = (
        importlib.import_module(name, __name__)
        for name in (
            ".api",
            ".compat",
            ".ops.request.checks",
            ".ops.request.invariance",
            ".explain",
            ".integrations.sdpa",
        )
    )
    names = {name: getattr(api, name) for name in __all__ if name.startswith("flash_attn_")}
    names.update(
        set_kvcache_checks=api.set_kvcache_checks,
        set_value_checks=checks.set_value_checks,
        batch_invariant=invariance.batch_invariant,
        set_batch_invariant=invariance.set_batch_invariant,
        FLASH_ATTN_VERSION=compat.FLASH_ATTN_VERSION,
        install_as_flash_attn=compat.install_as_flash_attn,
        explain=explain.explain,  # the function, not the submodule of the same name its import bound here
        sdpa=sdpa.sdpa,
        sdpa_fallbacks=sdpa.fallbacks,
    )
    globals().update(names)


def __getattr__(name: str):
    # a public name, or a submodule the eager import bound (flashattn2.ops, .api, .compat, .kernels)
    if not name.startswith("__"):
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
