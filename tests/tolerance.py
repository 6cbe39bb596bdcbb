"""The tests' assertion on top of flashattn2.reference.tolerance: on failure it says where and by
how much."""

import torch

from flashattn2.reference import tolerance


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, factor: float):
    """ours/low: results in the input dtype; ref: the fp32/fp64 oracle."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    ok, err, bound = tolerance.check(ours, ref, low, factor)
    if not ok:  # NaN errors land here too
        diff = (ours.double() - ref.double()).abs()
        where = tuple(torch.nonzero(torch.isnan(diff) | (diff == diff.nan_to_num(0).max()))[0].tolist())
        raise AssertionError(
            f"{name}: max error {err:.3e} > bound {bound:.3e} ({factor} x PyTorch's own error + floor); "
            f"at index {list(where)}: ours {ours[where].item():.6g}, reference {ref[where].item():.6g}; "
            f"NaNs: {torch.isnan(ours).sum().item()}"
        )
