"""@triton.jit code only: common helpers, forward, backward."""
