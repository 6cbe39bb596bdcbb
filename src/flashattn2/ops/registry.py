"""torch.library registration: `flashattn2::fwd` (functional, differentiable) and
`flashattn2::bwd` (writes dq, dk, dv in place, so packed callers can pass views of one tensor).
Both have fake implementations, so torch.compile traces them without a graph break."""

from __future__ import annotations

import torch

from . import _runtime, attention, invariance, kvcache, planning
from .geometry import Varlen
from .options import N_OP_ARGS, Options, ScoreMods


def _for_kernels(t: torch.Tensor) -> torch.Tensor:
    """Last dimension contiguous and no broadcast (stride-0) dimension: what the kernels and TMA
    descriptors accept. A gradient of out.sum() arrives expanded, with stride 0."""
    s = t.stride()
    if s[-1] != 1 or 0 in s:
        return t.contiguous()
    return t


def _mods(causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, sinks=None) -> ScoreMods:
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    return ScoreMods(causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, sinks)


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Varlen | None:
    if cu_seqlens_q is None:
        return None
    return Varlen.of(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k)


def fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    seed: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flashattn2::fwd: dense q (batch, seqlen_q, nheads, d), or varlen q (total_q, nheads, d) with
    cu_seqlens; (out, lse). Eager callers run this body directly: the op's dispatch costs tens of
    microseconds of host time per call and only torch.compile needs it (run_fwd chooses)."""
    q, k, v = (_for_kernels(t) for t in (q, k, v))
    mods = _mods(causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, learnable_sink)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with _runtime.device_of(q):
        return attention.forward(q, k, v, softmax_scale, mods, varlen)


fwd = torch.library.custom_op("flashattn2::fwd", fwd_impl, mutates_args=())


def run_fwd(*args):
    """fwd's arguments: the op while torch.compile traces, its body otherwise."""
    return fwd(*args) if torch.compiler.is_compiling() else fwd_impl(*args)


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, *_):
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads, _ = q.shape
        lse_shape = (batch, nheads, seqlen_q)
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(lse_shape, dtype=torch.float32)


def bwd_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    seed: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    learnable_sink: torch.Tensor | None,
    dsink: torch.Tensor | None,
    deterministic: bool = True,
) -> None:
    """flashattn2::bwd: writes dq, dk, dv, and with learnable_sink its gradient into dsink (fp32 (nheads,))
    (see fwd_impl for eager callers). deterministic=False lets a Hopper GPU take the Gluon backward (dQ added in
    any order). (dsink, a mutated argument, has no default: the dispatcher drops trailing arguments equal to
    their defaults, and a mutated one dropped breaks torch 2.11's in-place bookkeeping.)"""
    dout, q, k, v, out = (_for_kernels(t) for t in (dout, q, k, v, out))
    lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.contiguous()
    mods = _mods(causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, learnable_sink)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with _runtime.device_of(q):
        attention.backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, softmax_scale, mods, varlen, deterministic, dsink)


bwd = torch.library.custom_op("flashattn2::bwd", bwd_impl, mutates_args=("dq", "dk", "dv", "dsink"))


def run_bwd(*args):
    """bwd's arguments: the op while torch.compile traces, its body otherwise."""
    return bwd(*args) if torch.compiler.is_compiling() else bwd_impl(*args)


@bwd.register_fake
def _(*_):
    return None


@torch.library.custom_op("flashattn2::dropout_probs", mutates_args=())
def dropout_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    seed: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """S_dmask for the dropout mask fwd drew with the same seed (forward only, a testing aid)."""
    q, k = _for_kernels(q), _for_kernels(k)
    mods = _mods(causal, window_left, window_right, softcap, alibi_slopes, dropout_p, seed)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with _runtime.device_of(q):
        return attention.dropout_probs(q, k, softmax_scale, mods, varlen)


@dropout_probs.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_):
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    seqlen_q = q.shape[1] if cu_seqlens_q is None else max_seqlen_q
    seqlen_k = k.shape[1] if cu_seqlens_q is None else max_seqlen_k
    round128 = lambda n: -(-n // 128) * 128
    return q.new_empty((batch, q.shape[-2], round128(seqlen_q), round128(seqlen_k)))


def _save(ctx, q, k, v, out, lse, alibi_slopes, sink, options: Options) -> None:
    """What a backward needs: the tensors, the options, and the forward's planning.force() state (the backward
    runs in autograd's thread, which does not see it)."""
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sink, *options.tensors())
    ctx.options = options.without_tensors()
    # (torch.compile traces this, and not ContextVar.get: its backward is the op's, planned where it runs)
    ctx.forced = None if torch.compiler.is_compiling() else planning.forced()


def _setup_context(ctx, inputs, output):
    q, k, v, *args, alibi_slopes, sink = inputs
    _save(ctx, q, k, v, *output, alibi_slopes, sink, Options(*args))


def invariant() -> bool:
    """Whether the batch-invariant mode is on, for a backward (the deterministic one in the mode): the autograd
    functions ask in their forward (the caller's thread, which sees a batch_invariant() block), the private
    _flash_attn_*_backward functions where they are called. Under torch.compile the backward is the deterministic one
    anyway, and dynamo cannot read a context variable."""
    return not torch.compiler.is_compiling() and invariance.enabled()


def _saved(ctx):
    """What _save saved: (q, k, v, out, lse, alibi_slopes, sink, options)."""
    q, k, v, out, lse, alibi_slopes, sink, *tensors = ctx.saved_tensors
    return q, k, v, out, lse, alibi_slopes, sink, ctx.options.with_tensors(*tensors)


def _dsink(sink: torch.Tensor | None) -> torch.Tensor | None:
    """The sink's gradient buffer (fp32, its shape) the backward writes, or None without a sink."""
    return None if sink is None else _runtime.empty(sink.shape, torch.float32, sink.device)


def _backward(ctx, dout, dlse, backward_op=None, deterministic=True):
    q, k, v, out, lse, alibi_slopes, sink, options = _saved(ctx)
    dout = _grad_of_out(dout, out)
    dq, dk, dv = _runtime.empty_like(q), _runtime.empty_like(k), _runtime.empty_like(v)
    dsink = _dsink(sink)
    with planning.entered(ctx.forced):
        (backward_op or bwd)(
            dout, q, k, v, out, lse, dlse, dq, dk, dv, *options.op_args(), alibi_slopes, sink, dsink, deterministic
        )
    return dq, dk, dv, *(None,) * (1 + N_OP_ARGS), dsink


fwd.register_autograd(_backward, setup_context=_setup_context)


def _grad_of_out(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The output's gradient; zeros when only the logsumexp received one. (The autograd.Functions
    below do not materialize missing gradients: a training step's unused logsumexp then costs no
    zero-filled tensor, and the preprocess reads no lse gradient.)"""
    return torch.zeros_like(out) if dout is None else dout


class Attention(torch.autograd.Function):
    """fwd's body and bwd's through an autograd.Function: the API's eager path (no dispatcher, no
    per-call autograd wrapper). The op's own register_autograd serves torch.compile and direct
    callers of torch.ops.flashattn2.fwd (those backwards are deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sink, deterministic, options: Options):
        out, lse = run_fwd(q, k, v, *options.op_args(), alibi_slopes, sink)
        _save(ctx, q, k, v, out, lse, alibi_slopes, sink, options)
        ctx.deterministic = deterministic or invariant()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = _backward(ctx, dout, dlse, run_bwd, ctx.deterministic)
        return *grads[:3], None, grads[-1], None, None


class EmptyAttention(torch.autograd.Function):
    """Dense attention with no query or no key position (seqlen_q or seqlen_k 0), which flash_attn
    accepts: out zeros, lse +inf (rows that see no key; with a sink, the sink's logit), gradients zeros
    (the sink's: the lse gradient summed over batch and rows, since lse = sink there). No kernel runs."""

    @staticmethod
    def forward(ctx, q, k, v, sink=None):
        ctx.save_for_backward(q, k, v, sink)
        ctx.set_materialize_grads(False)
        shape = (q.shape[0], q.shape[2], q.shape[1])
        if sink is None:
            lse = torch.full(shape, float("inf"), dtype=torch.float32, device=q.device)
        else:
            lse = sink.detach().float()[:, None].expand(shape).contiguous()
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink = ctx.saved_tensors
        dsink = None
        if sink is not None:
            dsink = torch.zeros_like(sink) if dlse is None else dlse.sum(dim=(0, 2)).to(sink.dtype)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink


class PackedAttention(torch.autograd.Function):
    """Attention over packed inputs whose backward writes one packed gradient (no concat).

    packing "qkv": `packed` is qkv (..., 3, nheads, headdim) and `q` is None; packing "kv":
    `packed` is kv (..., 2, nheads_k, headdim) beside `q`. The packed dimension is 2 for dense
    (batch, seqlen, ...) inputs and 1 for varlen (total, ...) ones.
    """

    @staticmethod
    def forward(ctx, q, packed, alibi_slopes, sink, packing, deterministic, options: Options):
        dim = 1 if options.varlen else 2
        if packing == "qkv":
            q, k, v = packed.unbind(dim=dim)
        else:
            k, v = packed.unbind(dim=dim)
        out, lse = run_fwd(q, k, v, *options.op_args(), alibi_slopes, sink)
        _save(ctx, q, k, v, out, lse, alibi_slopes, sink, options)
        ctx.packing, ctx.dim, ctx.deterministic = packing, dim, deterministic or invariant()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, sink, options = _saved(ctx)
        dim = ctx.dim
        dsink = _dsink(sink)
        if ctx.packing == "qkv":
            dpacked = _runtime.empty((*q.shape[:dim], 3, *q.shape[dim:]), q.dtype, q.device)
            dq, dk, dv = dpacked.unbind(dim=dim)
        else:
            dq = _runtime.empty_like(q)
            dpacked = _runtime.empty((*k.shape[:dim], 2, *k.shape[dim:]), k.dtype, k.device)
            dk, dv = dpacked.unbind(dim=dim)
        with planning.entered(ctx.forced):
            run_bwd(
                _grad_of_out(dout, out),
                q,
                k,
                v,
                out,
                lse,
                dlse,
                dq,
                dk,
                dv,
                *options.op_args(),
                alibi_slopes,
                sink,
                dsink,
                ctx.deterministic,
            )
        return (None if ctx.packing == "qkv" else dq), dpacked, None, dsink, None, None, None


def fwd_kvcache_impl(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_seqlen_int,
    cache_batch_idx,
    cache_leftpad,
    block_table,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    learnable_sink=None,
    check=None,
):
    """The body of flashattn2::fwd_kvcache (eager callers run it directly, see fwd_impl). check:
    a kvcache.Check (eager calls only), set when a cache tensor holds a value out of range."""
    with _runtime.device_of(q):
        cache = kvcache.Cache(
            k_cache,
            v_cache,
            _contiguous(cache_seqlens),
            cache_seqlen_int,
            _contiguous(cache_batch_idx),
            _contiguous(cache_leftpad),
            _contiguous(block_table),
        )
        rotary = None if rotary_cos is None else (rotary_cos.contiguous(), rotary_sin.contiguous(), rotary_interleaved)
        seqlen_new = 0
        if k is not None:
            kvcache.append_(cache, k, v, rotary, check)
            seqlen_new = k.shape[1]
            if rotary is not None:
                q = kvcache.rotate_q(q, cache, rotary, per_token=causal or window_left >= 0 or window_right >= 0)
        mods = _mods(causal, window_left, window_right, softcap, alibi_slopes, 0.0, None, learnable_sink)
        # an append that ran checked every value the attention reads (pages included)
        appended = k is not None and k.shape[0] * k.shape[1] > 0
        return kvcache.forward(
            _for_kernels(q), cache, seqlen_new, softmax_scale, mods, num_splits, check=None if appended else check
        )


@torch.library.custom_op("flashattn2::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    cache_seqlen_int: int,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k/v into k_cache/v_cache in place (k rotated), then attention of q (rotated) over
    the cache: (out, lse). Arguments as flash_attn_with_kvcache, validated by the API; an int
    cache_seqlens travels as cache_seqlen_int with cache_seqlens None."""
    return fwd_kvcache_impl(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_seqlen_int,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        softmax_scale,
        causal,
        window_left,
        window_right,
        softcap,
        rotary_interleaved,
        alibi_slopes,
        num_splits,
        learnable_sink,
    )


def run_fwd_kvcache(*args, check=None):
    """fwd_kvcache's arguments: the op while torch.compile traces (check is then None), its body
    otherwise."""
    return fwd_kvcache(*args) if torch.compiler.is_compiling() else fwd_kvcache_impl(*args, check=check)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, *_):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashattn2::fwd_varlen_paged", mutates_args=())
def fwd_varlen_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func over a paged K/V (forward only): q (total_q, nheads, headdim),
    k_cache/v_cache (num_blocks, page_size, nheads_k, headdim), sequence b's keys are its first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions through block_table[b]. (out, lse (nheads, total_q))."""
    with _runtime.device_of(q):
        cu_k = cu_seqlens_k.contiguous()
        seqlens_k = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        cache = kvcache.Cache(k_cache, v_cache, seqlens_k, 0, None, None, block_table.contiguous())
        mods = _mods(causal, window_left, window_right, softcap, alibi_slopes, 0.0, None, learnable_sink)
        return kvcache.forward(
            _for_kernels(q), cache, 0, softmax_scale, mods, 0, varlen_q=(cu_seqlens_q.contiguous(), max_seqlen_q)
        )


@fwd_varlen_paged.register_fake
def _(q, k_cache, v_cache, *_):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _paged_backward(ctx, dout, dlse):
    """The forward runs with inputs that require grad (as flash_attn's); a backward through it
    does not exist (there neither)."""
    raise NotImplementedError(
        "flash_attn_varlen_func with block_table is forward-only (as in flash_attn): "
        "no backward through a paged K/V; detach the output, or call it under torch.no_grad()"
    )


fwd_varlen_paged.register_autograd(_paged_backward)
