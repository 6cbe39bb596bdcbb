"""flash_attn.modules' attention layers on flashattn2's kernels (`modules.mha`)."""
