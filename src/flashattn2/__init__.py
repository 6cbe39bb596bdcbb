"""flashattn2: FlashAttention-2 in Triton, a drop-in for flash_attn 2.x's functions."""

from .errors import ArgumentError, ArgumentTypeError
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
from .ops.checks import set_value_checks
from .ops.invariance import batch_invariant, set_batch_invariant
from .compat import FLASH_ATTN_VERSION, install_as_flash_attn
from .explain import explain

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
    "__version__",
]
