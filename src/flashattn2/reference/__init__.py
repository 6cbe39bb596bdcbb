"""Plain PyTorch attention used as the oracle. Never imports the kernels."""
from .attention import attention_ref, causal_mask

__all__ = ["attention_ref", "causal_mask"]
