"""The mbarrier ring bookkeeping of the Gluon kernels (kernels/fwd_hopper.py, kernels/bwd_hopper.py), in one place.

A ring is STAGES buffers, each with a `ready` mbarrier (the buffer is filled: a TMA's expect-tx, or an arrive) and
an `empty` one (the buffer's readers are done with it). Position i of a ring -- the i-th fill, counted on across
tiles, heads or flat positions by the filler and the readers alike -- uses buffer i % STAGES and phase
(i // STAGES) & 1 of both of its barriers. Readers wait for position i's ready phase; the filler waits for the
release of position i - STAGES, which is phase (i // STAGES) & 1 ^ 1 of the empty barrier: a fresh barrier passes
a wait on parity 1, so the first STAGES fills go at once.

`Ring` holds the two barrier arrays and the depth. Its methods compute the same index and phase expressions the
kernels wrote out by hand before (the compiled code is unchanged, tools/ptx_hash.py / SASS); buffers that are not
indexed i % STAGES (the persistent forward's Q buffers) use ring_phase directly.

Gluon 3.6 has no public aggregate: `aggregate` is triton.language.core._aggregate, which its own Blackwell helpers
(gluon.language.nvidia.blackwell.float2) use; ops._runtime.gluon_modules() leaves a module out (the Triton kernels
run) when a private name is gone (AttributeError / ImportError).
"""

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

# Gluon's API moved between the Triton releases in pyproject's range; the shims below take each release's name
# for one operation, so the kernels are one source (tests/test_compile_targets.py compiles them on each).
# triton 3.8 reinterprets shared memory only between views of one size, and takes no subview as its source; 3.6,
# 3.7 and 3.9 also take a smaller view directly (the buffer's first bytes)
_SAME_SIZE_REINTERPRET = triton.__version__.startswith("3.8.")


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """Shared memory `smem` seen with another dtype, shape and layout: `_reinterpret` through triton 3.8, public
    `reinterpret` from 3.9 on. A smaller view on 3.8 (_SAME_SIZE_REINTERPRET): the whole buffer, its leading
    dimension k times the view's, then the view's first slice of it (the writer and the reader of such a view use
    this same expression)."""
    method = getattr(smem, "reinterpret", None) or smem._reinterpret
    if _SAME_SIZE_REINTERPRET:
        shape = [gl._unwrap_if_constexpr(n) for n in gl._unwrap_if_constexpr(shape)]
        bits = math.prod(gl._unwrap_if_constexpr(n) for n in smem.shape) * smem.dtype.primitive_bitwidth
        want = math.prod(shape) * gl._unwrap_if_constexpr(dtype).primitive_bitwidth
        if want < bits:
            assert bits % want == 0, f"reinterpret: {shape} does not divide the buffer"
            whole = method(dtype, [shape[0] * (bits // want), *shape[1:]], layout, _semantic=_semantic)
            return whole.slice(0, shape[0], dim=0, _semantic=_semantic)
    return method(dtype, shape, layout, _semantic=_semantic)


@builtin
def tma_load(desc, coord, barrier, result, pred=True, _semantic=None):
    """TMA global -> shared memory, completing on `barrier`: `async_copy_global_to_shared` through triton 3.7,
    `async_load` from 3.8 on (3.9's old name raises)."""
    copy = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    return copy(desc, coord, barrier, result, pred, _semantic=_semantic)


@builtin
def tma_store(desc, coord, src, _semantic=None):
    """TMA shared -> global memory: `async_copy_shared_to_global` through triton 3.7, `async_store` from 3.8 on."""
    copy = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    return copy(desc, coord, src, _semantic=_semantic)


@builtin
def thread_barrier(_semantic=None):
    """A barrier of the threads of the CTA (of the partition, in a warp_specialize region): `thread_barrier` in
    triton 3.6, `barrier` from 3.7 on."""
    return (getattr(gl, "thread_barrier", None) or gl.barrier)(_semantic=_semantic)


# a runtime integer field: a tensor, or a constexpr where Triton specialised an argument equal to 1 into a constant
Scalar = gl.tensor | gl.constexpr


@gluon.constexpr_function
def scalars(values) -> tuple:
    """Integer kernel arguments as an aggregate's Scalar fields hold them: Triton specializes an argument equal to 1
    (a one-token sequence, batch 1, MHA's group size) into a constant, which reaches a constexpr_function as a plain
    int; wrapped back into a constexpr (the aggregate refuses an int)."""
    return tuple(x if isinstance(x, (gl.tensor, gl.constexpr)) else gl.constexpr(x) for x in values)


@gluon.constexpr_function
def by_field(aggregate_value, **fields) -> None:
    """The constructor of an aggregate that only holds its fields (`__init__ = by_field`): each set by keyword, by its
    own name, so that a field added shifts no other; the aggregate refuses a name it does not declare and a declared
    one left unset. Integers (arguments equal to 1, which Triton specializes) wrapped as scalars() wraps them."""
    for name, value in fields.items():
        setattr(aggregate_value, name, gl.constexpr(value) if isinstance(value, int) else value)


@gluon.constexpr_function
def unwrap(x):
    """A constexpr_function's argument as a plain value (arguments that went through a warp_specialize partition
    arrive wrapped in constexpr twice). (A constexpr_function itself: Triton's dependency scan refuses a plain
    Python function referenced from one.)"""
    while hasattr(x, "value") and isinstance(x, gl.constexpr):
        x = x.value
    return x


@gluon.jit
def ring_phase(i, STAGES: gl.constexpr):
    """The mbarrier phase of ring position i (the readers'; the filler waits on the other parity)."""
    return (i // STAGES) & 1


@aggregate
class Ring:
    """STAGES buffers' ready and empty mbarriers ([STAGES, 1] each): position i is buffer i % STAGES, phase
    ring_phase(i). Readers: wait_ready(i), then release(i); the filler: wait_empty(i), then a TMA onto ready_bar(i)
    (or arrive_ready(i))."""

    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, STAGES):
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(unwrap(STAGES))

    @gluon.jit
    def slot(self, i):
        """The buffer of position i."""
        return i % self.STAGES

    @gluon.jit
    def ready_bar(self, i):
        return self.ready.index(i % self.STAGES)

    @gluon.jit
    def wait_ready(self, i):
        """A reader: wait until position i is filled."""
        mbarrier.wait(self.ready.index(i % self.STAGES), ring_phase(i, self.STAGES))

    @gluon.jit
    def wait_empty(self, i):
        """The filler: wait until position i - STAGES, the buffer's previous use, was released."""
        mbarrier.wait(self.empty.index(i % self.STAGES), ring_phase(i, self.STAGES) ^ 1)

    @gluon.jit
    def release(self, i):
        """A reader is done with position i (one arrival on its empty barrier)."""
        mbarrier.arrive(self.empty.index(i % self.STAGES))

    @gluon.jit
    def arrive_ready(self, i):
        """The filler wrote position i itself (no TMA): one arrival on its ready barrier."""
        mbarrier.arrive(self.ready.index(i % self.STAGES))


# A head dim that is not a power of two (DeepSeek-V3's 192; Gluon's tiles and shared-memory buffers are powers of
# two) is two column parts, each a buffer and a TMA load of its own: head_dim_parts(d) = (the largest power of two
# below d, the rest), (d, 0) for a power of two. The helpers below take a tensor's parts as a pair (first, second;
# the first again when there is one part), so a kernel's power-of-two build is what it was before parts existed.
@gluon.constexpr_function
def head_dim_parts(head_dim):
    """(first part, second part) of a head dim: (head_dim, 0) for a power of two, else the largest power of two
    below it and the rest (which must be one)."""
    head_dim = unwrap(head_dim)
    if head_dim & (head_dim - 1) == 0:
        return head_dim, 0
    hi = 1 << (head_dim.bit_length() - 1)
    assert (head_dim - hi) & (head_dim - hi - 1) == 0, f"head dim {head_dim}: not two powers of two"
    return hi, head_dim - hi


@gluon.jit
def alloc_parts(desc, n, rows: gl.constexpr, HEAD_DIM: gl.constexpr):
    """n buffers of [1, rows, part] for each head-dim part of desc = (first part's descriptor, second's):
    (first part's buffers, second's; the first again when HEAD_DIM has one part)."""
    hi: gl.constexpr = head_dim_parts(HEAD_DIM)[0]
    lo: gl.constexpr = head_dim_parts(HEAD_DIM)[1]
    first = gl.allocate_shared_memory(desc[0].dtype, [n, 1, rows, hi], desc[0].layout)
    second = first
    if lo > 0:
        second = gl.allocate_shared_memory(desc[1].dtype, [n, 1, rows, lo], desc[1].layout)
    return first, second


@gluon.jit
def part_descs(desc, desc_lo, HEAD_DIM: gl.constexpr):
    """A tensor's descriptors as alloc_parts takes them: (first part's, second's; the first again)."""
    if head_dim_parts(HEAD_DIM)[1] > 0:
        return desc, desc_lo
    else:
        return desc, desc


@gluon.constexpr_function
def parts_nbytes(desc, HEAD_DIM):
    """The bytes of one load of every head-dim part of desc (alloc_parts)."""
    nbytes = desc[0].block_type.nbytes
    if head_dim_parts(HEAD_DIM)[1] > 0:
        nbytes += desc[1].block_type.nbytes
    return nbytes


@gluon.jit
def load_parts(desc, coord_b, row, col, bar, smem, buf, pred, HEAD_DIM: gl.constexpr):
    """TMA of rows `row` .. of every head-dim part of desc (from column col: the head's first) into buffer buf of
    smem (alloc_parts), onto barrier bar."""
    tma_load(desc[0], [coord_b, row, col], bar, smem[0].index(buf), pred=pred)
    if head_dim_parts(HEAD_DIM)[1] > 0:
        col_lo = col + head_dim_parts(HEAD_DIM)[0]
        tma_load(desc[1], [coord_b, row, col_lo], bar, smem[1].index(buf), pred=pred)
