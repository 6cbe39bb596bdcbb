"""NaN in, NaN out; inf as the unsplit path takes it: on every path (dense, varlen, the batch-invariant mode, split-KV
decode at each number of splits and the default heuristic's, a paged cache, context parallelism's ring, zigzag ring
and Ulysses), forward and backward.

One causal call carries the bad values (in q, k, v, dout), each in a group of heads (a K/V head's) of a sequence, one
group left clean: the outputs and gradients that depend on a bad value must be NaN, the others finite and right. In a
bad value's own group, an element that does not depend on it mathematically but meets it in a tile may be NaN or not
(0 * NaN: a masked key's value, or a row's NaN, times p = 0 inside a tile, as the plain kernels and the reference
compute it): those are not checked.
"""

import pytest
import torch

import flashattn2
from conftest import DEVICE, ON_GPU
from flashattn2 import parallel
from flashattn2.ops.run import call as calls
from flashattn2.ops.launch import kvcache, merge
from flashattn2.ops.planning import decoding
from flashattn2.reference import attention_ref

# (batch, seqlen (q and k), nheads, nheads_k, headdim): 36 keys are two of the interpreter's batch-invariant splits,
# 600 three of the GPU's 256-key blocks (the KV-cache paths' splits)
B, S, H, HK, D = 2, 600 if ON_GPU else 36, 4, 2, 16
SQ_KV = 12  # the KV-cache paths' queries: the last 12 rows (a chunked prefill over the keys)
G = H // HK
DTYPE = torch.float16
NAN, FINITE, ANY, POSINF = 1, 0, -1, 2  # what an element must be
# the interpreter's numpy on NaN and inf inputs
pytestmark = [
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

# the bad values: (sequence, row or key, head or K/V head, column); sequence 0's K/V head 1 (heads 2 and 3) is clean
Q_AT = (0, S - 11, 1, 3)  # q: a row of head 1 (K/V head 0)
DO_AT = (0, S - 6, 0, 2)  # dout: a later row of head 0 (K/V head 0)
K_AT = (1, 20, 0, 5)  # k: key 20 of K/V head 0 (heads 0 and 1)
V_AT = (1, 20, 1, 7)  # v: key 20 of K/V head 1 (heads 2 and 3)

KVCACHE = {"kvcache-1": 1, "kvcache-2": 2, "kvcache-3": 3, "kvcache-heuristic": 0}
PATHS = ["dense", "deterministic", "varlen", "invariant", "invariant-varlen", *KVCACHE, "kvcache-paged",
         "kvcache-invariant", "ring", "zigzag", "ulysses"]  # fmt: skip
BACKWARD = {"dense", "deterministic", "varlen", "invariant", "invariant-varlen", "ring", "zigzag", "ulysses"}


@pytest.fixture
def splits_as_asked(monkeypatch):
    """num_splits=0 runs the GPU's heuristic in the interpreter too (which takes 0 as 1 split), on fresh plans."""
    calls.clear()
    monkeypatch.setattr(decoding, "_asked", lambda num_splits, arch: num_splits)
    plans, decode = [], kvcache.Decode
    monkeypatch.setattr(kvcache, "Decode", lambda plan, *a: plans.append(plan) or decode(plan, *a))
    yield plans
    calls.clear()


def _paged(cache, page):
    """(batch, seqlen, hk, d) as pages of `page` rows in reverse order: (pages, block_table)."""
    per_seq = -(-S // page)
    padded = torch.zeros(B, per_seq * page, *cache.shape[2:], dtype=cache.dtype, device=DEVICE)
    padded[:, :S] = cache
    table = torch.arange(B * per_seq - 1, -1, -1, dtype=torch.int32, device=DEVICE).view(B, per_seq)
    pages = torch.empty(B * per_seq, page, *cache.shape[2:], dtype=cache.dtype, device=DEVICE)
    pages[table.flatten().long()] = padded.reshape(B * per_seq, page, *cache.shape[2:])
    return pages, table


def _ring(func, layout, q, k, v):
    world = 2
    shards = [torch.stack([parallel.shard(t, world, r, layout, 1) for r in range(world)]) for t in (q, k, v)]
    out, lse, _ = func(*shards, causal=True, return_attn_probs=True, group=parallel.SimulatedGroup(world))
    return parallel.unshard(list(out), layout, 1), parallel.unshard(list(lse), layout, 2)


def run(path, q, k, v):
    """(out (batch, seqlen, nheads, d), lse (batch, nheads, seqlen)) of causal attention on `path` (the KV-cache
    paths: of q's last SQ_KV rows)."""
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEVICE)
    if path in ("dense", "deterministic", "invariant"):
        with flashattn2.batch_invariant(path == "invariant"):
            out, lse, _ = flashattn2.flash_attn_func(
                q, k, v, causal=True, deterministic=path == "deterministic", return_attn_probs=True
            )
        return out, lse
    if path in ("varlen", "invariant-varlen"):
        with flashattn2.batch_invariant(path == "invariant-varlen"):
            out, lse, _ = flashattn2.flash_attn_varlen_func(
                *(t.flatten(0, 1) for t in (q, k, v)), cu, cu, S, S, causal=True, return_attn_probs=True
            )
        return out.unflatten(0, (B, S)), lse.unflatten(1, (B, S)).transpose(0, 1)
    if path.startswith("kvcache"):
        kw = dict(cache_seqlens=S, causal=True, return_softmax_lse=True)
        if path == "kvcache-paged":
            (k, table), (v, _) = _paged(k, 8), _paged(v, 8)
            kw.update(block_table=table, num_splits=3)
        else:
            kw["num_splits"] = KVCACHE.get(path, 1)
        with flashattn2.batch_invariant(path == "kvcache-invariant"):
            return flashattn2.flash_attn_with_kvcache(q[:, -SQ_KV:], k, v, **kw)
    funcs = {
        "ring": (parallel.ring_flash_attn_func, "contiguous"),
        "zigzag": (parallel.zigzag_ring_flash_attn_func, "zigzag"),
        "ulysses": (parallel.ulysses_flash_attn_func, "contiguous"),
    }
    return _ring(*funcs[path], q, k, v)


def _inputs():
    q, k, v, do = (torch.randn(B, S, h, D, device=DEVICE, dtype=DTYPE) for h in (H, HK, HK, H))
    return q, k, v, do


def _group(hk):
    return slice(hk * G, (hk + 1) * G)


def _mark(want, index, cls):
    """want[index] = cls, but ANY only where FINITE (an element another bad value makes NaN stays NAN)."""
    want[index] = torch.where(want[index] == FINITE, cls, want[index]) if cls == ANY else cls


def expected_forward():
    """What out (batch, seqlen, nheads, d) and lse (batch, nheads, seqlen) must be with the bad values of
    Q_AT, K_AT, V_AT: NAN, FINITE or ANY."""
    out = torch.full((B, S, H, D), FINITE)
    lse = torch.full((B, H, S), FINITE)
    b, i, h, _ = Q_AT
    out[b, i, h], lse[b, h, i] = NAN, NAN
    b, j, hk, _ = K_AT  # rows from j on see the key: their scores, lse and out
    out[b, j:, _group(hk)], lse[b, _group(hk), j:] = NAN, NAN
    b, j, hk, d = V_AT  # rows from j on: column d; the rows before: a masked key's 0 * NaN in its tile
    _mark(out, (b, slice(None), _group(hk), d), ANY)
    out[b, j:, _group(hk), d] = NAN
    return out, lse


def expected_grads():
    """What dq, dk, dv must be with the bad values of Q_AT, K_AT, V_AT and DO_AT (causal)."""
    dq, dk, dv = torch.full((B, S, H, D), FINITE), torch.full((B, S, HK, D), FINITE), torch.full((B, S, HK, D), FINITE)
    b, i, h, _ = Q_AT  # row i's P is NaN: its dq, and dk, dv of the keys it sees
    dq[b, i, h] = NAN
    _mark(dk, (b, slice(None), h // G), ANY), _mark(dv, (b, slice(None), h // G), ANY)
    dk[b, : i + 1, h // G], dv[b, : i + 1, h // G] = NAN, NAN
    b, i, h, d = DO_AT  # row i's dO: its dS, its dq; dk of the keys it sees; column d of their dv
    dq[b, i, h] = NAN
    _mark(dk, (b, slice(None), h // G), ANY), _mark(dv, (b, slice(None), h // G, d), ANY)
    dk[b, : i + 1, h // G], dv[b, : i + 1, h // G, d] = NAN, NAN
    b, j, hk, _ = K_AT  # rows from j on: lse NaN, their P NaN; the last row sees every key
    _mark(dq, (b, slice(None), _group(hk)), ANY)
    dq[b, j:, _group(hk)] = NAN
    dk[b, :, hk], dv[b, :, hk] = NAN, NAN
    b, j, hk, _ = V_AT  # rows from j on: out NaN, so D = rowsum(dO * O) and dS; dv = P^T dO is finite
    _mark(dq, (b, slice(None), _group(hk)), ANY)
    dq[b, j:, _group(hk)] = NAN
    dk[b, :, hk] = NAN
    return dq, dk, dv


def assert_classes(name, got, want, ref):
    """got is what want says, element by element: NaN where NAN, +inf where POSINF, finite and close to ref (the
    reference's) where FINITE; anything where ANY."""
    got = got.float().cpu()
    for cls, ok, what in ((NAN, torch.isnan(got), "NaN"), (POSINF, torch.isposinf(got), "+inf"),
                          (FINITE, torch.isfinite(got), "finite")):  # fmt: skip
        wrong = (want == cls) & ~ok
        assert not wrong.any(), (
            f"{name}: {int(wrong.sum())} elements not {what}, first at {wrong.nonzero()[0].tolist()}"
        )
    keep = want == FINITE
    err = (got[keep] - ref.float().cpu()[keep]).abs().max().item()
    assert err < 2e-2, f"{name}: max error {err:.3e} against the reference where it must be finite"


def _poison(q, k, v, do):
    for t, (b, i, h, d) in ((q, Q_AT), (k, K_AT), (v, V_AT), (do, DO_AT)):
        t[b, i, h, d] = float("nan")


@pytest.mark.parametrize("path", PATHS)
def test_nan_in_nan_out(path, splits_as_asked):
    q, k, v, do = _inputs()
    _poison(q, k, v, do)
    q, k, v = (t.requires_grad_(path in BACKWARD) for t in (q, k, v))
    out, lse = run(path, q, k, v)
    rows = slice(S - SQ_KV if path.startswith("kvcache") else 0, S)
    if path in KVCACHE or path == "kvcache-paged":  # the splits the path is about
        (plan,) = splits_as_asked
        want = {"kvcache-1": 1, "kvcache-2": 2, "kvcache-heuristic": plan.splits}.get(path, 3)
        assert plan.splits == want and plan.splits > (path != "kvcache-1"), plan
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    want_out, want_lse = expected_forward()
    assert_classes("out", out, want_out[:, rows], ref_out[:, rows])
    assert_classes("lse", lse, want_lse[..., rows], ref_lse[..., rows])
    if path not in BACKWARD:
        return
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), do.to(ref_out.dtype))
    for name, g, want, ref in zip(("dq", "dk", "dv"), grads, expected_grads(), ref_grads):
        assert_classes(name, g, want, ref)


@pytest.mark.parametrize("path", PATHS)
def test_inf_as_the_unsplit_path(path, splits_as_asked):
    """inf in q, k and v, each where a row's scores or sums meet it: a score +inf (q or k) gives a NaN row (inf - inf
    in the softmax), a key whose score is -inf drops out, a value +inf gives +inf outputs; as flash_attn_func's
    unsplit kernel gives them. A row whose every score is -inf is 0 / 0: NaN where the kernels' unmasked key blocks
    meet it (the unsplit kernel's, at the GPU's lengths), a row without keys (out 0, lse +inf) where only masked
    blocks do (the KV-cache kernel's, short rows): either, out and lse alike."""
    q, k, v, _ = _inputs()
    b, i, h, d = Q_AT  # a score +inf: NaN
    q[b, i, h, d], k[b, 0, h // G, d] = float("inf"), 1.0
    b, i, h, d = DO_AT  # every score -inf
    q[b, i, h, d] = float("-inf")
    k[b, :, h // G, d] = k[b, :, h // G, d].abs() + 0.1
    b, j, hk, d = K_AT  # key j's score +inf for head hk * G (NaN rows), -inf for the next (the key drops out)
    k[b, j, hk, d] = float("inf")
    q[b, :, hk * G, d] = q[b, :, hk * G, d].abs() + 0.1
    q[b, :, hk * G + 1, d] = -q[b, :, hk * G + 1, d].abs() - 0.1
    b, j, hk, d = V_AT  # a value +inf
    v[b, j, hk, d] = float("inf")
    out, lse = run(path, q, k, v)
    rows = slice(S - SQ_KV if path.startswith("kvcache") else 0, S)

    want_out, want_lse = torch.full((B, S, H, D), FINITE), torch.full((B, H, S), FINITE)
    b, i, h, _ = Q_AT
    want_out[b, i, h], want_lse[b, h, i] = NAN, NAN
    b, i, h, _ = DO_AT
    want_out[b, i, h], want_lse[b, h, i] = ANY, ANY
    row_out, row_lse = out[b, i - rows.start, h].float(), lse[b, h, i - rows.start]
    nan_row = torch.isnan(row_out).all() and torch.isnan(row_lse)
    assert nan_row or (torch.equal(row_out, torch.zeros_like(row_out)) and row_lse == float("inf")), (row_out, row_lse)
    b, j, hk, _ = K_AT
    want_out[b, j:, hk * G], want_lse[b, hk * G, j:] = NAN, NAN
    b, j, hk, d = V_AT  # the rows before key j: a masked key's 0 * inf in its tile
    want_out[b, :, _group(hk), d] = ANY
    want_out[b, j:, _group(hk), d] = POSINF
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert_classes("out", out, want_out[:, rows], ref_out[:, rows])
    assert_classes("lse", lse, want_lse[..., rows], ref_lse[..., rows])


def test_nan_reaches_the_sink_gradient():
    """A learnable sink: a NaN logsumexp (a NaN in q) gives its head's sink a NaN gradient (the backward's preprocess,
    every path's), the other heads' right."""
    q, k, v, do = _inputs()
    b, i, h, d = Q_AT
    q[b, i, h, d] = float("nan")
    sink = torch.randn(H, device=DEVICE, dtype=torch.float32, requires_grad=True)
    out = flashattn2.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    (dsink,) = torch.autograd.grad(out, (sink,), do)
    ref_out, _ = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    (ref,) = torch.autograd.grad(ref_out, (sink,), do.to(ref_out.dtype))
    want = torch.full((H,), FINITE)
    want[h] = NAN
    assert_classes("dsink", dsink, want, ref)


def test_merge_keeps_nan():
    """ops.launch.merge (context parallelism's merge by logsumexp), row by row: a NaN logsumexp on either side gives a
    NaN row and logsumexp, also into a row nothing has reached yet (lse -inf: the GPU's maximum returns the other
    side); a NaN output with a finite logsumexp its NaN columns; a block row without keys (lse +inf or -inf) adds
    nothing, whatever its output holds."""
    nan, inf = float("nan"), float("inf")
    acc_lse = torch.tensor([[-inf, 0.5, nan, 0.5, 0.5, 0.5]], device=DEVICE)
    blk_lse = torch.tensor([[nan, nan, 0.25, inf, -inf, 0.25]], device=DEVICE)
    acc = torch.randn(6, 1, 4, device=DEVICE)
    acc[0] = 0.0
    acc[2] = nan
    blk = torch.randn(6, 1, 4, device=DEVICE)
    blk[3:5] = nan
    blk[5, 0, 2] = nan
    got, got_lse = acc.clone(), acc_lse.clone()
    merge.merge_(got, got_lse, blk, blk_lse, first=False)
    assert torch.isnan(got[:3]).all() and torch.isnan(got_lse[0, :3]).all()
    assert torch.equal(got[3:5], acc[3:5]) and torch.equal(got_lse[0, 3:5], acc_lse[0, 3:5])
    assert torch.isnan(got[5, 0, 2]) and torch.isfinite(got[5, 0, [0, 1, 3]]).all() and torch.isfinite(got_lse[0, 5])
    # the first block is copied, a row without keys as out 0 and lse -inf
    merge.merge_(got, got_lse, blk, blk_lse, first=True)
    assert torch.equal(got[:3], blk[:3]) and torch.isnan(got_lse[0, :2]).all()
    assert torch.equal(got[3:5], torch.zeros_like(got[3:5])) and (got_lse[0, 3:5] == -inf).all()
