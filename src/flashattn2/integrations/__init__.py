"""Other libraries on flashattn2's kernels: `integrations.transformers` (Hugging Face), `integrations.sdpa` (torch's
flash-attention kernel: SDPA's flash backend and varlen_attn; `integrations.sdpa_registration` registers it)."""
