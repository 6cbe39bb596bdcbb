"""What the launchers need from Triton's runtime: the kernels, whether they run in the
interpreter, allocation (poisonable by tests) and the TMA scratch allocator.
The kernels are imported on first use. TRITON_INTERPRET=1 must be set before triton is first
imported (torch's custom-op machinery imports it), so in practice before Python starts."""
from __future__ import annotations

import contextlib
import functools
import types

import torch

# Tests set this so every buffer a kernel must fill starts as NaN (or -1 for integers).
POISON = False


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else -1)
    return t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype, t.device)


@functools.cache
def kernels() -> types.SimpleNamespace:
    from ..kernels import bwd, dmask, fill, fwd

    return types.SimpleNamespace(fwd=fwd, bwd=bwd, fill=fill, dmask=dmask)


@torch.compiler.assume_constant_result
def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().fwd.attn_fwd_kernel, InterpretedFunction)


def device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (flash_attn's CUDAGuard)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class _FastLaunch:
    """kernel[grid](*args, **kwargs) without ~25-40 us of Triton's per-launch Python (measured on
    the H200 host: 59 us through JITFunction.run, 16 us for the compiled kernel's launcher).

    The kernel is looked up exactly as JITFunction.run does (its own binder, specialization and
    cache key), so the compiled kernel is the one Triton would pick; only the launch hooks,
    the pre-run hooks and the global-value check are skipped, and the plain path is taken
    whenever one of those is set, when the kernel is not compiled yet, or in the interpreter."""

    __slots__ = ("kernel",)
    disabled = False
    taken = 0  # launches that took the short path (a test checks it is used on a GPU)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        kernel = self.kernel
        if _FastLaunch.disabled or not hasattr(kernel, "device_caches") or kernel.pre_run_hooks:
            return kernel[grid](*args, **kwargs)
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import compute_cache_key

        rt = knobs.runtime
        if rt.launch_enter_hook is not None or rt.launch_exit_hook is not None or rt.debug:
            return kernel[grid](*args, **kwargs)
        device = driver.active.get_current_device()
        caches = kernel.device_caches.get(device)
        if caches is None:
            return kernel[grid](*args, **kwargs)
        kernel_cache, key_cache, _, _, binder = caches
        # JITFunction.run's options, in its order: the cache key holds str(options)
        opts = dict(kwargs)
        opts["debug"] = opts.get("debug", kernel.debug) or rt.debug
        opts["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*args, **opts)
        compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        if compiled is None or hasattr(compiled, "result"):  # first call, or compiling asynchronously
            return kernel[grid](*args, **kwargs)
        stream = driver.active.get_current_stream(device)
        grid = tuple(grid) + (1, 1)
        try:
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *bound.values())
            _FastLaunch.taken += 1
        except TypeError:  # another Triton's launcher signature: use the plain path from now on
            _FastLaunch.disabled = True
            return kernel[grid[:3]](*args, **kwargs)


def fast(kernel) -> _FastLaunch:
    """fast(kernel)[grid](...) launches like kernel[grid](...), with less host time."""
    return _FastLaunch(kernel)


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator; Triton keeps it in a ContextVar,
    so a fresh thread (autograd's backward thread) starts without one."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
