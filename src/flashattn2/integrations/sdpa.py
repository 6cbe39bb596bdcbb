"""flashattn2 as PyTorch's flash-attention kernel: `torch.nn.functional.scaled_dot_product_attention` calls that pick
the flash backend, and `torch.nn.attention.varlen.varlen_attn`, run on flashattn2 once

    torch.nn.attention.activate_flash_attention_impl("flashattn2")    # or: with flashattn2.sdpa(): ...

has installed the functions below as the CUDA kernels of torch's flash ops (as torch's own FA3/FA4 providers do;
`restore_flash_attention_impl()` removes them). `import flashattn2` registers the name, nothing more
(integrations.sdpa_registration).

Each function takes its aten op's arguments and returns what torch's own flash kernel (FlashAttention-2) returns:

- `_flash_attention_forward`: (batch, seqlen, nheads, headdim) inputs, or (total, nheads, headdim) with cum_seq_q /
  cum_seq_k (ragged); returns (out, logsumexp (batch, nheads, seqlen_q) or (nheads, total_q) float32, rng_state,
  unused, debug_attn_mask). `_flash_attention_forward_no_dropout_inplace` writes `out` and returns the logsumexp.
- `_scaled_dot_product_flash_attention` / `_backward`: SDPA's (batch, nheads, seqlen, headdim), as transposed views
  (no copies); out comes back as torch's does, a (batch, nheads, seqlen_q, headdim_v) view of a
  (batch, seqlen_q, nheads, headdim_v) buffer.
- causal is bottom-right aligned when seqlen_q != seqlen_k, as torch's flash kernel (SDPA's dispatcher itself sends
  no such causal call to the flash backend: the math backend's is top-left). GQA: key/value with fewer heads.
- dropout: rng_state is (2,) uint64 [seed, 0], the seed drawn from torch's generator on the query's device (so
  torch.manual_seed reproduces a run); the backward replays the forward's mask from it. flashattn2's Philox
  stream is its own (a function of the seed and the element's position, no offset), so the mask is not bit-equal
  to torch's CUDA kernel's; it is as random, and forward and backward agree. debug_attn_mask is flash_attn's
  S_dmask (negative where dropped), as torch's kernel returns it.
- window_size_left/right, alibi_slopes, scale: flash_attn's meaning. block_table (paged K/V) and seqused_k: forward
  only, without dropout, as torch's (a ragged seqused_k without block_table reads the packed keys as pages of one
  key: a gather, slower than contiguous keys). num_splits is a speed knob there; flashattn2 picks its own split.

What flashattn2 cannot serve runs on the kernel torch had before activation, counted in `fallbacks()` (and logged
once per reason): inputs other than float16/bfloat16 (torch's kernel refuses them too), GPUs before sm_80 and ROCm,
return_debug_mask without dropout, dropout with block_table / seqused_k, FP8 (the `.quantized` overloads, on
flashattn2's FP8 forward) with dropout or seqused_k, and whatever flashattn2 raises NotImplementedError for.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os

import torch
from torch.nn.attention import SDPBackend

from ..api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from ..errors import ArgumentTypeError
from ..flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    seqused_pages,
)
from .sdpa_registration import NAME, register

__all__ = ["sdpa", "fallbacks", "install", "Unsupported", "TORCH_NEEDED"]

logger = logging.getLogger(__name__)

# the registry (torch.nn.attention.register_flash_attention_impl and friends) came with FA4's provider (pytorch#167348)
TORCH_NEEDED = "torch 2.11, 2.13 and 2.14 have all of it"
REGISTRY_FUNCTIONS = (
    "register_flash_attention_impl",
    "activate_flash_attention_impl",
    "current_flash_attention_impl",
    "restore_flash_attention_impl",
)
HALF = (torch.float16, torch.bfloat16)


class Unsupported(Exception):
    """A call flashattn2 leaves to torch's own kernel; the message says why."""


_FALLBACKS: collections.Counter[str] = collections.Counter()


def fallbacks(reset: bool = False) -> dict[str, int]:
    """How many calls went to torch's own kernel, by "op: reason" (a copy); reset=True also clears the count."""
    counts = dict(_FALLBACKS)
    if reset:
        _FALLBACKS.clear()
    return counts


def _count(op: str, reason: str) -> None:
    key = f"{op}: {reason}"
    if key not in _FALLBACKS:
        logger.warning("flashattn2 leaves aten::%s to torch's kernel: %s", op, reason)
    _FALLBACKS[key] += 1


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _check_inputs(*tensors: torch.Tensor) -> None:
    """The rule every op applies to its tensors (the backward to the forward's, so both take the same side)."""
    query = tensors[0]
    if any(t.dtype != query.dtype for t in tensors):
        raise Unsupported("inputs of different dtypes")
    if query.dtype not in HALF:
        raise Unsupported(f"dtype {query.dtype} (torch's flash kernel takes float16 and bfloat16)")
    _check_device(query.device)


def _check_device(device: torch.device) -> None:
    """A device flashattn2 runs on: NVIDIA sm_80+, or the CPU through Triton's interpreter."""
    if device.type == "cuda":
        if torch.version.hip:
            raise Unsupported("a ROCm device")
        major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if major < 8:
            raise Unsupported(f"sm_{major}{minor} (flashattn2 needs sm_80 or newer)")
    elif device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        raise Unsupported(
            f"{device.type} tensors (flashattn2 runs on CUDA, or on the CPU through Triton's interpreter)"
        )


def _window(left, right) -> tuple[int, int]:
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _aux(query: torch.Tensor, rng_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's (rng_state (2,) uint64, unused () uint64) from flashattn2's int64 [seed, 0] (zeros without dropout)."""
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64, device=query.device)
    return rng_state.view(torch.uint64), torch.zeros((), dtype=torch.uint64, device=query.device)


def _seed_state(rng_state: torch.Tensor | None, dropout_p: float) -> torch.Tensor | None:
    """The forward's rng_state as flashattn2's backward reads it (int64, seed first)."""
    if dropout_p == 0 or rng_state is None:  # (None with dropout: flashattn2's backward names it)
        return None
    state = rng_state.reshape(-1)
    if state.dtype == torch.uint64:
        state = state.view(torch.int64)
    if state.dtype != torch.int64:
        raise ArgumentTypeError(f"rng_state must be the uint64 tensor the forward returned, got {rng_state.dtype}")
    return state


def flash_attention_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
    out=None,
):
    """aten::_flash_attention_forward (module docstring); `out`, if given, receives the output and is returned."""
    _check_inputs(query, key, value)
    dropout_p = float(dropout_p)
    if return_debug_mask and dropout_p == 0:
        raise Unsupported("return_debug_mask without dropout (torch's kernel refuses it)")
    paged = block_table is not None or seqused_k is not None
    if paged and dropout_p > 0:
        raise Unsupported("dropout with block_table or seqused_k")
    left, right = _window(window_size_left, window_size_right)
    q, k, v = (_last_dim_contiguous(t) for t in (query, key, value))
    rng_state, debug_mask = None, torch.empty(0, dtype=query.dtype, device=query.device)
    with torch.no_grad():  # a kernel below autograd; direct calls (the tests') build no graph either
        if cum_seq_q is None and paged:  # a KV cache: dense queries over paged or length-limited keys
            o, lse = flash_attn_with_kvcache(
                q, k, v, cache_seqlens=seqused_k, block_table=block_table, softmax_scale=scale, causal=bool(is_causal),
                window_size=(left, right), alibi_slopes=alibi_slopes, return_softmax_lse=True,
            )  # fmt: skip
        elif cum_seq_q is None:
            o, lse, dmask, rng_state = _flash_attn_forward(
                q, k, v, dropout_p, scale, bool(is_causal), left, right, 0.0, alibi_slopes, bool(return_debug_mask)
            )
            debug_mask = dmask if return_debug_mask else debug_mask
        elif paged:
            cu_k = cum_seq_k
            if seqused_k is not None:  # each sequence's first seqused_k[b] keys, as the paged varlen call reads them
                k, v, block_table, cu_k = seqused_pages(seqused_k, cum_seq_k, max_k, k, v, block_table)
            o, lse, _ = flash_attn_varlen_func(
                q, k, v, cum_seq_q, cu_k, max_q, max_k, 0.0, scale, bool(is_causal), (left, right), 0.0, alibi_slopes,
                False, True, block_table,
            )  # fmt: skip
        else:
            o, lse, dmask, rng_state = _flash_attn_varlen_forward(
                q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, scale, bool(is_causal), left, right, 0.0,
                alibi_slopes, bool(return_debug_mask),
            )  # fmt: skip
            debug_mask = dmask if return_debug_mask else debug_mask
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse, *_aux(query, rng_state), debug_mask)


def flash_attention_forward_no_dropout_inplace(
    out,
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    """aten::_flash_attention_forward_no_dropout_inplace: the output written into out; returns the logsumexp."""
    if dropout_p != 0 or return_debug_mask:
        raise Unsupported("dropout or return_debug_mask in the no-dropout op")
    return flash_attention_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, is_causal, False, scale=scale,
        window_size_left=window_size_left, window_size_right=window_size_right, seqused_k=seqused_k,
        alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits, out=out,
    )[1]  # fmt: skip


def flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    """aten::_flash_attention_backward: (dq, dk, dv) in the inputs' layouts. The schema carries no alibi_slopes
    (torch's own kernel's backward has none either)."""
    _check_inputs(query, key, value, grad_out, out)
    if logsumexp.dtype != torch.float32:
        raise Unsupported(f"logsumexp of dtype {logsumexp.dtype}")
    if cum_seq_q is not None and key.dim() != 3:
        raise Unsupported("a paged key in the backward")
    dropout_p = float(dropout_p)
    left, right = _window(window_size_left, window_size_right)
    seed = _seed_state(rng_state, dropout_p)
    dout, q, k, v, o = (_last_dim_contiguous(t) for t in (grad_out, query, key, value, out))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    deterministic = torch.are_deterministic_algorithms_enabled()
    with torch.no_grad():
        if cum_seq_q is None:
            _flash_attn_backward(
                dout, q, k, v, o, logsumexp, dq, dk, dv, dropout_p, scale, bool(is_causal), left, right, 0.0, None,
                deterministic, rng_state=seed,
            )  # fmt: skip
        else:
            _flash_attn_varlen_backward(
                dout, q, k, v, o, logsumexp, dq, dk, dv, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, scale,
                bool(is_causal), left, right, 0.0, None, deterministic, rng_state=seed,
            )  # fmt: skip
    return dq, dk, dv


def scaled_dot_product_flash_attention(
    query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    """aten::_scaled_dot_product_flash_attention: query (batch, nheads, seqlen_q, headdim), key/value (batch,
    nheads_k, seqlen_k, headdim / headdim_v); returns (out, logsumexp (batch, nheads, seqlen_q), None, None,
    seqlen_q, seqlen_k, rng_state, unused, debug_attn_mask)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    o, lse, rng_state, unused, debug_mask = flash_attention_forward(
        q, k, v, None, None, seqlen_q, seqlen_k, dropout_p, is_causal, return_debug_mask, scale=scale
    )
    return o.transpose(1, 2), lse, None, None, seqlen_q, seqlen_k, rng_state, unused, debug_mask


def scaled_dot_product_flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    """aten::_scaled_dot_product_flash_attention_backward: (dq, dk, dv) in SDPA's layout, the forward's rng_state as
    philox_seed."""
    grads = flash_attention_backward(
        *(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp, None, None, max_q, max_k,
        dropout_p, is_causal, philox_seed, philox_offset, scale=scale,
    )  # fmt: skip
    return tuple(g.transpose(1, 2) for g in grads)


def _check_fp8(*tensors: torch.Tensor) -> None:
    """The `.quantized` ops' rule: float8_e4m3fn inputs (FA3's) on a device flashattn2 runs."""
    if any(t.dtype != torch.float8_e4m3fn for t in tensors):
        dtypes = ", ".join(sorted({str(t.dtype) for t in tensors}))
        raise Unsupported(f"descales with {dtypes} inputs (flashattn2's FP8 forward takes float8_e4m3fn)")
    _check_device(tensors[0].device)


def flash_attention_forward_quantized(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    q_descale,
    k_descale,
    v_descale,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
):
    """aten::_flash_attention_forward.quantized: float8_e4m3fn inputs with FA3's descales ((batch, nheads_k) float32,
    None meaning 1) on flashattn2's FP8 forward, the output bf16 (FA3's); fp16/bf16 inputs without descales as the
    plain op (torch's FA3 provider serves them too)."""
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if query.dtype in HALF and all(d is None for d in descales.values()):
        return flash_attention_forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
            scale=scale, window_size_left=window_size_left, window_size_right=window_size_right, seqused_k=seqused_k,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip
    _check_fp8(query, key, value)
    if float(dropout_p) != 0 or return_debug_mask:
        raise Unsupported("dropout or return_debug_mask with FP8 inputs (the FP8 forward has no dropout)")
    if seqused_k is not None:
        raise Unsupported("seqused_k with FP8 inputs")
    window = _window(window_size_left, window_size_right)
    q, k, v = (_last_dim_contiguous(t) for t in (query, key, value))
    with torch.no_grad():
        if cum_seq_q is None:
            o, lse, _ = flash_attn_func(
                q, k, v, 0.0, scale, bool(is_causal), window, 0.0, alibi_slopes, False, True, **descales
            )
        else:
            o, lse, _ = flash_attn_varlen_func(
                q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, scale, bool(is_causal), window, 0.0, alibi_slopes,
                False, True, **descales,
            )  # fmt: skip
    return (o, lse, *_aux(query, None), torch.empty(0, dtype=o.dtype, device=query.device))


def scaled_dot_product_flash_attention_quantized(
    query, key, value, q_descale, k_descale, v_descale, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
    scale=None,
):  # fmt: skip
    """aten::_scaled_dot_product_flash_attention.quantized: SDPA's layout on the FP8 forward (bf16 out)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    o, lse, rng_state, unused, debug_mask = flash_attention_forward_quantized(
        q, k, v, None, None, seqlen_q, seqlen_k, dropout_p, is_causal, return_debug_mask, q_descale, k_descale,
        v_descale, scale=scale,
    )  # fmt: skip
    return o.transpose(1, 2), lse, None, None, seqlen_q, seqlen_k, rng_state, unused, debug_mask


OVERRIDES = {
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_forward.quantized": flash_attention_forward_quantized,
    "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_no_dropout_inplace,
    "_flash_attention_backward": flash_attention_backward,
    "_scaled_dot_product_flash_attention": scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention.quantized": scaled_dot_product_flash_attention_quantized,
    "_scaled_dot_product_flash_attention_backward": scaled_dot_product_flash_attention_backward,
}


def serving(op: str, function, previous):
    """The dispatcher kernel of one op: flashattn2's function, or on Unsupported / NotImplementedError (raised
    before anything is written) `previous` (the kernel torch had, a torch._C._SafeKernelFunction), counted."""

    def kernel(keyset, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (Unsupported, NotImplementedError) as why:
            reason = str(why)
        _count(op, reason)
        if previous is None:
            raise NotImplementedError(
                f"aten::{op}: flashattn2 leaves this call to torch ({reason}), and torch has no kernel of its own here"
            )
        return previous.call_boxed(keyset, *args, **kwargs)

    return kernel


def _exists(op: str) -> bool:
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and (overload or "default") in packet.overloads()


def _previous(op: str, dispatch_key: str):
    """torch's kernel for op at dispatch_key before flashattn2's (None where torch has none)."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return None
    try:
        return get_kernel(f"aten::{op}", dispatch_key)
    except RuntimeError:
        return None


@dataclasses.dataclass
class Handle:
    """What torch's registry keeps while flashattn2 is active; remove() gives torch its kernels back, and SDPA's
    backend priority order as it was (priority: (the order before, the order flash_first set), or None where it
    left the order alone) -- unless something changed the order since, which then stays."""

    library: torch.library.Library | None
    priority: tuple | None = None

    def put_flash_first(self) -> None:
        """flash_first while the kernels are installed (a handle removed before CUDA started: nothing to do)."""
        if self.library is not None and self.priority is None:
            self.priority = flash_first()

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None
        if self.priority is not None:
            before, made = self.priority
            self.priority = None
            if list(torch._C._get_sdp_priority_order()) == made:
                torch._C._set_sdp_priority_order(before)


def first_backend_choice() -> None:
    """Make the process's first SDPA backend choice on CUDA now, if none was made yet: torch sets its default priority
    order (cuDNN first on Hopper and Blackwell with a recent cuDNN) lazily, on that first choice, over whatever order
    was set before it -- so an order set before any scaled_dot_product_attention call would be lost at the first one.
    One choice over tiny CUDA tensors (torch._fused_sdp_choice: no kernel runs) on the current device, CUDA started
    already (install defers it to CUDA's start); nothing without CUDA. Best effort: where the choice fails (every
    backend disabled: torch then returns before setting its order) nothing is settled, as before."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None or not torch.cuda.is_available():
        return
    with contextlib.suppress(RuntimeError):
        t = torch.empty((1, 1, 1, 8), dtype=torch.float16, device="cuda")
        choose(t, t, t)


def when_cuda_starts(fn) -> None:
    """fn() now where CUDA has started or is absent, else at CUDA's lazy start (torch.cuda._lazy_call: right after
    the process's first CUDA use initializes it, on the device then current), so that activating flashattn2 does not
    start CUDA itself (a context on device 0 before a rank's set_device, a fork after it)."""
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is not None and torch.cuda.is_available() and not torch.cuda.is_initialized():
        lazy_call(fn)
    else:
        fn()


def flash_first() -> tuple | None:
    """Put SDPA's flash backend first in torch's backend priority order, a process-wide setting (torch tries cuDNN's
    first on Hopper: a plain F.scaled_dot_product_attention call would not reach flashattn2's kernels), so that the
    calls flash can take run flashattn2's; returns (the order before, the order set), or None on a torch without
    the setting or where flash is first already. torch's lazy default is settled first (first_backend_choice)."""
    get_order = getattr(torch._C, "_get_sdp_priority_order", None)
    set_order = getattr(torch._C, "_set_sdp_priority_order", None)
    if get_order is None or set_order is None:
        return None
    first_backend_choice()
    before = list(get_order())
    flash = int(SDPBackend.FLASH_ATTENTION)
    if not before or before[0] == flash:
        return None
    made = [flash, *(b for b in before if b != flash)]
    set_order(made)
    return before, made


def install(dispatch_key: str = "CUDA") -> Handle:
    """flashattn2's kernels for torch's flash ops at dispatch_key (torch's register_fn: CUDA; the tests install them
    for CPU tensors to run them through the dispatcher), and SDPA's flash backend first in torch's priority order
    (flash_first, once CUDA has started: when_cuda_starts). Ops this torch lacks are skipped."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for op, function in OVERRIDES.items():
        if _exists(op):
            kernel = serving(op, function, _previous(op, dispatch_key))
            library.impl(op, kernel, dispatch_key, with_keyset=True)
    handle = Handle(library)
    when_cuda_starts(handle.put_flash_first)
    return handle


def torch_attention():
    """torch.nn.attention, if it has the flash-attention registry; else RuntimeError naming the torch needed."""
    import torch.nn.attention as attention

    missing = [name for name in REGISTRY_FUNCTIONS if not hasattr(attention, name)]
    if missing:
        raise RuntimeError(
            f"flashattn2.sdpa() needs torch's flash-attention registry, torch.nn.attention.{', '.join(missing)} "
            f"({TORCH_NEEDED}); this is torch {torch.__version__}"
        )
    return attention


@contextlib.contextmanager
def sdpa():
    """A scope in which SDPA's flash backend and varlen_attn run on flashattn2; the implementation active before
    (torch's own, or another provider) comes back at its end."""
    attention = torch_attention()
    register(attention)
    previous = attention.current_flash_attention_impl()
    if previous != NAME:
        attention.activate_flash_attention_impl(NAME)
    try:
        yield
    finally:
        if previous is None:
            attention.restore_flash_attention_impl()
        elif previous != NAME:
            attention.activate_flash_attention_impl(previous)
