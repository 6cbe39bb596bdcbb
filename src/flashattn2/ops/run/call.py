"""Every call goes the same way: its spec (ops.request.spec), the prepared call of that spec, its launches.

A prepared call is what every call of one spec shares: the arguments validated (each error names the argument), the
options normalized (ops.request.options.Options), the plan (ops.planning.plan), and what the launchers keep between
calls (a Gluon launch's arguments, the backward's prepared calls). The first call of a spec makes it; later calls go
from their arguments to their launches, checking per call only what the spec cannot prove: index tensors' values (the
opt-in value checks), an int cache_seqlens against the capacity.

The caches (CALLS) are safe under concurrent calls: a read is one dict read; inserts, and the clear past LIMIT specs,
happen under a lock. A spec can be prepared twice by two threads at once; both preparations are equal and one is
kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..request import cache_checks, checks
from .. import planning
from ..request import spec as specs
from ..launch.layout import Layout
from ..request.options import Options


class Calls:
    """spec -> prepared call, bounded: past LIMIT specs (a loop that never repeats one) it starts over."""

    LIMIT = 4096

    def __init__(self):
        self._calls: dict = {}
        self._lock = threading.Lock()

    def get(self, spec):
        return self._calls.get(spec)

    def add(self, spec, call):
        with self._lock:
            if len(self._calls) >= self.LIMIT:
                self._calls.clear()
            return self._calls.setdefault(spec, call)

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()

    def __len__(self) -> int:
        return len(self._calls)


CALLS = Calls()
# the calls of Options as given (from_options: the ops, the private functions, the ring's blocks), whose window edges
# are taken literally: a spec there may name another call than the same arguments of a public call (window_edges)
LITERAL = Calls()


def clear() -> None:
    """Forget every prepared call (tests that change what a plan reads: the Triton release's Gluon switch...)."""
    CALLS.clear()
    LITERAL.clear()
    planning._lookup.cache_clear()


class NotReady(Exception):
    """q, k or v is not as the kernels take it (ops.run.registry.for_kernels): make it so and call again. No call is
    prepared for such a spec (the cache remembers it as not ready), so a prepared call proves its tensors ready and
    the API's repeated call skips the check."""


_NOT_READY = "not ready"  # what the caches hold for a spec whose tensors are not as the kernels take them


def _ready(spec: specs.AttentionSpec) -> bool:
    """Whether ops.run.registry.for_kernels leaves q, k and v as they are."""
    return all(_kernel_ready(t) for t in (spec.q, spec.k, spec.v))


def _kernel_ready(t: specs.TensorSpec) -> bool:
    """for_kernels' rule: the last dimension contiguous and no stride 0, or contiguous by torch's rule (which
    Tensor.contiguous() leaves as is: no element, or every dimension of more than one element in row-major order)."""
    if t.stride[-1] == 1 and 0 not in t.stride:
        return True
    if 0 in t.shape:
        return True
    expected = 1
    for n, stride in zip(reversed(t.shape), reversed(t.stride)):
        if n != 1:
            if stride != expected:
                return False
            expected *= n
    return True


def _scale(head_dim: int, softmax_scale) -> float:
    return float(head_dim**-0.5 if softmax_scale is None else softmax_scale)


class AttentionCall:
    """A validated and planned attention call (dense, varlen, packed; a ring block): options (Options without its
    tensors), the forward's plan, the Gluon forward's launch once made, and the backward's prepared calls."""

    __slots__ = ("spec", "options", "plan", "layout", "launch", "backwards", "empty", "batch")

    def __init__(self, spec: specs.AttentionSpec, options: Options, plan: planning.Plan | planning.DecodePlan | None):
        self.spec, self.options, self.plan = spec, options, plan
        self.layout = Layout(spec, options.softmax_scale)
        self.launch = None
        self.backwards = Calls()
        # a dense call with no query or no key position (flash_attn accepts it): registry.EmptyAttention, no kernel
        self.empty = not spec.varlen and (spec.q.shape[1] == 0 or spec.k.shape[1] == 0)
        self.batch = spec.cu_seqlens_q.shape[0] - 1 if spec.varlen else spec.q.shape[0]

    def backward(self, out, dout, dlse, grads, deterministic: bool) -> BackwardCall:
        """The prepared backward for the output and its gradient dout (their layouts), a logsumexp gradient or None,
        and the gradients' buffers (their layouts). out None: the forward's own output; grads None: the autograd
        Function's own, allocated like q, k and v (ops.run.registry.grad_buffers)."""
        out_spec = self.layout.out_spec if out is None else specs.tensor(out)
        grad_specs = self.layout.grad_specs if grads is None else tuple(specs.tensor(g) for g in grads)
        aligned = specs.aligned(dout) if grads is None and out is None else specs.aligned(out, dout, *grads)
        spec = specs.BackwardSpec(
            self.spec, out_spec, specs.tensor(dout), dlse is not None, deterministic, grad_specs, aligned
        )
        found = self.backwards.get(spec)
        if found is None:
            found = self.backwards.add(spec, BackwardCall(spec, planning.plan(spec)))
        return found


@dataclass
class BackwardCall:
    """A planned attention backward; launch: the Gluon backward's launch once made."""

    spec: specs.BackwardSpec
    plan: planning.Plan
    launch: object = None


def window_edges(window_size, seqlen_k: int) -> tuple[int, int]:
    """flash_attn 2.8's rule for its API's window_size (mha_fwd; mha_varlen_fwd with max_seqlen_k): an edge at or past
    the keys' end is no edge (-1). It is not the literal window: with seqlen_q > seqlen_k + 1, a right edge of
    seqlen_k still hides keys from the first rows; the ring's blocks need such windows, so Options (from_options)
    keep their edges as given. It also keeps the kernels' position sums (a row + the diagonal + an edge) in int32."""
    return tuple(-1 if int(w) >= seqlen_k else int(w) for w in window_size)


def _options(q, spec: specs.AttentionSpec, cu_seqlens_q=None, cu_seqlens_k=None) -> Options:
    left, right = spec.window
    return Options(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=spec.max_seqlen_q,
        max_seqlen_k=spec.max_seqlen_k,
        dropout_p=float(spec.dropout_p),
        softmax_scale=_scale(spec.q.shape[-1], spec.softmax_scale),
        causal=bool(spec.causal),
        window_left=int(left),
        window_right=int(right),
        softcap=float(spec.softcap),
    )


def validate_attention(r, literal: bool = False):
    """Validate an attention request's arguments (each error names the argument); returns the request normalized as
    a spec takes it (max_seqlens ints, the options' plain types, the window's edges by flash_attn's rule
    (window_edges), or as given (literal))."""
    q, k, v, cu_seqlens_q = r.q, r.k, r.v, r.cu_seqlens_q
    varlen = cu_seqlens_q is not None
    checks.check_qkv(q, k, v, varlen=varlen, empty_ok=not varlen, fp8=True)
    checks.check_sink(r.learnable_sink, q)
    maxes = (0, 0)
    batch = q.shape[0]
    if varlen:
        checks.check_cu_tensors(cu_seqlens_q, r.cu_seqlens_k, q)
        maxes = checks.max_seqlens(r.max_seqlen_q, r.max_seqlen_k)
        batch = cu_seqlens_q.shape[0] - 1
    checks.check_options(r.dropout_p, r.softmax_scale, r.window_size, r.softcap)
    checks.check_alibi(r.alibi_slopes, q, batch)
    checks.check_fp8(q, r.descales, batch, k.shape[-2], r.dropout_p)
    window = r.window_size
    left, right = (int(w) for w in window) if literal else window_edges(window, maxes[1] if varlen else k.shape[1])
    return r._replace(
        max_seqlen_q=maxes[0],
        max_seqlen_k=maxes[1],
        dropout_p=float(r.dropout_p),
        softmax_scale=None if r.softmax_scale is None else float(r.softmax_scale),
        causal=bool(r.causal),
        window_size=(left, right),
        softcap=float(r.softcap),
        deterministic=bool(r.deterministic),
    )


def attention(r, literal: bool = False) -> AttentionCall:
    """The prepared call of an attention request (ops.request.request.AttentionRequest): found by its spec, or
    validated, planned and kept. literal: the window's edges as given (from_options), else by flash_attn's rule
    (window_edges). Raises NotReady (after the validation) where q, k or v is not as the kernels take it."""
    cache = LITERAL if literal else CALLS
    try:
        spec = specs.attention(r)
        found = cache.get(spec)
    except (specs.NotCanonical, AttributeError, TypeError):  # a list, a tensor max_seqlen, a non-tensor
        spec = found = None
    if found is not None:
        if found is _NOT_READY:
            raise NotReady
        return found
    canonical = specs.attention(validate_attention(r, literal))
    found = cache.get(canonical)
    if found is None:
        if _ready(canonical):
            call = AttentionCall(canonical, _options(r.q, canonical), None)
            if not call.empty:
                call.plan = planning.plan(canonical)
        else:
            call = _NOT_READY
        found = cache.add(canonical, call)
    if spec is not None and spec != canonical:
        cache.add(spec, found)
    if found is _NOT_READY:
        raise NotReady
    return found


def from_options(q, k, v, options: Options, alibi_slopes, learnable_sink, deterministic: bool = False):
    """The prepared call of an op's arguments (flashattn2::fwd's and ::bwd's: Options, already normalized; the ring's
    blocks, the private _flash_attn_* functions)."""
    return attention(options.request(q, k, v, alibi_slopes, learnable_sink, deterministic), literal=True)


def sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, q, k):
    """A varlen call's per-call part: cu_seqlens clamped into the rows for the kernels, and verify(), to call once the
    kernels are queued (the opt-in value checks: checks.check_cu_values)."""
    return checks.cu_seqlens_for_kernels(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)


class KVCacheCall:
    """A validated and planned flash_attn_with_kvcache call: its normalized options, the plan, the capacity and the
    per-call checks an int cache_seqlens needs."""

    __slots__ = (
        "spec",
        "plan",
        "scale",
        "left",
        "right",
        "capacity",
        "seqlen_new",
        "q_positions",
        "per_token",
        "decode",
        "append",
        "q_ready",
        "indices_ready",
        "seqlens_int",
        "descaled",
    )

    def __init__(self, spec: specs.KVCacheSpec, plan: planning.DecodePlan):
        self.spec, self.plan = spec, plan
        self.scale = _scale(spec.q.shape[-1], spec.softmax_scale)
        paged = spec.block_table is not None
        self.capacity = spec.block_table.shape[1] * spec.k_cache.shape[1] if paged else spec.k_cache.shape[1]
        # flash_attn's rule: a window edge that reaches past the cache is no edge (this decides whether q is
        # rotated per token)
        self.left, self.right = window_edges(spec.window, self.capacity)
        self.per_token = bool(spec.causal) or self.left >= 0 or self.right >= 0
        self.q_positions = spec.q.shape[1] if self.per_token else 1
        self.seqlen_new = 0 if spec.k is None else spec.k.shape[1]
        self.decode = self.append = None  # ops.launch.kvcache's Decode and Append, made at the first run
        # q goes to the kernel as it is: for_kernels would leave it (_kernel_ready), or it is rotated (a copy)
        rotated = spec.k is not None and spec.rotary_cos is not None
        self.q_ready = rotated or _kernel_ready(spec.q)
        # cache_seqlens (a tensor or none) and no other index tensor, alibi_slopes or sink: nothing to make contiguous
        seqlens = spec.cache_seqlens
        # cache_seqlens an int (or none): the kernels take it as an int; descales given: FP8's to pass on
        self.seqlens_int = not isinstance(seqlens, specs.TensorSpec)
        self.descaled = spec.descales != (None, None, None)
        self.indices_ready = (
            (not isinstance(seqlens, specs.TensorSpec) or seqlens.shape[0] <= 1 or seqlens.stride == (1,))
            and spec.cache_batch_idx is None
            and spec.cache_leftpad is None
            and spec.block_table is None
            and spec.alibi is None
            and spec.sink is None
        )

    def seqlen(self, cache_seqlens, rotary_cos) -> int:
        """An int (or absent) cache_seqlens checked against the capacity and the rotary table: the int the kernels
        take (None: the whole cache)."""
        seqlen = self.capacity if cache_seqlens is None else cache_seqlens
        cache_checks.check_kvcache_seqlen(
            seqlen, self.capacity, self.seqlen_new, rotary_cos, self.q_positions, self.spec.block_table is not None
        )
        return seqlen


def kvcache(request) -> KVCacheCall:
    """The prepared call of a flash_attn_with_kvcache request (ops.request.request.KVCacheRequest)."""
    try:
        spec = specs.kvcache(request)
        found = CALLS.get(spec)
    except (specs.NotCanonical, AttributeError, TypeError):
        spec = found = None
    if found is not None:
        return found
    cache_checks.check_kvcache(request)
    r = request
    checks.check_sink(r.learnable_sink, r.q)
    checks.check_options(0.0, r.softmax_scale, r.window_size, r.softcap)
    canonical = specs.kvcache(
        r._replace(
            softmax_scale=None if r.softmax_scale is None else float(r.softmax_scale),
            causal=bool(r.causal),
            window_size=tuple(int(w) for w in r.window_size),
            softcap=float(r.softcap),
            rotary_interleaved=bool(r.rotary_interleaved),
        )
    )
    found = CALLS.get(canonical)
    if found is None:
        found = CALLS.add(canonical, KVCacheCall(canonical, planning.plan(canonical)))
    if spec is not None and spec != canonical:
        CALLS.add(spec, found)
    return found


class PagedCall:
    """A validated and planned paged prefill (flash_attn_varlen_func with block_table)."""

    __slots__ = ("spec", "plan", "scale", "decode")

    def __init__(self, spec: specs.PagedSpec, plan: planning.DecodePlan):
        self.spec, self.plan = spec, plan
        self.scale = _scale(spec.q.shape[-1], spec.softmax_scale)
        self.decode = None  # ops.launch.kvcache.Decode, made at the first run


def paged(r) -> PagedCall:
    """The prepared call of a paged prefill's request (ops.request.request.AttentionRequest with block_table: shapes,
    dtypes and options validated; the values of cu_seqlens and block_table per call, with the value checks on:
    checks.check_paged_values)."""
    try:
        spec = specs.paged(r)
        found = CALLS.get(spec)
    except (specs.NotCanonical, AttributeError, TypeError):
        spec = found = None
    if found is not None:
        return found
    checks.check_options(r.dropout_p, r.softmax_scale, r.window_size, r.softcap)
    checks.check_sink(r.learnable_sink, r.q)
    max_q, max_k = cache_checks.check_varlen_paged(r)
    canonical = specs.paged(
        r._replace(
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            dropout_p=float(r.dropout_p),
            softmax_scale=None if r.softmax_scale is None else float(r.softmax_scale),
            causal=bool(r.causal),
            window_size=window_edges(r.window_size, max_k),
            softcap=float(r.softcap),
        )
    )
    found = CALLS.get(canonical)
    if found is None:
        found = CALLS.add(canonical, PagedCall(canonical, planning.plan(canonical)))
    if spec is not None and spec != canonical:
        CALLS.add(spec, found)
    return found
