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
(gluon.language.nvidia.blackwell.float2) use; ops._runtime.hopper_kernels() falls back to the Triton kernels when a
private name is gone (AttributeError / ImportError).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate

# a runtime integer field: a tensor, or a constexpr where Triton specialised an argument equal to 1 into a constant
Scalar = gl.tensor | gl.constexpr


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
