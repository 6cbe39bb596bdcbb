"""flashattn2 under flash_attn's module names, for libraries that import flash_attn themselves
(ring-flash-attention, yunchang/USP, older model code): install_as_flash_attn()."""

from __future__ import annotations

import sys
import types

# The flash_attn release whose API flashattn2 follows (names, parameters, returns): what `flash_attn.__version__`
# reports once installed. Libraries pick their call by it (yunchang passes `window_size=` below 2.6.3, the
# unpacked `window_size_left/right` from it on).
FLASH_ATTN_VERSION = "2.8.3"


def install_as_flash_attn() -> None:
    """Make `import flash_attn` and its modules (`flash_attn.flash_attn_interface`, `.bert_padding`,
    `.layers.rotary`, `.modules.mha`, `.utils.generation`, and the extension `flash_attn_2_cuda` unless one is
    imported) give flashattn2's. Call it before importing a library
    that imports flash_attn. `flash_attn` is a stand-in package holding flashattn2's public names with
    `__version__` FLASH_ATTN_VERSION; the submodules are flashattn2's own. Calling it again does nothing; a
    flash_attn imported before (the real one) raises RuntimeError: its users would keep it."""
    existing = sys.modules.get("flash_attn")
    if existing is not None:
        if getattr(existing, "__flashattn2__", False):
            return
        raise RuntimeError(
            f"install_as_flash_attn: a flash_attn is already imported ({getattr(existing, '__file__', existing)}): "
            "call it before anything imports flash_attn"
        )
    import flashattn2

    from . import bert_padding, flash_attn_interface, layers, modules, utils
    from .layers import rotary
    from .modules import mha
    from .utils import generation

    top = types.ModuleType("flash_attn", "flashattn2 standing in for flash_attn (flashattn2.install_as_flash_attn)")
    for name in flashattn2.__all__:
        if not name.startswith("__"):
            setattr(top, name, getattr(flashattn2, name))
    top.__version__ = FLASH_ATTN_VERSION
    top.__flashattn2__ = True
    top.__path__ = []  # a package: its submodules are found in sys.modules
    submodules = {
        "flash_attn_interface": flash_attn_interface,
        "bert_padding": bert_padding,
        "layers": layers,
        "layers.rotary": rotary,
        "modules": modules,
        "modules.mha": mha,
        "utils": utils,
        "utils.generation": generation,
    }
    for name, module in submodules.items():
        sys.modules[f"flash_attn.{name}"] = module
        if "." not in name:
            setattr(top, name, module)
    sys.modules["flash_attn"] = top
    # the raw extension module, which some libraries import by its own name
    sys.modules.setdefault("flash_attn_2_cuda", flash_attn_interface.flash_attn_gpu)
