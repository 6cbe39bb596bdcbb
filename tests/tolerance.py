"""flash_attn's tolerance rule in one place: our max error against a high-precision reference may
be at most `factor` times the error of PyTorch doing the same math in the input dtype, plus a
small floor. On failure, it says where and by how much."""
import torch

FWD_FACTOR = 2.0
BWD_FACTOR = 3.0


def floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    # a gradient that is exactly 0 in PyTorch's math (one key: dK = 0) comes out as rounding
    # noise of size eps * |dO||V| from ours; far below any real bug's error
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (1e-5 if dtype == torch.float32 else 1e-4) * scale


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, factor: float):
    """ours/low: results in the input dtype; ref: the fp32/fp64 oracle."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs()
    err = diff.max().item()
    base = (low.double() - ref.double()).abs().max().item()
    bound = factor * base + floor(ours.dtype, ref)
    if not err <= bound:  # also catches NaN
        where = torch.nonzero(torch.isnan(diff) | (diff == diff.nan_to_num(0).max()))[0].tolist()
        raise AssertionError(
            f"{name}: max error {err:.3e} > {factor} x PyTorch's {base:.3e} + floor "
            f"(bound {bound:.3e}); at index {where}: ours {ours[tuple(where)].item():.6g}, "
            f"reference {ref[tuple(where)].item():.6g}; NaNs: {torch.isnan(ours).sum().item()}")
