"""The tests' assertion on top of flashattn2.reference.tolerance: on failure it says where and by
how much."""

import torch

from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref, tolerance


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
            f"{nan_note(ours)}"
        )


def nan_note(t: torch.Tensor) -> str:
    """How many NaNs t holds, and how many carry the bits the tests' poison writes (conftest: _runtime.POISON fills
    every output with float("nan") before the kernel runs), i.e. were never written: a kernel computes NaN with other
    bits on a GPU (0x7FFF in bf16), so the two tell an unwritten tile from a computed NaN."""
    nans = torch.isnan(t)
    count = int(nans.sum())
    if not count:
        return "NaNs: 0"
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    poison = torch.full((1,), float("nan"), dtype=t.dtype, device=t.device).view(bits)
    unwritten = int((t[nans].view(bits) == poison).sum())
    first = torch.nonzero(nans)[0].tolist()
    return f"NaNs: {count}, {unwritten} of them the poison's bits (never written), the first at {first}"


def check_against_reference(q, k, v, out, lse, grads, do, causal=False, dlse=None, name="", **opts):
    """out, lse and (unless grads is None) dq, dk, dv of one attention call against attention_ref with the same
    options (the oracle, and the input dtype's math as the yardstick): rows that see no key have lse +inf, only
    they; dlse, if given, is the gradient that flowed into lse; name prefixes the messages."""
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, **opts)
    low_out, low_lse = attention_ref(q, k, v, causal=causal, upcast=False, **opts)
    prefix = f"{name} " if name else ""
    assert_close(prefix + "out", out, ref_out, low_out, FWD_FACTOR)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), "rows without keys must have lse=+inf"
    assert_close(prefix + "lse", lse[finite], ref_lse[finite], low_lse[finite], FWD_FACTOR)
    if grads is None:
        return
    ref_loss = (ref_out * do.to(ref_out.dtype)).sum()
    low_loss = (low_out * do).sum()
    if dlse is not None:
        ref_loss = ref_loss + (ref_lse.masked_fill(~finite, 0) * dlse.to(ref_lse.dtype)).sum()
        low_loss = low_loss + (low_lse.masked_fill(~finite, 0) * dlse).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    low_grads = torch.autograd.grad(low_loss, (q, k, v))
    for gname, g, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert_close(prefix + gname, g, r, lo.to(g.dtype), BWD_FACTOR)
