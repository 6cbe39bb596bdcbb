"""flash_attn.utils' pieces that the modules' callers use (`utils.generation.InferenceParams`)."""
