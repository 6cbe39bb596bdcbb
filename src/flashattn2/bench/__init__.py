"""`python -m flashattn2 bench`: FlashAttention-2's kernel figure (and more), measured beside the
peers in one run; correctness is checked before anything is timed."""
