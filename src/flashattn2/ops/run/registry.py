"""The attention ops: torch.library registration for torch.compile, and the autograd Functions eager calls take.

Internal callers pass an attention call's options by name (ops.request.options.Options); only the torch.library shims
flatten them, their parameter lists derived from Options' fields:

    flashattn2::fwd(q, k, v, *Options, alibi_slopes, learnable_sink) -> (out, lse)
    flashattn2::bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, *Options, alibi_slopes, learnable_sink, dsink,
                    deterministic)   (writes dq, dk, dv and dsink in place: packed callers pass views of one tensor)

Their fake implementations let torch.compile trace them without a graph break. Eager calls skip the dispatcher (it
costs host time and only tracing needs it): forward() and backward() run the prepared call (ops.run.call) directly, and
the API's autograd Functions below call them.
"""

from __future__ import annotations

import inspect
import typing

import torch

from .. import _runtime, planning
from . import attention, call as calls
from ..request import checks, invariance, request
from ..launch import kvcache
from ..launch.layout import BackwardTensors, ForwardTensors
from ..request.options import N_OP_ARGS, Options


def for_kernels(t: torch.Tensor) -> torch.Tensor:
    """Last dimension contiguous and no broadcast (stride-0) dimension: what the kernels and TMA descriptors
    accept. A gradient of out.sum() arrives expanded, with stride 0."""
    s = t.stride()
    if s[-1] != 1 or 0 in s:
        return t.contiguous()
    return t


def _signature(head: list[tuple[str, object]], tail: list[tuple[str, object, object]]) -> inspect.Signature:
    """An op's signature: `head` (name, type), Options' fields in order, `tail` (name, type, default or EMPTY)."""
    hints = typing.get_type_hints(Options)
    P = inspect.Parameter
    params = [P(name, P.POSITIONAL_OR_KEYWORD, annotation=ty) for name, ty in head]
    params += [P(f, P.POSITIONAL_OR_KEYWORD, annotation=hints[f]) for f in Options.__dataclass_fields__]
    params += [P(name, P.POSITIONAL_OR_KEYWORD, annotation=ty, default=d) for name, ty, d in tail]
    return inspect.Signature(params, return_annotation=None)


def _custom_op(name: str, impl, signature: inspect.Signature, result, mutates_args=()):
    impl.__signature__ = signature.replace(return_annotation=result)
    return torch.library.custom_op(name, impl, mutates_args=mutates_args)


Tensor, OptTensor, EMPTY = torch.Tensor, typing.Optional[torch.Tensor], inspect.Parameter.empty
_new = tuple.__new__


def _split(rest: tuple, tail: int) -> tuple:
    """(Options, the tail's values, missing trailing ones None) from an op's arguments after its head."""
    return Options(*rest[:N_OP_ARGS]), *rest[N_OP_ARGS:], *(None,) * (N_OP_ARGS + tail - len(rest))


def forward(q, k, v, options: Options, alibi_slopes=None, learnable_sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention forward without autograd: (out, lse). The op while torch.compile traces, the prepared call's
    launches otherwise (ring blocks, the private _flash_attn_* functions)."""
    if torch.compiler.is_compiling():
        return fwd(q, k, v, *options.op_args(), alibi_slopes, learnable_sink)
    return _forward(q, k, v, options, alibi_slopes, learnable_sink)


def _forward(q, k, v, options: Options, alibi_slopes, learnable_sink):
    q, k, v = for_kernels(q), for_kernels(k), for_kernels(v)
    call = calls.from_options(q, k, v, options, alibi_slopes, learnable_sink)
    t = _new(ForwardTensors, (q, k, v, options.cu_seqlens_q, options.cu_seqlens_k, alibi_slopes, learnable_sink,
                              options.seed, None))  # fmt: skip
    with _runtime.device_of(q):
        return attention.forward(call, t)


def _fwd_impl(q, k, v, *rest):
    options, alibi_slopes, learnable_sink = _split(rest, 2)
    return _forward(q, k, v, options, alibi_slopes, learnable_sink)


_FWD_SIGNATURE = _signature(
    [("q", Tensor), ("k", Tensor), ("v", Tensor)],
    [("alibi_slopes", OptTensor, EMPTY), ("learnable_sink", OptTensor, None)],
)
fwd = _custom_op("flashattn2::fwd", _fwd_impl, _FWD_SIGNATURE, tuple[Tensor, Tensor])


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, *_):
    if cu_seqlens_q is None:
        batch, seqlen_q, nheads, _ = q.shape
        lse_shape = (batch, nheads, seqlen_q)
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(lse_shape, dtype=torch.float32)


def backward(t: BackwardTensors, options: Options, deterministic: bool) -> None:
    """One attention backward without autograd, into t.dq, t.dk, t.dv (and t.dsink); the sequences and the seed are
    the options' (t's are not read): the op while torch.compile traces, the prepared call's launches otherwise.
    deterministic=False lets a Hopper GPU take the Gluon backward (dQ added in any order)."""
    if torch.compiler.is_compiling():
        bwd(
            t.dout, t.q, t.k, t.v, t.out, t.lse, t.dlse, t.dq, t.dk, t.dv, *options.op_args(), t.alibi, t.sink,
            t.dsink, deterministic,
        )  # fmt: skip
    else:
        _backward_impl(t, options, deterministic)


def _backward_impl(t: BackwardTensors, options: Options, deterministic: bool) -> None:
    dout, q, k, v, out = (for_kernels(x) for x in (t.dout, t.q, t.k, t.v, t.out))
    lse, dlse, dq, dk, dv, alibi_slopes, sink = t.lse.contiguous(), t.dlse, t.dq, t.dk, t.dv, t.alibi, t.sink
    if dlse is not None:
        dlse = dlse.contiguous()
    call = calls.from_options(q, k, v, options, alibi_slopes, sink)
    bcall = call.backward(out, dout, dlse, (dq, dk, dv), bool(deterministic))
    cu_q, cu_k, seed = options.cu_seqlens_q, options.cu_seqlens_k, options.seed
    # (positional, in the fields' order: a keyword NamedTuple costs a microsecond more)
    tensors = _new(
        BackwardTensors, (dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, alibi_slopes, sink, seed, t.dsink)
    )
    with _runtime.device_of(q):
        attention.backward(bcall, call, tensors)


# the op's tensors before the Options: BackwardTensors' first fields (the sequences and the seed are the Options')
_BWD_HEAD = BackwardTensors._fields[: BackwardTensors._fields.index("cu_seqlens_q")]
_N_HEAD = len(_BWD_HEAD)


def _bwd_impl(*args) -> None:
    options, alibi_slopes, sink, dsink, deterministic = _split(args[_N_HEAD:], 4)
    t = BackwardTensors(*args[:_N_HEAD], alibi=alibi_slopes, sink=sink, dsink=dsink)
    _backward_impl(t, options, bool(deterministic))


# (dsink, a mutated argument, has no default: the dispatcher drops trailing arguments equal to their defaults, and a
# mutated one dropped breaks torch 2.11's in-place bookkeeping)
_BWD_SIGNATURE = _signature(
    [(name, OptTensor if name == "dlse" else Tensor) for name in _BWD_HEAD],
    [
        ("alibi_slopes", OptTensor, EMPTY),
        ("learnable_sink", OptTensor, EMPTY),
        ("dsink", OptTensor, EMPTY),
        ("deterministic", bool, True),
    ],
)
bwd = _custom_op("flashattn2::bwd", _bwd_impl, _BWD_SIGNATURE, None, mutates_args=("dq", "dk", "dv", "dsink"))


@bwd.register_fake
def _(*_):
    return None


def _dropout_probs_impl(q, k, *rest) -> torch.Tensor:
    options, alibi_slopes = _split(rest, 1)
    q, k = for_kernels(q), for_kernels(k)
    call = calls.from_options(q, k, k, options, alibi_slopes, None)
    with _runtime.device_of(q):
        return attention.dropout_probs(
            call, q, k, options.cu_seqlens_q, options.cu_seqlens_k, alibi_slopes, options.seed
        )


# S_dmask for the dropout mask fwd drew with the same seed (forward only, a testing aid)
dropout_probs = _custom_op(
    "flashattn2::dropout_probs",
    _dropout_probs_impl,
    _signature([("q", Tensor), ("k", Tensor)], [("alibi_slopes", OptTensor, EMPTY)]),
    Tensor,
)


@dropout_probs.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_):
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    seqlen_q = q.shape[1] if cu_seqlens_q is None else max_seqlen_q
    seqlen_k = k.shape[1] if cu_seqlens_q is None else max_seqlen_k
    round128 = lambda n: -(-n // 128) * 128
    return q.new_empty((batch, q.shape[-2], round128(seqlen_q), round128(seqlen_k)))


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    options, alibi_slopes, sink = _split(tuple(rest), 2)
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, sink, *options.tensors())
    ctx.options = options.without_tensors()


def _op_backward(ctx, dout, dlse):
    """The op's own backward (torch.compile, direct callers of torch.ops.flashattn2.fwd): the deterministic one."""
    q, k, v, out, lse, alibi_slopes, sink, *tensors = ctx.saved_tensors
    options = ctx.options.with_tensors(*tensors)
    dout = grad_of_out(dout, out)
    dq, dk, dv = _runtime.empty_like(q), _runtime.empty_like(k), _runtime.empty_like(v)
    dsink = _dsink(sink)
    bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, *options.op_args(), alibi_slopes, sink, dsink, True)
    return dq, dk, dv, *(None,) * (1 + N_OP_ARGS), dsink


fwd.register_autograd(_op_backward, setup_context=_setup_context)


def invariant() -> bool:
    """Whether the batch-invariant mode is on, for a backward (the deterministic one in the mode): the autograd
    functions ask in their forward (the caller's thread, which sees a batch_invariant() block), the private
    _flash_attn_*_backward functions where they are called. Under torch.compile the backward is the deterministic one
    anyway, and dynamo cannot read a context variable."""
    return not torch.compiler.is_compiling() and invariance.enabled()


def _dsink(sink: torch.Tensor | None) -> torch.Tensor | None:
    """The sink's gradient buffer (fp32, its shape) the backward writes, or None without a sink."""
    return None if sink is None else _runtime.empty(sink.shape, torch.float32, sink.device)


def grad_of_out(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The output's gradient; zeros when only the logsumexp received one. (The autograd.Functions below do not
    materialize missing gradients: a training step's unused logsumexp then costs no zero-filled tensor, and the
    preprocess reads no lse gradient.)"""
    return torch.zeros_like(out) if dout is None else for_kernels(dout)


def _save(ctx, call, t: ForwardTensors, out, lse):
    """What a backward needs: the tensors, the prepared call, and the forward's planning.force() state (the backward
    runs in autograd's thread, which does not see it)."""
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sink, seed, _ = t
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sink, cu_seqlens_q, cu_seqlens_k, seed)
    ctx.call, ctx.forced = call, call.spec.modes.forced
    ctx.deterministic = bool(call.spec.deterministic) or call.spec.modes.invariant
    ctx.set_materialize_grads(False)


def _run_backward(ctx, saved, dout, dlse, dq, dk, dv, own: bool = True):
    """saved: ctx.saved_tensors, read once by the caller (torch.utils.checkpoint unpacks each tensor once); own: dq,
    dk, dv are the Function's own (contiguous, in the layout's gradient dtype)."""
    q, k, v, out, lse, alibi_slopes, sink, cu_q, cu_k, seed = saved
    dout = grad_of_out(dout, out)
    dsink = _dsink(sink)
    call = ctx.call
    bcall = call.backward(None, dout, dlse, None if own else (dq, dk, dv), ctx.deterministic)
    tensors = _new(
        BackwardTensors, (dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, alibi_slopes, sink, seed, dsink)
    )
    with planning.entered(ctx.forced), _runtime.device_of(q):
        attention.backward(bcall, call, tensors)
    return dsink


class Attention(torch.autograd.Function):
    """An attention call through autograd (the API's eager path: no dispatcher, no per-call autograd wrapper): the
    prepared call's forward, and its backward. Every tensor is an input of its own (not one inside a bundle), so
    that what records the Function's inputs -- torch.jit.trace, which would bake a bundled seed in -- sees them all:
    apply(call, *tensors), tensors a ForwardTensors' fields but the last (descale: FP8 has no backward)."""

    @staticmethod
    def forward(ctx, call, *tensors):
        t = _new(ForwardTensors, (*tensors, None))
        out, lse = attention.forward(call, t)
        _save(ctx, call, t, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors
        dtype = ctx.call.layout.grad_dtype  # (the interpreter's fp32: autograd casts it)
        dq, dk, dv = (_runtime.empty(t.shape, dtype, t.device) for t in saved[:3])
        dsink = _run_backward(ctx, saved, dout, dlse, dq, dk, dv)
        return None, dq, dk, dv, None, None, None, dsink, None


class PackedAttention(torch.autograd.Function):
    """Attention over packed inputs whose backward writes one packed gradient (no concat).

    packing "qkv": `packed` is qkv (..., 3, nheads, headdim) and `q` is None; packing "kv": `packed` is kv (..., 2,
    nheads_k, headdim) beside `q`. The packed dimension is 2 for dense (batch, seqlen, ...) inputs and 1 for varlen
    (total, ...) ones. apply(call, packing, q, packed, *tensors): tensors a ForwardTensors' fields after v but the
    last (Attention's).
    """

    @staticmethod
    def forward(ctx, call, packing, q, packed, *tensors):
        dim = 1 if call.spec.varlen else 2
        if packing == "qkv":
            q, k, v = packed.unbind(dim=dim)
        else:
            k, v = packed.unbind(dim=dim)
        t = _new(ForwardTensors, (q, k, v, *tensors, None))
        out, lse = attention.forward(call, t)
        _save(ctx, call, t, out, lse)
        ctx.packing, ctx.dim = packing, dim
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors
        q, k = saved[:2]
        dim = ctx.dim
        if ctx.packing == "qkv":
            dpacked = _runtime.empty((*q.shape[:dim], 3, *q.shape[dim:]), q.dtype, q.device)
            dq, dk, dv = dpacked.unbind(dim=dim)
        else:
            dq = _runtime.empty_like(q)
            dpacked = _runtime.empty((*k.shape[:dim], 2, *k.shape[dim:]), k.dtype, k.device)
            dk, dv = dpacked.unbind(dim=dim)
        dsink = _run_backward(ctx, saved, dout, dlse, dq, dk, dv, own=False)
        return None, None, (None if ctx.packing == "qkv" else dq), dpacked, None, None, None, dsink, None


class EmptyAttention(torch.autograd.Function):
    """Dense attention with no query or no key position (seqlen_q or seqlen_k 0), which flash_attn accepts: out
    zeros, lse +inf (rows that see no key; with a sink, the sink's logit), gradients zeros (the sink's: the lse
    gradient summed over batch and rows, since lse = sink there). No kernel runs."""

    @staticmethod
    def forward(ctx, q, k, v, sink=None):
        ctx.save_for_backward(q, k, v, sink)
        ctx.set_materialize_grads(False)
        shape = (q.shape[0], q.shape[2], q.shape[1])
        if sink is None:
            lse = torch.full(shape, float("inf"), dtype=torch.float32, device=q.device)
        else:
            lse = sink.detach().float()[:, None].expand(shape).contiguous()
        dtype = checks.compute_dtype(q.dtype)  # FP8 inputs: a bf16 output
        return q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink = ctx.saved_tensors
        dsink = None
        if sink is not None:
            dsink = torch.zeros_like(sink) if dlse is None else dlse.sum(dim=(0, 2)).to(sink.dtype)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink


def run(call, t: ForwardTensors, grad: bool = True, lse_wanted: bool = True):
    """An eager attention call (the API's): through Attention when a gradient is needed (grad: whether the caller
    records one at all), else the forward alone (lse_wanted False: the caller drops the logsumexp). t.descale: an FP8
    call's (q_descale, k_descale, v_descale); the FP8 forward has no backward (FA3's neither)."""
    q, k, v, sink, descale = t.q, t.k, t.v, t.sink, t.descale
    if call.layout.descale_strides is not None:
        _no_fp8_grad(q, k, v, sink, descale)
    elif (
        grad
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad))
    ):
        return Attention.apply(call, *t[:-1])
    return _runtime.on_device_of(q, attention.forward, call, t, lse_wanted)


def _no_fp8_grad(*tensors) -> None:
    """NotImplementedError where an FP8 call would record a gradient: its forward has no backward."""
    if torch.is_grad_enabled():
        flat = [t for x in tensors for t in (x if isinstance(x, tuple) else (x,))]
        if any(t is not None and t.requires_grad for t in flat):
            raise NotImplementedError(
                "a gradient through the FP8 forward (float8_e4m3fn inputs): it has no backward (FA3's neither); "
                "run it under torch.no_grad() or with inputs that do not require grad"
            )


# ---- the KV cache --------------------------------------------------------------------------------------------------


def kvcache_forward(call, r, check=None):
    """The body of flashattn2::fwd_kvcache: append k/v into the cache (k rotated; quantized into an FP8 cache), rotate
    q, attend, as the prepared call (ops.run.call.KVCacheCall) planned (ops.launch.kvcache's Append and Decode, made at
    its first run). r: the request (ops.request.request.KVCacheRequest; an int or absent cache_seqlens checked already:
    KVCacheCall.seqlen). check: a kvcache.Check (eager calls only), set when a cache tensor holds a value out of
    range. Without return_softmax_lse the logsumexp returned is not the caller's to keep (kvcache.Decode)."""
    decode = call.decode
    if decode is None:  # the append first: another thread takes a call whose decode is set as ready
        spec = call.spec
        arch = spec.modes.arch
        shape = kvcache.kvcache_shape(call)
        if spec.k is not None:
            call.append = kvcache.Append(shape, spec.k, spec.v, spec.rotary_cos, bool(spec.rotary_interleaved), arch)
        decode = call.decode = kvcache.Decode(call.plan, shape, arch)
    q, k, seqlens, seqlen_int = r.q, r.k, r.cache_seqlens, 0
    if call.seqlens_int:  # an int the kernels take as it is (None: the whole cache)
        seqlens, seqlen_int = None, call.capacity if seqlens is None else seqlens
    if call.indices_ready:  # none of these given
        batch_idx = leftpad = block_table = alibi_slopes = sink = None
    else:
        seqlens, block_table = _contiguous(seqlens), _contiguous(r.block_table)
        batch_idx, leftpad = _contiguous(r.cache_batch_idx), _contiguous(r.cache_leftpad)
        alibi_slopes, sink = _contiguous(r.alibi_slopes), _contiguous(r.learnable_sink)
    descales = r.descales if call.descaled else kvcache.NO_DESCALES
    cache = _new(kvcache.Cache, (r.k_cache, r.v_cache, seqlens, seqlen_int, batch_idx, leftpad, block_table, descales))
    with _runtime.device_of(q):
        if k is not None:
            cos = sin = None
            if r.rotary_cos is not None:
                cos, sin = r.rotary_cos.contiguous(), r.rotary_sin.contiguous()
            call.append(k, r.v, cos, sin, cache, check)
            if cos is not None:
                rotary = (cos, sin, call.spec.rotary_interleaved)
                q = kvcache.rotate_q(q, seqlens, seqlen_int, rotary, call.per_token)
            if call.seqlen_new and k.shape[0]:  # an append that ran checked every value the attention reads (pages too)
                check = None
        if check is not None and block_table is not None:  # the pages a window or left padding leaves unread too
            kvcache.check_pages(block_table, cache.k.shape[0], decode.shape, seqlens, seqlen_int, check)
        return decode(
            q if call.q_ready else for_kernels(q), cache, None, alibi_slopes, sink, check, r.return_softmax_lse
        )


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def _fwd_kvcache_impl(*args):
    r = request.from_op_args(request.KVCacheRequest, args)
    return kvcache_forward(calls.kvcache(r), r)


# flashattn2::fwd_kvcache: append k/v into k_cache/v_cache in place (k rotated), then attention of q (rotated) over the
# cache: (out, lse). Its parameters are flash_attn_with_kvcache's request's (ops.request.request: an int cache_seqlens
# travels as cache_seqlen_int with cache_seqlens None), validated by the API; the four added last (the sink, FP8's
# descales) default to None. torch.compile's path; eager calls run kvcache_forward.
_fwd_kvcache_impl.__signature__ = request.op_schema(
    request.KVCacheRequest, tuple[Tensor, Tensor], optional=("learnable_sink", "q_descale", "k_descale", "v_descale")
)
fwd_kvcache = torch.library.custom_op("flashattn2::fwd_kvcache", _fwd_kvcache_impl, mutates_args=("k_cache", "v_cache"))


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, *_):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]), dtype=checks.compute_dtype(q.dtype))  # bf16 for FP8 q
    return out, q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def paged_forward(call, r: request.AttentionRequest, cu_seqlens_q):
    """The body of flashattn2::fwd_varlen_paged: varlen q over a paged K/V (r.k and r.v the caches, r.block_table),
    as the prepared call (ops.run.call.PagedCall) planned; sequence b's keys are its first cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] positions through block_table[b]. cu_seqlens_q: r's as cache_checks.paged_sequences returned it.
    (out, lse (nheads, total_q))."""
    q, cu_seqlens_k, block_table = r.q, r.cu_seqlens_k, r.block_table
    decode = call.decode
    if decode is None:
        decode = call.decode = kvcache.Decode(call.plan, kvcache.paged_shape(call), call.spec.modes.arch)
    with _runtime.device_of(q):
        cu_k = cu_seqlens_k.contiguous()
        seqlens_k = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        cache = kvcache.Cache(r.k, r.v, seqlens_k, 0, block_table=_contiguous(block_table))
        alibi_slopes, sink = _contiguous(r.alibi_slopes), _contiguous(r.learnable_sink)
        return decode(for_kernels(q), cache, _contiguous(cu_seqlens_q), alibi_slopes, sink)


def _fwd_varlen_paged_impl(*args):
    r = request.from_op_args(request.AttentionRequest, args)
    return paged_forward(calls.paged(r), r, r.cu_seqlens_q)


# flashattn2::fwd_varlen_paged: flash_attn_varlen_func over a paged K/V (forward only, k and v the caches),
# torch.compile's path and autograd's; its parameters are the request's (validated by the API: max_seqlen_q/k as
# cache_checks.check_varlen_paged resolved them)
_fwd_varlen_paged_impl.__signature__ = request.op_schema(
    request.AttentionRequest, tuple[Tensor, Tensor], optional=("learnable_sink", "q_descale", "k_descale", "v_descale")
)
fwd_varlen_paged = torch.library.custom_op("flashattn2::fwd_varlen_paged", _fwd_varlen_paged_impl, mutates_args=())


@fwd_varlen_paged.register_fake
def _(q, k_cache, v_cache, *_):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _paged_backward(ctx, dout, dlse):
    """The forward runs with inputs that require grad (as flash_attn's); a backward through it does not exist (there
    neither)."""
    raise NotImplementedError(
        "flash_attn_varlen_func with block_table is forward-only (as in flash_attn): "
        "no backward through a paged K/V; detach the output, or call it under torch.no_grad()"
    )


fwd_varlen_paged.register_autograd(_paged_backward)
