"""flash_attn 2.x's functional API on flashattn2's kernels.

Layout is (batch, seqlen, nheads, headdim), only the last dimension needs to be contiguous.
Causal masking is aligned to the bottom-right corner of the score matrix: with
seqlen_q != seqlen_k, query i sees keys j <= i + seqlen_k - seqlen_q, so for seqlen_q=2,
seqlen_k=5 the mask rows are 1 1 1 1 0 / 1 1 1 1 1. A query row that sees no key (possible when
seqlen_q > seqlen_k, or with seqlen_k 0, which the dense calls accept as flash_attn does) outputs zeros
and has logsumexp +inf.
"""

from __future__ import annotations

import torch

from .errors import ArgumentError
from .ops.run import call as calls
from .ops.request import cache_checks, checks
from .ops.launch.kvcache import drop_flag, value_check
from .ops.request import request
from .ops.launch.layout import ForwardTensors
from .ops.request.options import Options
from .ops.request.request import AttentionRequest, KVCacheRequest
from .ops.run.registry import EmptyAttention, PackedAttention, for_kernels, kvcache_forward, paged_forward
from .ops.run.registry import fwd_kvcache as registry_fwd_kvcache
from .ops.run.registry import dropout_probs as _dropout_probs_op
from .ops.run.registry import forward as _forward
from .ops.run.registry import fwd_varlen_paged as _fwd_varlen_paged_op
from .ops.run.registry import run as _run


_new = tuple.__new__  # a request (tests/test_request.py) or the forward's tensors in their fields' order


def _seed(call, q) -> torch.Tensor | None:
    """The Philox seed of a call with dropout, drawn from torch's generator for q's device (torch.manual_seed makes
    runs reproducible; the backward reuses it); None without dropout."""
    if call.options.dropout_p > 0:
        return torch.randint(2**62, (1,), dtype=torch.int64, device=q.device)
    return None


def _traced(r: AttentionRequest):
    """While torch.compile traces: the request validated and the op (flashattn2::fwd) called, with its registered
    backward (no caches: dynamo would trace them)."""
    r = calls.validate_attention(r)
    seed = torch.randint(2**62, (1,), dtype=torch.int64, device=r.q.device) if r.dropout_p > 0 else None
    scale = float(r.q.shape[-1] ** -0.5 if r.softmax_scale is None else r.softmax_scale)
    options = Options(
        cu_seqlens_q=r.cu_seqlens_q, cu_seqlens_k=r.cu_seqlens_k, max_seqlen_q=r.max_seqlen_q,
        max_seqlen_k=r.max_seqlen_k, dropout_p=r.dropout_p, seed=seed, softmax_scale=scale, causal=r.causal,
        window_left=r.window_size[0], window_right=r.window_size[1], softcap=r.softcap,
    )  # fmt: skip
    return _forward(r.q, r.k, r.v, options, r.alibi_slopes, r.learnable_sink), options


def _empty_s_dmask(out):
    return torch.empty(0, dtype=out.dtype, device=out.device)


def _result(r: AttentionRequest, out, lse, call=None, cu=(None, None), seed=None):
    """What the call returns: out, or with return_attn_probs (out, lse, S_dmask)."""
    if not r.return_attn_probs:
        return out
    if call is None or call.options.dropout_p == 0:
        # S_dmask is only materialised with dropout (flash_attn's rule); without it, an empty tensor
        return out, lse, _empty_s_dmask(out)
    q, k = r.q, r.k
    if call.empty:
        rounded = lambda n: -(-n // 128) * 128
        shape = (q.shape[0], q.shape[2], rounded(q.shape[1]), rounded(k.shape[1]))
        return out, lse, torch.zeros(shape, dtype=out.dtype, device=out.device)
    options = call.options.with_tensors(*cu, seed)
    with torch.no_grad():
        s_dmask = _dropout_probs_op(q.detach(), k.detach(), *options.op_args(), r.alibi_slopes)
    return out, lse, s_dmask


def _for_kernels(q, k, v, packed, packing: str | None, dim: int):
    """q, k, v (and the packed tensor they view) as the kernels take them: the last dimension contiguous and no
    broadcast dimension (ops.run.registry.for_kernels; else a copy, through which autograd carries the gradient)."""
    if packing is None:
        try:
            return for_kernels(q), for_kernels(k), for_kernels(v), None
        except AttributeError:  # a non-tensor: the checks name it
            checks.check_qkv(q, k, v, varlen=dim == 1)
            raise
    ready = for_kernels(packed)
    if ready is not packed:
        if packing == "qkv":
            q, k, v = ready.unbind(dim)
        else:
            k, v = ready.unbind(dim)
    return (q if packing == "qkv" else for_kernels(q)), k, v, ready


def _ready_call(r: AttentionRequest, packing: str | None):
    """The prepared call of a request's unpacked q, k, v as given, which proves them as the kernels take them
    (ops.run.call.NotReady); None where they are packed or must be made so first (_for_kernels)."""
    if packing is not None:
        return None
    try:
        return calls.attention(r)
    except calls.NotReady:
        return None


def _no_fp8(what: str, q, descale) -> None:
    """NotImplementedError for FP8 inputs (or descales) where `what` has no FP8 path."""
    if getattr(q, "dtype", None) == checks.E4M3 or any(d is not None for d in descale):
        raise NotImplementedError(f"FP8 inputs (float8_e4m3fn, q_descale/k_descale/v_descale) with {what}")


def _fp8_packing(q, descale, packing):
    """An FP8 call's packed forms run as q, k, v views (no gradient to pack)."""
    if q.dtype == checks.E4M3 or descale != (None, None, None):
        return None
    return packing


def _dense(r: AttentionRequest, packed=None, packing: str | None = None):
    """flash_attn_func and its packed forms: the request's q, k, v (views of `packed` when packing is "qkv" or
    "kv")."""
    q, descale = r.q, (r.q_descale, r.k_descale, r.v_descale)
    packing = _fp8_packing(q, descale, packing) if packing is not None else None
    if torch.compiler.is_compiling():
        _no_fp8("torch.compile", q, descale)
        (out, lse), _ = _traced(r)
        return out if not r.return_attn_probs else (out, lse, _empty_s_dmask(out))
    call = _ready_call(r, packing)
    if call is None:
        q, k, v, packed = _for_kernels(q, r.k, r.v, packed, packing, 2)
        if q is not r.q or k is not r.k or v is not r.v:
            r = request.with_qkv(r, q, k, v)
        call = calls.attention(r)
    seed = _seed(call, q)
    alibi_slopes, sink, lse_wanted = r.alibi_slopes, r.learnable_sink, r.return_attn_probs
    if call.empty:
        out, lse = EmptyAttention.apply(q, r.k, r.v, sink)
    elif packing is None:
        t = _new(ForwardTensors, (q, r.k, r.v, None, None, alibi_slopes, sink, seed, descale))
        out, lse = _run(call, t, lse_wanted=lse_wanted)
    else:
        first = None if packing == "qkv" else q
        out, lse = PackedAttention.apply(call, packing, first, packed, None, None, alibi_slopes, sink, seed)
    if not lse_wanted:
        return out
    return _result(r, out, lse, call, seed=seed)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Exact softmax attention, softmax(q k^T * softmax_scale) v, with FlashAttention-2.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads must be a
            multiple of nheads_k (MQA/GQA: query head h uses K/V head h // (nheads // nheads_k)).
        dropout_p: attention dropout probability in [0, 1) (Philox, seeded from torch's generator,
            so torch.manual_seed makes runs reproducible; not combinable with softcap).
        softmax_scale: scaling of q k^T, default headdim ** -0.5.
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: (left, right) sliding window, -1 for unbounded: query i sees keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; causal=True
            sets right = 0. Key blocks outside the window are skipped.
        softcap: > 0 turns the scaled scores into softcap * tanh(scores / softcap).
        alibi_slopes: float32 (nheads,) or (batch, nheads): the bias
            -slope * |i + seqlen_k - seqlen_q - j| is added to the scores (after softcap).
        deterministic: True always gives the deterministic backward (dQ in its own pass, no
            atomics: bitwise-identical gradients run to run). False (flash_attn's default) lets an
            H100/H200 take the Gluon backward (unless FLASHATTN2_HOPPER=0): dQ added in any
            order, so its last bits may move run to run (README, "deterministic"). Under
            torch.compile the backward is the deterministic one either way.
        return_attn_probs: also return the logsumexp and S_dmask (empty without dropout).
        learnable_sink (keyword-only): float32 (nheads,), an attention sink: one logit per query head that
            joins every row's softmax denominator and has no value (gpt-oss's sinks, FA4's learnable_sink):
            out_i = sum_j exp(s_ij - L_i) v_j with L_i = log(exp(sink_h) + sum_j exp(s_ij)). The returned
            logsumexp is L (a row that sees no key: out 0, logsumexp sink_h); the backward gives its gradient
            -sum_{batch, i} exp(sink_h - L_i) * (rowsum(dout_i * out_i) - dlse_i). Composes with every other
            option; S_dmask does not include it.
        q_descale, k_descale, v_descale (keyword-only; FA3's FP8 forward): with float8_e4m3fn q, k, v, float32
            (batch, nheads_k) descales, None meaning 1: the scores are (q * q_descale)(k * k_descale)^T *
            softmax_scale and the values v * v_descale, query head h taking kv head h // (nheads // nheads_k)'s.
            The output is bf16; P meets V rounded to e4m3 where the GPU's dots take e4m3 (sm_89 on; head dims from
            32), in bf16 on sm_80/86 and in the batch-invariant mode (README, "FP8"). Forward only (a gradient raises NotImplementedError), no dropout; every other
            option composes. Given with other dtypes: ArgumentError.
    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype (bf16 for FP8 inputs).
        softmax_lse (with return_attn_probs): (batch, nheads, seqlen_q) float32, the natural
            logsumexp of each row of q k^T * softmax_scale (+inf for a row that sees no key).
            It is differentiable.
        S_dmask (with return_attn_probs): an empty tensor without dropout; with dropout,
            (batch, nheads, round128(seqlen_q), round128(seqlen_k)) in q's dtype holding
            exp(score - rowmax) where kept and -exp(score - rowmax) where dropped (0 outside the
            visible region), a testing aid computed by a second pass.
    """
    return _dense(
        _new(
            AttentionRequest,
            (q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             deterministic, return_attn_probs, None, learnable_sink, q_descale, k_descale, v_descale),
        )
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim); the backward writes one dqkv.

    Other arguments and the return value are those of flash_attn_func.
    """
    checks.check_packed("qkv", qkv, 3)
    q, k, v = qkv.unbind(dim=2)
    r = _new(
        AttentionRequest,
        (q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, None, learnable_sink, q_descale, k_descale, v_descale),
    )  # fmt: skip
    return _dense(r, qkv, "qkv")


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash_attn_func on q (batch, seqlen_q, nheads, headdim) and kv (batch, seqlen_k, 2,
    nheads_k, headdim); the backward writes one dkv. Other arguments as flash_attn_func."""
    checks.check_packed("kv", kv, 2)
    k, v = kv.unbind(dim=2)
    r = _new(
        AttentionRequest,
        (q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, None, learnable_sink, q_descale, k_descale, v_descale),
    )  # fmt: skip
    return _dense(r, kv, "kv")


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash_attn_func on sequences of different lengths packed along the first dimension.

    Arguments:
        q: (total_q, nheads, headdim); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1].
        k, v: (total_k, nheads_k, headdim), likewise with cu_seqlens_k.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), starting at 0, non-decreasing (a
            sequence may be empty). Rows past cu_seqlens[-1] belong to no sequence: their
            output and gradient are 0 (logsumexp +inf).
        max_seqlen_q, max_seqlen_k: int (or a one-element tensor) >= every sequence's length.
        Causal alignment, window, softcap and ALiBi apply per sequence (alibi_slopes may be
        (batch, nheads) with batch = len(cu_seqlens) - 1). Other arguments as flash_attn_func.
        block_table: int32 (batch, max_blocks) for a paged K/V: k/v are then (num_blocks,
            page_size, nheads_k, headdim), any page size, and sequence b's keys are its first
            cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions through block_table[b]. Forward
            only, as flash_attn: no dropout; inputs may require grad, but a backward through the
            call raises NotImplementedError.
    Returns:
        out (total_q, nheads, headdim); with return_attn_probs also softmax_lse (nheads,
        total_q) float32 and an empty S_dmask.
    The cu_seqlens values are checked on the host after the kernels are queued, from a copy that
    does not wait for them (outside torch.compile).
    """
    r = _new(
        AttentionRequest,
        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
         window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, learnable_sink, q_descale,
         k_descale, v_descale),
    )  # fmt: skip
    if block_table is not None:
        _no_fp8("block_table (a paged K/V in flash_attn_varlen_func)", q, r.descales)
        return _varlen_paged(r)
    return _varlen(r)


def _varlen(r: AttentionRequest, packed=None, packing: str | None = None):
    """flash_attn_varlen_func and its packed forms. The cu_seqlens values are checked on the host (value checks on)
    after the kernels are queued, from a copy that does not wait for them."""
    descale = r.descales
    q, k, v, cu_seqlens_q, cu_seqlens_k = r.q, r.k, r.v, r.cu_seqlens_q, r.cu_seqlens_k
    packing = _fp8_packing(q, descale, packing) if packing is not None else None
    if torch.compiler.is_compiling():
        _no_fp8("torch.compile", q, descale)
        checks.check_cu_tensors(cu_seqlens_q, cu_seqlens_k, q)
        max_q, max_k = checks.max_seqlens(r.max_seqlen_q, r.max_seqlen_k)
        cu_q, cu_k, _ = calls.sequences(cu_seqlens_q, cu_seqlens_k, max_q, max_k, q, k)  # clamped, nothing read
        (out, lse), _ = _traced(
            r._replace(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        )
        return out if not r.return_attn_probs else (out, lse, _empty_s_dmask(out))
    call = _ready_call(r, packing)
    if call is None:
        q, k, v, packed = _for_kernels(q, k, v, packed, packing, 1)
        if q is not r.q or k is not r.k or v is not r.v:
            r = request.with_qkv(r, q, k, v)
        call = calls.attention(r)
    o = call.options
    cu_q, cu_k, verify = calls.sequences(cu_seqlens_q, cu_seqlens_k, o.max_seqlen_q, o.max_seqlen_k, q, k)
    seed = _seed(call, q)
    alibi_slopes, sink, lse_wanted = r.alibi_slopes, r.learnable_sink, r.return_attn_probs
    if packing is None:
        t = _new(ForwardTensors, (q, k, v, cu_q, cu_k, alibi_slopes, sink, seed, descale))
        out, lse = _run(call, t, lse_wanted=lse_wanted)
    else:
        first = None if packing == "qkv" else q
        out, lse = PackedAttention.apply(call, packing, first, packed, cu_q, cu_k, alibi_slopes, sink, seed)
    verify()
    if not lse_wanted:
        return out
    return _result(r, out, lse, call, (cu_q, cu_k), seed)


def _varlen_paged(r: AttentionRequest):
    """flash_attn_varlen_func with a paged K/V (prefill over a paged cache): forward only."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, block_table = r.q, r.k, r.v, r.cu_seqlens_q, r.cu_seqlens_k, r.block_table
    learnable_sink = r.learnable_sink
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    if grad or torch.compiler.is_compiling():  # the custom op: torch.compile's path; autograd's (its backward raises)
        checks.check_options(r.dropout_p, r.softmax_scale, r.window_size, r.softcap)
        checks.check_sink(learnable_sink, q)
        max_q, max_k = cache_checks.check_varlen_paged(r)
        out, lse = _fwd_varlen_paged_op(*request.op_args(r._replace(max_seqlen_q=max_q, max_seqlen_k=max_k)))
    else:
        call = calls.paged(r)
        spec = call.spec
        cu_q = cache_checks.paged_sequences(
            q, k, cu_seqlens_q, cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k, block_table
        )
        out, lse = paged_forward(call, r, cu_q)
    if not r.return_attn_probs:
        return out
    return out, lse, _empty_s_dmask(out)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash_attn_varlen_func on qkv (total, 3, nheads, headdim); the backward writes one dqkv."""
    checks.check_packed("qkv", qkv, 3, varlen=True)
    q, k, v = qkv.unbind(dim=1)
    r = _new(
        AttentionRequest,
        (q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
         softcap, alibi_slopes, deterministic, return_attn_probs, None, learnable_sink, q_descale, k_descale,
         v_descale),
    )  # fmt: skip
    return _varlen(r, qkv, "qkv")


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash_attn_varlen_func on q (total_q, nheads, headdim) and kv (total_k, 2, nheads_k,
    headdim); the backward writes one dkv."""
    checks.check_packed("kv", kv, 2, varlen=True)
    k, v = kv.unbind(dim=1)
    r = _new(
        AttentionRequest,
        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
         window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None, learnable_sink, q_descale,
         k_descale, v_descale),
    )  # fmt: skip
    return _varlen(r, kv, "kv")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention over a KV cache, for decoding and chunked prefill (inference: no backward).

    If k and v (batch, seqlen_new, nheads_k, headdim) are given, they are written into k_cache /
    v_cache in place at positions cache_seqlens[b] .. + seqlen_new (k rotated first when
    rotary_cos/sin are given), and attention then runs over the updated cache.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); nheads a multiple of nheads_k (the query heads of a
            group are processed in one pass over their K/V).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_size, nheads_k, headdim) for any page size.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype. The new k is rotated at
            positions cache_seqlens + i; q at the same positions when causal or local, else all
            of q at position cache_seqlens. rotary_interleaved: GPT-J pairs (True) or GPT-NeoX
            halves (False).
        cache_seqlens: int, or int32 (batch,): the tokens already in each cache row (None: the
            whole cache is valid, nothing can be appended).
        cache_batch_idx: int32 (batch,): the cache row of each sequence (contiguous cache).
        cache_leftpad: int32 (batch,): each sequence's keys start at this cache position.
        block_table: int32 (batch, max_blocks): the pages of each sequence.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as flash_attn_func; causal
            and windows are aligned to the bottom-right corner (the last query sees the last key).
        num_splits: split each sequence's keys over this many programs and merge the partial
            results; 0 chooses from the GPU's size, 1 disables splitting.
        return_softmax_lse: also return the logsumexp (batch, nheads, seqlen_q), float32.
        learnable_sink (keyword-only): float32 (nheads,), as flash_attn_func's; with splits it joins once, when
            they are merged.
        q_descale, k_descale, v_descale (keyword-only; FA3's FP8 arguments): float32 (batch, nheads_k) or None (1),
            row b and kv head h scaling sequence b's q, k_cache and v_cache values of head h (the call's batch row,
            not its cache_batch_idx row). An FP8 cache is k_cache and v_cache in float8_e4m3fn: the value meant is
            code * descale. q is float8_e4m3fn with q_descale (the output bf16) or in 16 bits (the output in q's
            dtype); new k/v in float8_e4m3fn are written as they are, in q's dtype (bf16 or fp16 for an FP8 q)
            they are written as e4m3(k / k_descale), saturating at +-448, k after rotary. Rotary needs q and k in
            16 bits. A descale given for a tensor that is not FP8 raises.
    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse).

    With block_table, the largest cache_seqlens plus the new tokens must fit the pages
    (max_num_blocks_per_seq * page_size), or the call raises RuntimeError naming block_table:
    flash_attn's one check of a paged call, one read of cache_seqlens' maximum (a host sync; not
    made while torch.compile traces or a CUDA graph is captured, where the kernels' guard below
    holds). The other values of cache_seqlens, cache_batch_idx, cache_leftpad and block_table
    are not read back, and flash_attn does not check them either; a value
    out of range writes nothing that another index names: the append drops a write whose
    target is out of range (all of a sequence's tokens when its cache_batch_idx is; a token whose
    position cache_seqlens + i lies outside [0, capacity), or whose block_table entry does not
    exist), never clamping it onto a real row, page or slot, and cache_leftpad never steers a
    write; the attention reads the values clamped into range, so the bad sequence's output is
    silently wrong and the others' are unchanged. With set_value_checks(True), eager calls are
    checked by the kernels: the append writes nothing when a value is out of range, and the call
    then raises ValueError (the host reads one flag after the launches, so the call waits for
    its kernels).
    """
    r = _new(
        KVCacheRequest,
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
         softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
         learnable_sink, q_descale, k_descale, v_descale),
    )  # fmt: skip
    if torch.compiler.is_compiling():
        out, lse = _traced_kvcache(r)
        return (out, lse) if return_softmax_lse else out
    call = calls.kvcache(r)
    if isinstance(cache_seqlens, torch.Tensor):
        if block_table is not None and not checks.value_checks():  # (with them, the kernels' check says more)
            cache_checks.check_block_table_capacity(cache_seqlens, call.capacity, 0 if k is None else k.shape[1])
    else:  # an int is checked here (no device read); the tensors' values by the kernels
        call.seqlen(cache_seqlens, rotary_cos)
        if cache_batch_idx is None and cache_leftpad is None and block_table is None:
            out, lse = kvcache_forward(call, r)
            return (out, lse) if return_softmax_lse else out
    if not checks.value_checks():
        out, lse = kvcache_forward(call, r)
        return (out, lse) if return_softmax_lse else out
    check = value_check(q, call.capacity, k, rotary_cos, call.q_positions)
    if check is not None and k is None and q.shape[0] * q.shape[1] == 0:
        cache_checks.check_kvcache_values(r, call.q_positions)  # no kernel will run to check them
        check = None
    if check is None:
        out, lse = kvcache_forward(call, r)
        return (out, lse) if return_softmax_lse else out
    try:
        out, lse = kvcache_forward(call, r, check)
        bad = bool(check.err.item())
    except BaseException:
        drop_flag(check.key)  # the flag may be set: drop it (the next call makes a new one)
        raise
    if bad:
        check.err.zero_()  # the flag is reused by the next call on this stream
        cache_checks.check_kvcache_values(r, call.q_positions)  # raises with the details
        raise ArgumentError("cache_seqlens, cache_leftpad, cache_batch_idx or block_table holds a value out of range")
    return (out, lse) if return_softmax_lse else out


def _traced_kvcache(r: KVCacheRequest):
    """While torch.compile traces: validated, then the op (flashattn2::fwd_kvcache), which declares that it writes
    k_cache and v_cache."""
    cache_checks.check_kvcache(r)
    checks.check_sink(r.learnable_sink, r.q)
    checks.check_options(0.0, r.softmax_scale, r.window_size, r.softcap)
    return registry_fwd_kvcache(*request.op_args(r))


def set_kvcache_checks(enabled: bool) -> bool:
    """The earlier name of set_value_checks, which covers these tensors and cu_seqlens: whether
    eager calls check the values of cache_seqlens, cache_leftpad, cache_batch_idx and
    block_table (and cu_seqlens). Returns the previous setting."""
    return checks.set_value_checks(enabled)
