"""flash_attn.layers' counterparts: rotary embeddings."""
