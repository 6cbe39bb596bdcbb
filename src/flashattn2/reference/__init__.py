"""Plain PyTorch attention used as the oracle, and the tolerance rule. Never imports the kernels."""

from .attention import attention_ref, causal_mask, local_mask
from .tolerance import BWD_FACTOR, FWD_FACTOR

__all__ = ["attention_ref", "causal_mask", "local_mask", "FWD_FACTOR", "BWD_FACTOR"]
