"""A fuzz case's tensors (laid out as drawn), its options as keyword arguments, and the comparisons of its results
against the reference by flash_attn's tolerance rule (tests/fuzz_cases.py runs the cases)."""

from __future__ import annotations

import contextlib
import math

import torch

import flashattn2
from flashattn2.ops import planning
from flashattn2.ops.request import checks
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref, tolerance
from tolerance import assert_close


def _tensor(gen, shape, dtype, device, layout):
    """A standard-normal tensor of `shape` laid out in memory as `layout` (_layout) says."""
    order, pad, step, last = layout
    full = list(shape)
    if step >= 0:
        full[step] *= 2
    stored = [full[i] for i in order] + [full[-1] + pad] + ([2] if last else [])
    base = torch.randn(stored, generator=gen, device=device, dtype=dtype)
    if last:
        base = base[..., 0]
    t = base[..., : full[-1]].permute(*sorted(range(len(order)), key=order.__getitem__), len(order))
    if step >= 0:
        t = t[(slice(None),) * step + (slice(None, None, 2),)]
    assert tuple(t.shape) == tuple(shape), (t.shape, shape)
    return t


def _rand(gen, shape, device, dtype=torch.float32, scale=1.0):
    return torch.randn(shape, generator=gen, device=device, dtype=dtype) * scale


@contextlib.contextmanager
def _modes(p):
    """The case's planning.force() state, batch-invariant mode and value checks."""
    forced = {kernel: planning.TileConfig(bm, bn, 4, 1) for kernel, (bm, bn) in p.get("tiles", {}).items()}
    if p.get("tma"):
        forced["tma"] = True
    if p.get("arch"):
        forced["arch"] = p["arch"]
    if p.get("hopper") is False:
        forced["hopper"] = False
    previous = checks.set_value_checks(bool(p.get("checks", False)))
    try:
        with planning.force(**forced), flashattn2.batch_invariant(bool(p.get("invariant"))):
            yield
    finally:
        checks.set_value_checks(previous)


def _score_kwargs(p, alibi, sink, keys=None):
    """The options of a call; keys: the reference's, with flash_attn's window rule for the API's seqlen_k (dense) or
    max_seqlen_k (varlen): an edge at or past the keys' end is no edge (ops.run.call.window_edges)."""
    window = tuple(p["window"]) if keys is None else tuple(-1 if w >= keys else w for w in p["window"])
    return dict(
        softmax_scale=p["scale"],
        causal=p["causal"],
        window_size=window,
        softcap=p["softcap"],
        alibi_slopes=alibi,
        learnable_sink=sink,
    )


def _alibi(p, gen, batch, device):
    if p["alibi"] is None:
        return None
    return _rand(gen, (p["nheads"],) if p["alibi"] == "h" else (batch, p["nheads"]), device).abs() * 0.3


def _sink(p, gen, device):
    return _rand(gen, (p["nheads"],), device, scale=2.0) if p["sink"] else None


def _leaf(t, grad=True):
    return t.detach().clone().requires_grad_(grad)


def _compare(name, ours, ref, low, allowance=None):
    """Each of out, lse, dq, dk, dv present in ours against the oracle, by the rule (lse: where finite; +inf where
    the oracle's is); dq and dk with allowance's (_delta_allowance) beside it."""
    for key, got in ours.items():
        if key == "lse":
            inf = torch.isposinf(ref["lse"])
            assert torch.equal(torch.isposinf(got), inf), f"{name} lse: rows without keys must have lse=+inf, only they"
            assert_close(f"{name} lse", got[~inf], ref["lse"][~inf], low["lse"][~inf].float(), FACTORS["lse"])
        elif key != "dsink":
            extra = (allowance or {}).get(key)
            _close(f"{name} {key}", got, ref[key], low[key].to(got.dtype), FACTORS[key], extra)


def _check_dsink(name, dsink, sink, out, lse, ref_out, ref_lse, dout, dlse):
    """d sink = -sum over rows of exp(sink - L_i) (rowsum(dO_i O_i) - dlse_i): equal to that formula on our out and
    lse (1e-4), and to the oracle's within what our out's and lse's errors can move it (as tests/test_sinks.py).
    out, ref_out, dout (rows, nheads, dv); lse, ref_lse, dlse (nheads, rows)."""
    s = sink.detach().double()[:, None]
    dlse = torch.zeros_like(lse) if dlse is None else dlse

    def delta(o):
        return (dout.double() * o.detach().double()).sum(-1).T - dlse.double()

    def formula(o, lse_):
        return -(torch.exp(s - lse_.detach().double()) * delta(o)).nan_to_num(0).sum(1)

    torch.testing.assert_close(
        dsink.double(), formula(out, lse), rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} dsink: {m}"
    )
    finite = torch.isfinite(ref_lse)
    out_err = (out.double() - ref_out.detach().double()).abs().max() if out.numel() else 0.0
    lse_err = (lse.double() - ref_lse.detach().double())[finite].abs().max() if finite.any() else 0.0
    w = torch.exp(s - ref_lse.detach().double())
    l1 = dout.double().abs().sum(-1).T
    bound = (w * (l1 * out_err + delta(ref_out).abs() * lse_err)).nan_to_num(0).sum(1) + 1e-4
    err = (dsink.double() - formula(ref_out, ref_lse)).abs()
    assert (err <= bound).all(), f"{name} dsink: error {err.tolist()} > bound {bound.tolist()}"


def _grads(outputs, grad_outputs, inputs, repeat):
    """Gradients of inputs; repeat: a second backward, which must give the same bits (deterministic)."""
    grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=repeat)
    if repeat:
        again = torch.autograd.grad(outputs, inputs, grad_outputs)
        for i, (a, b) in enumerate(zip(grads, again)):
            assert torch.equal(a, b), f"deterministic=True: a second backward differs (gradient {i})"
    return grads


def _gradients(fn: str, outputs, grad_outputs, inputs, repeat: int, dim: int) -> dict:
    """dq, dk, dv (and dsink) of a call: outputs (out, lse) with grad_outputs (dout, dlse or None), inputs the leaves
    and the sink or None; a packed call's gradient split along dim (its q/k/v axis)."""
    if grad_outputs[1] is None:
        outputs, grad_outputs = outputs[:1], grad_outputs[:1]
    sink = inputs[-1]
    grads = _grads(outputs, grad_outputs, inputs if sink is not None else inputs[:-1], repeat)
    if fn.endswith("qkvpacked"):
        found = dict(zip(("dq", "dk", "dv"), grads[0].unbind(dim)))
    elif fn.endswith("kvpacked"):
        found = dict(dq=grads[0], dk=grads[1].select(dim, 0), dv=grads[1].select(dim, 1))
    else:
        found = dict(zip(("dq", "dk", "dv"), grads[:3]))
    if sink is not None:
        found["dsink"] = grads[-1]
    return found


FACTORS = {"out": FWD_FACTOR, "lse": FWD_FACTOR, "dq": BWD_FACTOR, "dk": BWD_FACTOR, "dv": BWD_FACTOR}


def _delta_allowance(p, q, k, opts, dout, out, ref_out):
    """What FlashAttention-2's backward may add to dq and dk (elementwise, like q and k) that PyTorch's does not: it
    takes delta_i = rowsum(dO_i * O_i) - dlse_i from the output it stored, rounded to the input dtype (with dropout
    scaled by 1 / (1 - p)), and sums it and dP in fp32 in another order, where PyTorch's softmax backward takes it
    from P exactly. With delta off by e_i, dS_ij = P_ij (dP_ij - delta_i) moves by P_ij e_i (times softcap's
    derivative, at most 1): dq_i by at most scale |e_i| (P |k|)_i and dk_j by scale (P^T (|e| |q|))_j. The rule's
    yardstick misses this where dq or dk is small by cancellation (rows that see one key or two: exactly 0 or
    nearly), and its max over the tensor then has no larger element to hide it. e_i: our output's error, as
    delta sees it, plus fp32's rounding of the two sums. P: the oracle's, without dropout (delta meets P
    undropped)."""
    r = ref_out.detach().double()
    do = dout.double()
    e = (do * (out.detach().double() - r)).sum(-1).abs() + 2 * torch.finfo(torch.float32).eps * (do * r).abs().sum(-1)
    scale = p["scale"] if p["scale"] is not None else q.shape[-1] ** -0.5
    opts = {key: value for key, value in opts.items() if key not in ("dropout_mask", "dropout_p")}
    q, k = q.detach(), k.detach()
    dummy = torch.zeros_like(k, requires_grad=True)  # a value whose gradient is P^T (the output's gradient)
    with torch.enable_grad():
        p_k, _ = attention_ref(q, k, k.abs(), **opts)
        o, _ = attention_ref(q, k, dummy, **opts)
        (pt,) = torch.autograd.grad(o, dummy, (e[..., None] * q.double().abs()).to(o.dtype))
    return scale * e[..., None] * p_k.double(), scale * pt.double()


def _close(name, ours, ref, low, factor, allowance=None):
    """assert_close, with an elementwise allowance (_delta_allowance) beside the rule's bound."""
    if allowance is not None:
        ok, err, bound = tolerance.check(ours, ref, low, factor)
        excess = (ours.double() - ref.double()).abs() - allowance
        if ok or (math.isfinite(bound) and not torch.isnan(excess).any() and excess.max().item() <= bound):
            return
    assert_close(name, ours, ref, low, factor)
