"""flash_attn's tolerance rule, in one place for the tests, the benchmark's gate and the tools:
our max error against a high-precision reference may be at most `factor` times the error of
PyTorch doing the same math in the input dtype, plus a small floor."""

from __future__ import annotations

import math

import torch

FWD_FACTOR = 2.0  # forward outputs (out, lse)
BWD_FACTOR = 3.0  # gradients


def floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Where PyTorch's own math is exact (one visible key: P = 1, dK = 0), ours still rounds:
    allow one unit in the last place of the largest reference value (for fp32, 1e-5 relative)."""
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps) * scale


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check(ours: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, factor: float) -> tuple[bool, float, float]:
    """(passes, our error, the bound). ours/low in the input dtype, ref the fp32/fp64 oracle.
    A NaN anywhere in ours fails, and so does a baseline that is not finite."""
    err = max_error(ours, ref)
    bound = factor * max_error(low, ref) + floor(ours.dtype, ref)
    return err <= bound and math.isfinite(bound), err, bound
