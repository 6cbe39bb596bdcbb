"""Models built on flashattn2's modules (`models.gpt`: the example GPT and the end-to-end bench's)."""
