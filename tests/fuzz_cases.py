"""The fuzzer: random calls across flashattn2's public API against the package's reference (flashattn2.reference), by
flash_attn's tolerance rule (tests/tolerance.py). tests/test_fuzz.py runs it in CI for a fixed time at tiny sizes
through the interpreter; tools/fuzz.py runs it longer, on a GPU at realistic sizes.

A case is drawn from (seed, index) alone (`draw`), so any one replays without the others, and is plain data
(`Case`: the function, a data seed, the parameters), so a failure's printed `Case(...)` pasted into a test is that
test (`run`). What is drawn:

- the functions: flash_attn_func, the qkv- and kv-packed forms, flash_attn_varlen_func and its packed forms, the
  paged prefill (flash_attn_varlen_func with block_table), flash_attn_with_kvcache (appends, rotary, contiguous or
  paged caches, cache_batch_idx, cache_leftpad, int or tensor cache_seqlens, num_splits); forward and backward;
- every option: causal, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads)), dropout (its mask
  read back from S_dmask, as tests/test_dropout.py does), deterministic (a repeated backward must be bitwise equal),
  learnable_sink (its gradient too), return_attn_probs (the logsumexp and its gradient), softmax_scale; the
  batch-invariant mode; forced tiles, the TMA load path, another arch's table rows (planning.force);
- shapes: lengths 0, 1, primes, and lengths and `seqlen_k - seqlen_q` at -1, 0 and +1 around multiples of every
  block size the plan can choose (`tile_sizes`); GQA ratios; head dims 1 to 512 (576 for the KV cache), a value
  head dim of its own; fp16, bf16, fp32; non-contiguous views (axes stored in another order, padded head dims,
  every other element, a strided last dimension);
- bad values among the index tensors (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens):
  with the value checks on, the error naming the argument and the caches untouched; with them off, no error and the
  other sequences' results right (what the bad sequence reads or writes is not checked).

The cases are drawn in tests/fuzz_draw.py (its KNOWN_DEFECTS: what the fuzzer does not draw until it is fixed), their
tensors made and results compared in tests/fuzz_check.py, and run here.
"""

from __future__ import annotations

import math
import re
import time

import torch

import flashattn2
from flashattn2.ops import _runtime
from flashattn2.reference import attention_ref
from flashattn2.reference.kvcache import kvcache_ref
from fuzz_draw import API, CPU, DTYPES, GPU, KNOWN_DEFECTS, Case, Sizes, draw  # noqa: F401  (CPU, GPU: callers' sizes)
from fuzz_check import (
    _alibi,
    _check_dsink,
    _compare,
    _delta_allowance,
    _gradients,
    _leaf,
    _modes,
    _rand,
    _score_kwargs,
    _sink,
    _tensor,
)
from tolerance import assert_close

# ---------------------------------------------------------------------------------------------------------------
# Running


def _run_dense(fn, p, gen, device):
    dtype = DTYPES[p["dtype"]]
    b, sq, sk, h, hk, d, dv = (p[x] for x in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "d", "dv"))
    lay, grad = p["layouts"], p["backward"]
    if fn == "qkvpacked":
        packed = _tensor(gen, (b, sq, 3, h, d), dtype, device, lay["qkv"]).requires_grad_(grad)
        q, k, v = packed.unbind(2)
        args, leaves = (packed,), (packed,)
    elif fn == "kvpacked":
        q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        packed = _tensor(gen, (b, sk, 2, hk, d), dtype, device, lay["kv"]).requires_grad_(grad)
        k, v = packed.unbind(2)
        args, leaves = (q, packed), (q, packed)
    else:
        q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        k = _tensor(gen, (b, sk, hk, d), dtype, device, lay["k"]).requires_grad_(grad)
        v = _tensor(gen, (b, sk, hk, dv), dtype, device, lay["v"]).requires_grad_(grad)
        args = leaves = (q, k, v)
    alibi, sink = _alibi(p, gen, b, device), _sink(p, gen, device)
    if sink is not None:
        sink.requires_grad_(grad)
    kwargs = _score_kwargs(p, alibi, sink)
    with _modes(p):
        result = getattr(flashattn2, API[fn])(
            *args, dropout_p=p["dropout"], deterministic=p["deterministic"], return_attn_probs=p["lse"], **kwargs
        )
    out, lse, s_dmask = result if p["lse"] else (result, None, None)
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype, (out.shape, out.dtype)
    keep = s_dmask[:, :, :sq, :sk] >= 0 if p["dropout"] else None
    dout = _rand(gen, out.shape, device, dtype)
    dlse = _rand(gen, lse.shape, device) if p["dlse"] else None
    ours = {"out": out} | ({"lse": lse} if lse is not None else {})
    if grad:
        ours.update(_gradients(fn, (out, lse), (dout, dlse), (*leaves, sink), p["repeat"], 2))
    qr, kr, vr = (_leaf(t, grad) for t in (q, k, v))
    sr = _leaf(sink, grad) if sink is not None else None
    opts = _score_kwargs(p, alibi, sr, sk) | dict(dropout_mask=keep, dropout_p=p["dropout"])
    ref, low = {}, {}
    for upcast, into in ((True, ref), (False, low)):
        into["out"], into["lse"] = attention_ref(qr, kr, vr, upcast=upcast, **opts)
        if grad:
            outputs = [into["out"]]
            grad_outputs = [dout.to(into["out"].dtype)]
            if dlse is not None:
                finite = torch.isfinite(into["lse"])
                outputs.append(into["lse"].masked_fill(~finite, 0))
                grad_outputs.append(dlse.to(into["lse"].dtype))
            into.update(zip(("dq", "dk", "dv"), torch.autograd.grad(outputs, (qr, kr, vr), grad_outputs)))
    allowance = None
    if grad:
        ropts = _score_kwargs(p, alibi, sr, sk)
        allowance = dict(zip(("dq", "dk"), _delta_allowance(p, qr, kr, ropts, dout, out, ref["out"])))
    _compare(fn, ours, ref, low, allowance)
    if sink is not None and grad:
        _check_dsink(
            fn, ours["dsink"], sink, out.reshape(-1, h, dv), lse.permute(1, 0, 2).reshape(h, -1),
            ref["out"].reshape(-1, h, dv), ref["lse"].permute(1, 0, 2).reshape(h, -1), dout.reshape(-1, h, dv),
            None if dlse is None else dlse.permute(1, 0, 2).reshape(h, -1),
        )  # fmt: skip


def cu_of(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32).to(device)


def _page_table(seed, lengths, page, extra, canaries):
    """A block table (batch, max_blocks) of random distinct blocks for sequences of these lengths, and the number of
    blocks; canaries: blocks 0 and the last are nobody's (a bad entry is clamped onto them)."""
    max_blocks = max(1, max((-(-n // page) for n in lengths), default=1))
    num_blocks = len(lengths) * max_blocks + extra + (2 if canaries else 0)
    first = 1 if canaries else 0
    order = torch.randperm(num_blocks - 2 * first, generator=torch.Generator().manual_seed(seed)) + first
    return order[: len(lengths) * max_blocks].view(len(lengths), max_blocks), num_blocks


def _pages(gen, x, lengths, page, table, num_blocks, layout):
    """Random pages (num_blocks, page, heads, headdim) holding the rows of sequences packed in x (total, heads,
    headdim) through table."""
    pages = _tensor(gen, (num_blocks, page, *x.shape[1:]), x.dtype, x.device, layout)
    with torch.no_grad():
        start = 0
        for b, n in enumerate(lengths):
            for j in range(0, n, page):
                m = min(page, n - j)
                pages[int(table[b, j // page]), :m] = x[start + j : start + j + m]
            start += n
    return pages


def _run_varlen(fn, p, gen, device, bad=None):
    dtype = DTYPES[p["dtype"]]
    lq, lk, h, hk, d, dv = (p[x] for x in ("lengths_q", "lengths_k", "nheads", "nheads_k", "d", "dv"))
    batch = len(lq)
    tq, tk = sum(lq) + p["tail_q"], sum(lk) + p["tail_k"]
    lay, grad = p["layouts"], p["backward"]
    paged = fn == "varlen_paged"
    if fn == "varlen_qkvpacked":
        packed = _tensor(gen, (tq, 3, h, d), dtype, device, lay["qkv"]).requires_grad_(grad)
        q, k, v = packed.unbind(1)
        leaves = (packed,)
    elif fn == "varlen_kvpacked":
        q = _tensor(gen, (tq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        packed = _tensor(gen, (tk, 2, hk, d), dtype, device, lay["kv"]).requires_grad_(grad)
        k, v = packed.unbind(1)
        leaves = (q, packed)
    else:
        q = _tensor(gen, (tq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        contiguous = ((0, 1), 0, -1, False)
        k = _tensor(gen, (tk, hk, d), dtype, device, contiguous if paged else lay["k"]).requires_grad_(grad)
        v = _tensor(gen, (tk, hk, dv), dtype, device, contiguous if paged else lay["v"]).requires_grad_(grad)
        leaves = (q, k, v)
    cu_q, cu_k = cu_of(lq, device), cu_of(lk, device)
    if fn == "varlen_qkvpacked":
        cu_k = cu_q
    max_q, max_k = max(lq, default=0) + p["slack"], max(lk, default=0) + p["slack"]
    if p["max_tensor"]:
        max_q, max_k = torch.tensor([max_q]), torch.tensor(max_k)
    alibi, sink = _alibi(p, gen, batch, device), _sink(p, gen, device)
    if sink is not None:
        sink.requires_grad_(grad)
    kwargs = _score_kwargs(p, alibi, sink) | dict(return_attn_probs=p["lse"], deterministic=p["deterministic"])
    if fn == "varlen_qkvpacked":
        args = (packed, cu_q, max_q)
    elif fn == "varlen_kvpacked":
        args = (q, packed, cu_q, cu_k, max_q, max_k)
    elif paged:
        table, num_blocks = _page_table(gen.initial_seed(), lk, p["page"], 1, canaries=bad is not None)
        k_pages = _pages(gen, k, lk, p["page"], table, num_blocks, lay["k"])
        v_pages = _pages(gen, v, lk, p["page"], table, num_blocks, lay["v"])
        kwargs["block_table"] = table.to(torch.int32).to(device)
        args = (q, k_pages, v_pages, cu_q, cu_k, max_q, max_k)
    else:
        args = (q, k, v, cu_q, cu_k, max_q, max_k)
    good = list(range(batch))
    if bad is not None:
        args, kwargs, good = bad(args, kwargs, cu_q, cu_k, tq, tk)
        if good is None:
            return
    with _modes(p), torch.set_grad_enabled(grad):
        result = getattr(flashattn2, API[fn])(*args, dropout_p=p["dropout"], **kwargs)
    out, lse, s_dmask = result if p["lse"] else (result, None, None)
    assert out.shape == (tq, h, dv) and out.dtype == dtype, (out.shape, out.dtype)
    dout = _rand(gen, out.shape, device, dtype)
    dlse = _rand(gen, lse.shape, device) if p["dlse"] else None
    ours = {"out": out} | ({"lse": lse} if lse is not None else {})
    if grad:
        ours.update(_gradients(fn, (out, lse), (dout, dlse), (*leaves, sink), p["repeat"], 1))
    qr, kr, vr = (_leaf(t, grad) for t in (q, k, v))
    sr = _leaf(sink, grad) if sink is not None else None
    ref, low = {}, {}
    starts_q, starts_k = cu_of(lq, "cpu").tolist(), cu_of(lk, "cpu").tolist()
    for upcast, into in ((True, ref), (False, low)):
        outs, lses = [], []
        for b in range(batch):
            rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            keep = s_dmask[b : b + 1, :, : lq[b], : lk[b]] >= 0 if p["dropout"] else None
            slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
            opts = _score_kwargs(p, slopes, sr, int(max_k)) | dict(dropout_mask=keep, dropout_p=p["dropout"])
            o, s = attention_ref(qr[None, rq], kr[None, rk], vr[None, rk], upcast=upcast, **opts)
            outs.append(o[0])
            lses.append(s[0])
        compute = outs[0].dtype if outs else dtype
        outs.append(torch.zeros(p["tail_q"], h, dv, dtype=compute, device=device))
        lses.append(
            torch.full((h, p["tail_q"]), math.inf, dtype=lses[0].dtype if lses else torch.float32, device=device)
        )
        into["out"], into["lse"] = torch.cat(outs), torch.cat(lses, 1)
        if grad:
            outputs, grad_outputs = [into["out"]], [dout.to(into["out"].dtype)]
            if dlse is not None:
                outputs.append(into["lse"].masked_fill(~torch.isfinite(into["lse"]), 0))
                grad_outputs.append(dlse.to(into["lse"].dtype))
            into.update(
                zip(("dq", "dk", "dv"), torch.autograd.grad(outputs, (qr, kr, vr), grad_outputs, allow_unused=True))
            )
            for key in ("dq", "dk", "dv"):
                if into[key] is None:
                    into[key] = torch.zeros_like((qr, kr, vr)[("dq", "dk", "dv").index(key)])
    if bad is not None:  # the good sequences' rows only
        rows = torch.cat(
            [torch.arange(starts_q[b], starts_q[b + 1]) for b in good] + [torch.zeros(0, dtype=torch.long)]
        )
        rows = rows.to(device)
        for into in (ours, ref, low):
            into["out"] = into["out"][rows]
            if "lse" in into:
                into["lse"] = into["lse"][:, rows]
        if "lse" not in ours:
            ref.pop("lse")
    allowance = None
    if grad:
        allowance = {"dq": q.new_zeros(q.shape, dtype=torch.float64), "dk": k.new_zeros(k.shape, dtype=torch.float64)}
        for b in range(batch):
            rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            if lq[b] and lk[b]:
                slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
                allowance["dq"][rq], allowance["dk"][rk] = (
                    a[0]
                    for a in _delta_allowance(
                        p, qr[None, rq], kr[None, rk], _score_kwargs(p, slopes, sr, int(max_k)), dout[None, rq], out[None, rq],
                        ref["out"][None, rq],
                    )
                )  # fmt: skip
    _compare(fn, ours, ref, low, allowance)
    if sink is not None and grad:
        _check_dsink(fn, ours["dsink"], sink, out, lse, ref["out"], ref["lse"], dout, dlse)


def _like(t, layout):
    """A copy of t laid out in memory as layout says (clone() would make a padded or permuted view contiguous)."""
    copy = _tensor(None, t.shape, t.dtype, t.device, layout)
    with torch.no_grad():
        copy.copy_(t)
    return copy


def _kvcache_inputs(p, gen, device, canaries):
    """(q, k_cache, v_cache, kwargs of flash_attn_with_kvcache but the caches) of a KV-cache case."""
    dtype = DTYPES[p["dtype"]]
    b, sq, h, hk, d, dv = (p[x] for x in ("batch", "seqlen_q", "nheads", "nheads_k", "d", "dv"))
    cap, page, new, lay = p["capacity"], p["page"], p["seqlen_new"], p["layouts"]
    seed = gen.initial_seed()
    q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"])
    kwargs = {}
    if page:
        table, num_blocks = _page_table(seed, [cap] * b, page, p["extra"], canaries)
        shape = (num_blocks, page, hk)
        kwargs["block_table"] = table.to(torch.int32).to(device)
    else:
        rows = b + p["extra"] + (2 if canaries else 0)
        shape = (rows, cap, hk)
        if p["batch_idx"]:
            first = 1 if canaries else 0
            order = torch.randperm(rows - 2 * first, generator=torch.Generator().manual_seed(seed))[:b] + first
            kwargs["cache_batch_idx"] = order.to(torch.int32).to(device)
    k_cache = _tensor(gen, (*shape, d), dtype, device, lay["k_cache"])
    latent = p.get("latent", False)
    v_cache = k_cache[..., :dv] if latent else _tensor(gen, (*shape, dv), dtype, device, lay["v_cache"])
    kind = p["seqlens_kind"]
    if kind == "tensor":
        kwargs["cache_seqlens"] = torch.tensor(p["cache_seqlens"], dtype=torch.int32).to(device)
    elif kind == "int":
        kwargs["cache_seqlens"] = p["cache_seqlens"]
    if p["leftpad"]:
        kwargs["cache_leftpad"] = torch.tensor(p["leftpads"], dtype=torch.int32).to(device)
    if new:
        kwargs["k"] = _tensor(gen, (b, new, hk, d), dtype, device, lay["k"])
        kwargs["v"] = kwargs["k"][..., :dv] if latent else _tensor(gen, (b, new, hk, dv), dtype, device, lay["v"])
    if p["rotary"]:
        angle = torch.rand(cap + sq + 1, p["rotary_dim"] // 2, generator=gen, device=device) * 6.28
        kwargs.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype))
        kwargs["rotary_interleaved"] = p["rotary"] == "gptj"
    alibi, sink = _alibi(p, gen, b, device), _sink(p, gen, device)
    kwargs.update(_score_kwargs(p, alibi, sink))
    return q, k_cache, v_cache, kwargs


def _our_kvcache(p, q, k_cache, v_cache, kwargs):
    """Our call on copies of the caches (laid out as the originals): (out, lse or None, k_cache, v_cache after)."""
    lay = p["layouts"]
    kc = _like(k_cache, lay["k_cache"])
    vc = kc[..., : v_cache.shape[-1]] if p.get("latent") else _like(v_cache, lay["v_cache"])
    with _modes(p):
        result = flashattn2.flash_attn_with_kvcache(
            q, kc, vc, **kwargs, num_splits=p["num_splits"], return_softmax_lse=p["lse"]
        )
    out, lse = result if p["lse"] else (result, None)
    return out, lse, kc, vc


def _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=True, rows=None):
    """kvcache_ref, of the sequences `rows` only (None: all)."""
    kw = {key: value for key, value in kwargs.items()}
    kw["window_size"] = tuple(kw["window_size"])
    if rows is not None:
        q = q[rows]
        for key in ("k", "v", "cache_batch_idx", "cache_leftpad", "block_table"):
            if kw.get(key) is not None:
                kw[key] = kw[key][rows]
        if isinstance(kw.get("cache_seqlens"), torch.Tensor):
            kw["cache_seqlens"] = kw["cache_seqlens"][rows]
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kw["alibi_slopes"] = kw["alibi_slopes"][rows]
    return kvcache_ref(q, k_cache, v_cache, upcast=upcast, **kw)


def _check_kvcache_out(name, out, lse, ref, low, alibi):
    """out by flash_attn's rule against the oracle (factor 3, 5 with ALiBi, as tests/test_kvcache.py), lse +inf
    exactly where the oracle's is and within 1e-3 elsewhere."""
    assert_close(f"{name} out", out, ref[0], low[0], 5.0 if alibi else 3.0)
    if lse is not None:
        finite = torch.isfinite(ref[1])
        assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == math.inf).all(), (
            f"{name} lse: rows without keys must have lse=+inf, only they"
        )
        torch.testing.assert_close(
            lse[finite], ref[1][finite].float(), rtol=1e-3, atol=1e-3, msg=lambda m: f"{name} lse: {m}"
        )


def _run_kvcache(p, gen, device):
    q, k_cache, v_cache, kwargs = _kvcache_inputs(p, gen, device, canaries=False)
    out, lse, k_after, v_after = _our_kvcache(p, q, k_cache, v_cache, kwargs)
    assert out.shape == (*q.shape[:3], v_cache.shape[-1]) and out.dtype == q.dtype, (out.shape, out.dtype)
    ref = _kvcache_ref(q, k_cache, v_cache, kwargs)
    low = _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=False)
    _check_kvcache_out("kvcache", out, lse, ref, low, p["alibi"])
    if p["rotary"]:  # rotated in fp32 by both, rounded once: equal up to an ulp
        torch.testing.assert_close(
            k_after, ref[2], rtol=1e-2, atol=1e-2, msg=lambda m: f"kvcache k_cache after the append: {m}"
        )
    else:
        assert torch.equal(k_after, ref[2]), "kvcache: k_cache after the append differs from the reference's"
    if not p.get("latent"):
        assert torch.equal(v_after, ref[3]), "kvcache: v_cache after the append differs from the reference's"


def _raises(p, call, match):
    """With the value checks on (or an int cache_seqlens, checked always): the call raises ArgumentError naming the
    argument."""
    try:
        with _modes(p):
            call()
    except flashattn2.ArgumentError as e:
        assert re.search(match, str(e)), f"the error does not name {match!r}: {e}"
    else:
        raise AssertionError(f"a bad {match} did not raise (value checks {'on' if p.get('checks') else 'off'})")


BAD_KVCACHE_MATCH = {
    "cache_seqlens": "cache_seqlens",
    "cache_seqlens_int": "cache_seqlens",
    "cache_leftpad": "cache_leftpad",
    "cache_batch_idx": "cache_batch_idx",
    "block_table": "block_table",
}


def _run_bad_kvcache(p, gen, device):
    canaries = "clamped-writes" in KNOWN_DEFECTS
    q, k_cache, v_cache, kwargs = _kvcache_inputs(p, gen, device, canaries)
    which, b, value = p["bad"]
    if which == "cache_seqlens_int":
        kwargs["cache_seqlens"] = value
    elif which == "block_table":
        kwargs["block_table"] = kwargs["block_table"].clone()
        kwargs["block_table"][b, value[0]] = value[1]
    else:
        name = {"cache_seqlens": "cache_seqlens", "cache_leftpad": "cache_leftpad"}.get(which, which)
        kwargs[name] = kwargs[name].clone()
        kwargs[name][b] = value
    # a paged call past its pages: flash_attn's own check (one read of max(cache_seqlens)) raises, value checks or not
    past_pages = p["page"] and which == "cache_seqlens" and value + p["seqlen_new"] > p["capacity"]
    if p["checks"] or which == "cache_seqlens_int" or past_pages:
        lay = p["layouts"]
        kc, vc = _like(k_cache, lay["k_cache"]), _like(v_cache, lay["v_cache"])
        call = lambda: flashattn2.flash_attn_with_kvcache(q, kc, vc, **kwargs, num_splits=p["num_splits"])  # noqa: E731
        _raises(p, call, "block_table" if past_pages and not p["checks"] else BAD_KVCACHE_MATCH[which])
        assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache), "a cache was written before the error"
        return
    out, lse, _, _ = _our_kvcache(p, q, k_cache, v_cache, kwargs)  # no error, whatever the bad sequence gets
    good = [i for i in range(q.shape[0]) if i != b]
    if not good:
        return
    ref = _kvcache_ref(q, k_cache, v_cache, kwargs, rows=good)
    low = _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=False, rows=good)
    _check_kvcache_out(f"the good sequences {good} beside a bad {which}", out[good], None if lse is None else lse[good],
                       ref, low, p["alibi"])  # fmt: skip


BAD_VARLEN_MATCH = {
    "start": "start at 0 and be non-decreasing",
    "decrease": "start at 0 and be non-decreasing",
    "past": "past the",
    "longest": "exceeds max_seqlen",
    "block_table": "block_table entries",
}


def _run_bad_varlen(p, gen, device):
    fn = "varlen_paged" if p["paged"] else "varlen"
    lq, lk = p["lengths_q"], p["lengths_k"]
    n = len(lq)

    def corrupt(args, kwargs, cu_q, cu_k, tq, tk):
        args = list(args)
        which = p["bad"][0]
        if which == "block_table":
            _, b, (j, value) = p["bad"]
            table = kwargs["block_table"].clone()
            table[b, j] = args[1].shape[0] if value is None else value
            kwargs = kwargs | {"block_table": table}
            bad, kind, ranges = {b}, "block_table", []
        else:
            _, kind, i, amount = p["bad"]
            side = 0 if which == "cu_seqlens_q" else 1
            cu = (cu_q, cu_k)[side].clone()
            rows = tq if side == 0 else tk
            if p["paged"] and side == 1:  # a paged call's keys: each sequence's block-table capacity
                rows = n * kwargs["block_table"].shape[1] * args[1].shape[1]
            if kind == "start":
                cu[0] = amount
            elif kind == "decrease":
                cu[i] = cu[i - 1] - amount
            elif kind == "past":
                cu[-1] = rows + amount
            else:
                args[5 + side] = max((lq, lk)[side]) - 1
            args[3 + side] = cu
            bad = {x for x in (i - 1, i) if 0 <= x < n} if kind != "longest" else set()
            values = cu.clamp(0, rows).tolist()
            ranges = [(min(values[x], values[x + 1]), max(values[x], values[x + 1])) for x in bad] if side == 0 else []
            ranges += [(values[-1], tq)] if side == 0 else []
        if p["checks"]:
            call = lambda: flashattn2.flash_attn_varlen_func(*args, **kwargs)  # noqa: E731
            _raises(p, call, BAD_VARLEN_MATCH[kind])
            return args, kwargs, None
        starts = cu_of(lq, "cpu").tolist()
        overlaps = lambda x: any(s < starts[x + 1] and starts[x] < e for s, e in ranges)  # noqa: E731
        return args, kwargs, [x for x in range(n) if x not in bad and not overlaps(x)]

    _run_varlen(fn, p, gen, device, bad=corrupt)


RUN = {
    "func": _run_dense,
    "qkvpacked": _run_dense,
    "kvpacked": _run_dense,
    "varlen": _run_varlen,
    "varlen_qkvpacked": _run_varlen,
    "varlen_kvpacked": _run_varlen,
    "varlen_paged": _run_varlen,
    "kvcache": lambda fn, p, gen, device: _run_kvcache(p, gen, device),
    "bad_kvcache": lambda fn, p, gen, device: _run_bad_kvcache(p, gen, device),
    "bad_varlen": lambda fn, p, gen, device: _run_bad_varlen(p, gen, device),
}


def run(case: Case, device) -> None:
    """Run one case: its call(s) and the checks against the reference; AssertionError (or the call's own error) on a
    failure. Unwritten outputs read NaN (_runtime.POISON), as in the tests."""
    torch.manual_seed(case.seed)  # dropout's Philox seed
    gen = torch.Generator(device=device).manual_seed(case.seed)
    poison, _runtime.POISON = _runtime.POISON, True
    try:
        RUN[case.fn](case.fn, case.p, gen, device)
    finally:
        _runtime.POISON = poison


def fuzz(seed: int, seconds: float, sizes: Sizes, device, log=print, functions=None, first: int = 0):
    """Cases seed:first, seed:first+1, ... until `seconds` of wall time have passed, each run whatever the others did:
    (the number run, [(index, case, error)] of those that failed, each logged as it fails)."""
    failures, start, index = [], time.monotonic(), first
    while time.monotonic() - start < seconds:
        case = draw(seed, index, sizes, functions)
        try:
            run(case, device)
        except Exception as e:  # a failure of any kind is the case's: report it and go on
            failures.append((index, case, e))
            log(f"FAILED case {seed}:{index} ({type(e).__name__}: {e})\n  {case}")
        index += 1
    return index - first, failures
