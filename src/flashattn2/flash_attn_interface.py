"""flash_attn.flash_attn_interface on flashattn2: `from flash_attn.flash_attn_interface import X`
becomes `from flashattn2.flash_attn_interface import X`.

The public functions are flashattn2.api's. Beside them are the private functions that
context-parallel libraries (ring-flash-attention, yunchang) call to run one block of attention
and merge blocks through the logsumexp, with flash_attn 2.8's parameters, order and defaults:

    _flash_attn_forward(...)          -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_varlen_forward(...)   -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_backward(...)         -> softmax_d   (writes dq, dk, dv in place)
    _flash_attn_varlen_backward(...)  -> softmax_d   (writes dq, dk, dv in place)

and the autograd classes' `.apply` with 2.8's positional arguments. Where flashattn2 differs:

- softmax_lse is flash_attn's: float32 (batch, nheads, seqlen_q), or (nheads, total_q) in varlen.
  The backward accepts it with any strides (ring-flash-attention passes a transposed view).
- rng_state: int64 (2,) on q's device, as flash_attn's, holding [Philox seed, 0]. flashattn2's
  dropout stream is a function of the seed and the element's position, so there is no offset.
  The seed is drawn from torch's generator, so torch.manual_seed makes runs reproducible. Without
  dropout it is zeros. A backward with dropout_p > 0 needs the forward's rng_state.
- softmax_d is (1 - dropout_p) * rowsum(dout * out) in float32, flash_attn's value, in softmax_lse's
  layout: (batch, nheads, seqlen_q), or (nheads, total_q). flash_attn's allocation pads the rows
  (to a multiple of 128 per sequence); the values callers read are the same.
- Any head dim up to 256 is accepted (flash_attn: multiples of 8). Like flash_attn's, these functions take fp16/bf16
  only (ArgumentTypeError, a RuntimeError, with flash_attn's message): the libraries that call them rely on it
  (ring-flash-attention's and yunchang's `.to(torch.float32)` accumulators alias a float32 input, and the next
  block's backward overwrites their running sums). The public functions keep float32 (flashattn2's extension).
- softmax_scale=None means headdim ** -0.5 (flash_attn's private functions need a float).
- The private functions are plain Python functions (inspect.getfullargspec reads their
  parameters, as ring-flash-attention's get_default_args does), not torch.ops.flash_attn ops;
  under torch.compile they trace through flashattn2's own custom ops.
- The autograd classes are not torch.autograd.Function subclasses: `.apply` calls the public
  function, whose autograd.Function is flashattn2's.

flash_attn_gpu, the extension module flash_attn's interface calls (`fwd`, `varlen_fwd`, `bwd`, `varlen_bwd`,
`fwd_kvcache` with the C++ functions' positional arguments), is flashattn2.flash_attn_gpu, loaded on first use.

Valid arguments flashattn2 cannot serve raise NotImplementedError naming the argument
(leftpad_k; dropout with seqused_k); bad ones raise flashattn2.errors.ArgumentError / ArgumentTypeError.
"""

from __future__ import annotations


import torch

from .api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .errors import ArgumentError, ArgumentTypeError
from .functions import (
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
)
from .ops import _runtime
from .ops.request import cache_checks, checks
from .ops.run import registry
from .ops.run import call as calls
from .ops.launch.layout import BackwardTensors, ForwardTensors
from .ops.request.options import Options
from .ops.request.request import AttentionRequest

_new = tuple.__new__  # a request from its fields in their order

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "FlashAttnFunc",
    "FlashAttnKVPackedFunc",
    "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc",
    "FlashAttnVarlenKVPackedFunc",
    "FlashAttnVarlenQKVPackedFunc",
    "_flash_attn_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_forward",
    "_flash_attn_varlen_backward",
]


USE_TRITON_ROCM = False
"""flash_attn's switch to its ROCm Triton backend: flashattn2 has one path, its own kernels, on every device."""

S_DMASK_KEY_BLOCK = 2**31 - 1


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """flash_attn's key block width of S_dmask (return_attn_probs with dropout): each block's values there are
    exp(score - the row's running max up to that block). flashattn2's S_dmask subtracts the whole row's max, as one
    block spanning every key, so the answer is a width no row reaches; code that renormalizes S_dmask block by block
    (flash_attn's tests) then gets the right probabilities. The arguments are flash_attn's, kept for its callers."""
    if head_dim > 256:
        raise ArgumentError(f"_get_block_size_n: head_dim must be at most 256 (flash_attn's limit), got {head_dim}")
    return S_DMASK_KEY_BLOCK


def _options(q, batch, seqlen_k, dropout_p, softmax_scale, window, softcap, alibi_slopes):
    """(dropout_p, scale, left, right, softcap) validated as the public API validates them; the window
    (window_size_left, window_size_right)'s edges by flash_attn's rule (ops.run.call.window_edges: seqlen_k, or
    max_seqlen_k in varlen)."""
    checks.check_options(dropout_p, softmax_scale, window, softcap)
    checks.check_alibi(alibi_slopes, q, batch)
    scale = float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    return (float(dropout_p), scale, *calls.window_edges(window, seqlen_k), float(softcap))


def _half_only(q) -> None:
    """flash_attn's private functions take fp16/bf16 only (module docstring: libraries rely on it)."""
    dtype = getattr(q, "dtype", None)  # (a non-tensor: the checks below name it)
    if dtype is not None and dtype is not torch.float16 and dtype is not torch.bfloat16:
        raise ArgumentTypeError(
            f"FlashAttention only support fp16 and bf16 data type (q is {q.dtype}): flash_attn's private functions "
            "refuse it, as libraries that call them expect; flashattn2's public functions take float32"
        )


def _new_rng_state(q, dropout_p: float) -> torch.Tensor:
    """[Philox seed, 0], int64 on q's device (zeros without dropout)."""
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    if dropout_p > 0:
        rng_state[:1] = torch.randint(2**62, (1,), dtype=torch.int64, device=q.device)
    return rng_state


def _seed(rng_state, q, dropout_p: float) -> torch.Tensor | None:
    """The seed a backward replays: rng_state[0]."""
    if dropout_p == 0:
        return None
    if rng_state is None:
        raise ArgumentError(
            "rng_state is None with dropout_p > 0: pass the rng_state the forward returned, "
            "or the backward cannot replay its dropout mask"
        )
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or rng_state.numel() < 1:
        raise ArgumentTypeError("rng_state must be the int64 tensor the forward returned")
    if rng_state.device != q.device:
        raise ArgumentError(f"rng_state is on {rng_state.device}, q on {q.device}")
    return rng_state.reshape(-1)[:1]


def _check_return_softmax(return_softmax, dropout_p: float) -> None:
    if return_softmax and dropout_p == 0:  # flash_attn's C++ check
        raise ArgumentError("return_softmax is only supported when dropout_p > 0")


def _s_dmask(q, k, return_softmax, options, alibi_slopes) -> torch.Tensor:
    if not return_softmax:
        return torch.empty(0, dtype=q.dtype, device=q.device)
    return registry.dropout_probs(q, k, *options.op_args(), alibi_slopes)


def _like(name: str, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ArgumentError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ArgumentTypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, q on {device}")


def _grad_buffers(q, k, v, dq, dk, dv):
    """dq, dk, dv as given (checked: the inputs' shapes and dtype, last dimension contiguous), or
    allocated where None (flash_attn allows it; the caller then never sees them)."""
    out = []
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is None:
            out.append(_runtime.empty_like(like))
            continue
        _like(name, g, like.shape, like.dtype, like.device)
        if g.stride(-1) != 1:
            raise ArgumentError(f"{name} must be contiguous in its last dimension, got strides {g.stride()}")
        out.append(g)
    return out


def _check_backward_inputs(dout, out, softmax_lse, q, v, lse_shape) -> None:
    out_shape = (*q.shape[:-1], v.shape[-1])  # v's head dim
    _like("dout", dout, out_shape, q.dtype, q.device)
    _like("out", out, out_shape, q.dtype, q.device)
    _like("softmax_lse", softmax_lse, lse_shape, torch.float32, q.device)


def _softmax_d(dout, out, dropout_p: float, varlen: bool) -> torch.Tensor:
    """(1 - dropout_p) * rowsum(dout * out), float32, in softmax_lse's layout."""
    d = (dout.float() * out.float()).sum(-1)  # (batch, seqlen_q, nheads) or (total_q, nheads)
    if dropout_p > 0:
        d = d * (1.0 - dropout_p)
    return (d.transpose(0, 1) if varlen else d.transpose(1, 2)).contiguous()


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    """One attention call on dense inputs, without autograd (flash_attn 2.8's private op).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        dropout_p, softmax_scale, causal, softcap, alibi_slopes: as flash_attn_func.
        window_size_left, window_size_right: flash_attn_func's window_size, unpacked.
        return_softmax: also compute S_dmask (only with dropout_p > 0, as in flash_attn).
    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; softmax_lse (batch, nheads,
        seqlen_q) float32; S_dmask ((batch, nheads, round128(seqlen_q), round128(seqlen_k)) with
        return_softmax, else empty); rng_state int64 (2,) for the backward (module docstring).
    """
    _half_only(q)
    if torch.compiler.is_compiling():  # validated as below, then the op
        checks.check_qkv(q, k, v, varlen=False)
        window = (window_size_left, window_size_right)
        dropout_p, scale, left, right, softcap = _options(
            q, q.shape[0], k.shape[1], dropout_p, softmax_scale, window, softcap, alibi_slopes
        )
        _check_return_softmax(return_softmax, dropout_p)
        rng_state = _new_rng_state(q, dropout_p)
        seed = _seed(rng_state, q, dropout_p)
        options = Options(
            dropout_p=dropout_p, seed=seed, softmax_scale=scale, causal=bool(causal), window_left=left,
            window_right=right, softcap=softcap,
        )  # fmt: skip
        out, lse = registry.forward(q, k, v, options, alibi_slopes)
        return out, lse, _s_dmask(q, k, return_softmax, options, alibi_slopes), rng_state
    # the prepared call of these arguments (ops.run.call: validated once per spec)
    window = (window_size_left, window_size_right)
    try:
        q, k, v = registry.for_kernels(q), registry.for_kernels(k), registry.for_kernels(v)
    except AttributeError:  # a non-tensor: the checks name it
        checks.check_qkv(q, k, v, varlen=False)
        raise
    request = _new(
        AttentionRequest,
        (q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, False, False, None,
         None, None, None, None),
    )  # fmt: skip
    call = calls.attention(request)
    if call.empty:  # (flash_attn_func accepts seqlen 0; flash_attn's private op does not)
        checks.check_qkv(q, k, v, varlen=False)
    dropout_p = call.options.dropout_p
    _check_return_softmax(return_softmax, dropout_p)
    rng_state = _new_rng_state(q, dropout_p)
    seed = _seed(rng_state, q, dropout_p)
    t = tuple.__new__(ForwardTensors, (q, k, v, None, None, alibi_slopes, None, seed, None))  # in its fields' order
    out, lse = registry.run(call, t, grad=False)
    s_dmask = _s_dmask(q, k, return_softmax, call.options.with_tensors(None, None, seed), alibi_slopes)
    return out, lse, s_dmask, rng_state


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
    num_splits=0,
):
    """_flash_attn_forward on sequences packed along the first dimension (flash_attn 2.8's op).

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with block_table
            pages (num_blocks, page_size, nheads_k, headdim) (forward only, no dropout).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table: as
            flash_attn_varlen_func.
        seqused_k: int32 (batch,): sequence b uses only its first seqused_k[b] keys (of its
            packed keys from cu_seqlens_k[b], or of its pages); forward only, no dropout
            (NotImplementedError), as flash_attn's paged path. Its values are not read back.
        leftpad_k: not supported (NotImplementedError unless None).
        zero_tensors: True makes softmax_lse -inf (flash_attn's fill) in rows past
            cu_seqlens_q[-1]; out is 0 there either way.
        num_splits: accepted as flash_attn's later 2.8 builds take it (a non-negative int; a
            speed knob there, the result is the same, so flashattn2 ignores its value); with
            block_table more than 1 raises, as flash_attn's "not supported for varlen paged KV".
        Other arguments as _flash_attn_forward.
    Returns:
        (out (total_q, nheads, headdim), softmax_lse (nheads, total_q) float32, S_dmask,
        rng_state), as _flash_attn_forward.
    """
    _half_only(q)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ArgumentError(f"_flash_attn_varlen_forward: num_splits must be an int >= 0, got {num_splits!r}")
    if leftpad_k is not None:
        raise NotImplementedError("_flash_attn_varlen_forward: leftpad_k is not supported by flashattn2 (pass None)")
    if block_table is not None and num_splits > 1:
        raise ArgumentError(f"num_splits > 1 is not supported for varlen paged KV (block_table), got {num_splits}")
    if seqused_k is not None:
        if block_table is None:  # (packed keys: checked as a varlen call's before they become pages)
            checks.check_qkv(q, k, v, varlen=True)
            checks.check_cu_tensors(cu_seqlens_q, cu_seqlens_k, q)
        checks.check_seqused_k(seqused_k, cu_seqlens_q, dropout_p, "_flash_attn_varlen_forward")
        k, v, block_table, cu_seqlens_k = seqused_pages(seqused_k, cu_seqlens_k, max_seqlen_k, k, v, block_table)
    if block_table is not None:
        _check_return_softmax(return_softmax, dropout_p)
        checks.check_options(dropout_p, softmax_scale, (window_size_left, window_size_right), softcap)
        r = AttentionRequest(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            (int(window_size_left), int(window_size_right)), softcap, alibi_slopes, block_table=block_table,
        )  # fmt: skip
        return _varlen_paged_forward(r, zero_tensors)
    checks.check_qkv(q, k, v, varlen=True)
    cu_q, cu_k, max_q, max_k, verify = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    window = (window_size_left, window_size_right)
    dropout_p, scale, left, right, softcap = _options(
        q, cu_q.shape[0] - 1, max_k, dropout_p, softmax_scale, window, softcap, alibi_slopes
    )
    _check_return_softmax(return_softmax, dropout_p)
    rng_state = _new_rng_state(q, dropout_p)
    options = Options(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=dropout_p,
        seed=_seed(rng_state, q, dropout_p), softmax_scale=scale, causal=bool(causal), window_left=left,
        window_right=right, softcap=softcap,
    )  # fmt: skip
    out, lse = registry.forward(q, k, v, options, alibi_slopes)
    verify()
    if zero_tensors:
        _fill_lse_tail(lse, cu_q)
    return out, lse, _s_dmask(q, k, return_softmax, options, alibi_slopes), rng_state


def key_pages(cu_seqlens_k: torch.Tensor, max_seqlen_k: int, total_k: int) -> torch.Tensor:
    """block_table (batch, max_seqlen_k) int32 over pages of one key: sequence b's j-th key is key cu_seqlens_k[b] + j
    (the entries past a sequence's keys are never read; clamped to stay in range)."""
    positions = cu_seqlens_k[:-1, None].long() + torch.arange(max_seqlen_k, device=cu_seqlens_k.device)
    return positions.clamp_(max=max(total_k - 1, 0)).to(torch.int32)


def seqused_pages(seqused_k, cu_seqlens_k, max_seqlen_k, k, v, block_table):
    """flash_attn's seqused_k (sequence b uses its first seqused_k[b] keys) as the paged varlen call takes it: (k, v,
    block_table, cu_seqlens_k): packed keys become pages of one key (key_pages) unless block_table pages them already,
    and the key counts are cu_seqlens_k's steps. No host read."""
    if block_table is None:
        k, v, block_table = k.unsqueeze(1), v.unsqueeze(1), key_pages(cu_seqlens_k, max_seqlen_k, k.shape[0])
    return k, v, block_table, torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))


def _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k):
    """A varlen call's cu_seqlens validated (q, k, v are): (cu_seqlens_q, cu_seqlens_k clamped for the kernels,
    max_seqlen_q, max_seqlen_k as ints, verify) (ops.request.checks.cu_seqlens_for_kernels)."""
    checks.check_cu_tensors(cu_seqlens_q, cu_seqlens_k, q)
    max_q, max_k = checks.max_seqlens(max_seqlen_q, max_seqlen_k)
    cu_q, cu_k, verify = checks.cu_seqlens_for_kernels(cu_seqlens_q, cu_seqlens_k, max_q, max_k, q, k)
    return cu_q, cu_k, max_q, max_k, verify


def _varlen_paged_forward(r: AttentionRequest, zero_tensors: bool):
    """_flash_attn_varlen_forward with a block_table (its arguments checked, as one request): varlen q over the paged
    cache through the paged op's prepared call."""
    q, cu_seqlens_k, block_table = r.q, r.cu_seqlens_k, r.block_table
    call = calls.paged(r)
    spec = call.spec
    cu_seqlens_q = cache_checks.paged_sequences(
        q, r.k, r.cu_seqlens_q, cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k, block_table
    )
    out, lse = registry.paged_forward(call, r, cu_seqlens_q)
    if zero_tensors:
        _fill_lse_tail(lse, cu_seqlens_q)
    return out, lse, torch.empty(0, dtype=q.dtype, device=q.device), _new_rng_state(q, 0.0)


def _fill_lse_tail(lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """zero_tensors=True: -inf in the rows past cu_seqlens_q[-1] (no host read)."""
    rows = torch.arange(lse.shape[1], device=lse.device)
    lse.masked_fill_((rows >= cu_seqlens_q[-1])[None, :], float("-inf"))


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    """The gradients of one _flash_attn_forward call, written into dq, dk, dv (flash_attn 2.8's op).

    Arguments:
        dout: (batch, seqlen_q, nheads, headdim), the gradient of out.
        q, k, v, out, softmax_lse: the forward's inputs and outputs (softmax_lse may be a merged
            logsumexp over several key blocks, as ring attention passes; any strides).
        dq, dk, dv: q's, k's and v's shapes and dtype, last dimension contiguous (views into one
            packed tensor are fine), overwritten; None allocates a buffer the caller never sees.
        deterministic: as flash_attn_func. rng_state: the forward's, needed with dropout_p > 0.
        num_splits: accepted as flash_attn's later 2.8 builds take it (a non-negative int; a
            speed knob there, the result is the same, so flashattn2 ignores its value).
        Other arguments as _flash_attn_forward.
    Returns:
        softmax_d (batch, nheads, seqlen_q) float32, (1 - dropout_p) * rowsum(dout * out).
    """
    _half_only(q)
    checks.check_qkv(q, k, v, varlen=False)
    batch, seqlen_q, nheads, _ = q.shape
    _check_backward_inputs(dout, out, softmax_lse, q, v, (batch, nheads, seqlen_q))
    window = (window_size_left, window_size_right)
    dropout_p, scale, left, right, softcap = _options(
        q, batch, k.shape[1], dropout_p, softmax_scale, window, softcap, alibi_slopes
    )
    seed = _seed(rng_state, q, dropout_p)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    options = Options(
        dropout_p=dropout_p, seed=seed, softmax_scale=scale, causal=bool(causal), window_left=left, window_right=right,
        softcap=softcap,
    )  # fmt: skip
    # the batch-invariant mode's backward is the deterministic one
    deterministic = bool(deterministic) or registry.invariant()
    tensors = BackwardTensors(dout, q, k, v, out, softmax_lse, None, dq, dk, dv, alibi=alibi_slopes)
    registry.backward(tensors, options, deterministic)
    return _softmax_d(dout, out, dropout_p, varlen=False)


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
    zero_tensors=False,
):
    """_flash_attn_backward on packed sequences (flash_attn 2.8's op): dout, q, out (total_q,
    nheads, headdim), k, v (total_k, nheads_k, headdim), softmax_lse (nheads, total_q). Rows past
    cu_seqlens[-1] get a zero gradient whatever zero_tensors says (flash_attn's zero_tensors=True
    gives that). Returns softmax_d (nheads, total_q) float32."""
    _half_only(q)
    checks.check_qkv(q, k, v, varlen=True)
    _check_backward_inputs(dout, out, softmax_lse, q, v, (q.shape[1], q.shape[0]))
    cu_q, cu_k, max_q, max_k, verify = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    window = (window_size_left, window_size_right)
    dropout_p, scale, left, right, softcap = _options(
        q, cu_q.shape[0] - 1, max_k, dropout_p, softmax_scale, window, softcap, alibi_slopes
    )
    seed = _seed(rng_state, q, dropout_p)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    options = Options(
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=dropout_p, seed=seed,
        softmax_scale=scale, causal=bool(causal), window_left=left, window_right=right, softcap=softcap,
    )  # fmt: skip
    # the batch-invariant mode's backward is the deterministic one
    deterministic = bool(deterministic) or registry.invariant()
    tensors = BackwardTensors(dout, q, k, v, out, softmax_lse, None, dq, dk, dv, alibi=alibi_slopes)
    registry.backward(tensors, options, deterministic)
    verify()
    return _softmax_d(dout, out, dropout_p, varlen=True)


def __getattr__(name: str):
    """flash_attn_gpu on first use (PEP 562): that module imports this one's private functions."""
    if name == "flash_attn_gpu":
        from . import flash_attn_gpu

        return flash_attn_gpu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
