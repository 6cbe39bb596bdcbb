"""Where Gluon (triton 3.6) puts warpgroup barriers around mbarrier operations: a loop of
mbarrier.wait followed (or not) by mbarrier.arrive, compiled for sm_90 on any machine, and the
bar.sync / try_wait / arrive sequence of its PTX printed. On 2026-12-02 (session 12): one bar.sync
before each arrive (Gluon's arrive is one thread's, after a barrier), none before the waits.

    python tools/gluon_barrier_probe.py
"""
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def probe(X, n, ARRIVE: gl.constexpr):
    a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(a.index(i), count=1)
        mbarrier.init(b.index(i), count=1)
    fence_async_shared()
    for j in range(n):
        s = j % 2
        mbarrier.wait(a.index(s), (j // 2) & 1)
        if ARRIVE:
            mbarrier.arrive(b.index(s))


def main():
    for arrive in (False, True):
        src = GluonASTSource(probe, {"X": "*fp32", "n": "i32", "ARRIVE": "constexpr"}, {"ARRIVE": arrive})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
        ops = [line.split()[0] for line in ptx.splitlines()
               if re.search(r"bar\.sync|mbarrier\.(arrive|try_wait)", line)]
        print(f"wait{' + arrive' if arrive else ''}: {' '.join(ops)}")


if __name__ == "__main__":
    main()
