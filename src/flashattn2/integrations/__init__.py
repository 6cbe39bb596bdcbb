"""Other libraries on flashattn2's kernels: `integrations.transformers` (Hugging Face)."""
