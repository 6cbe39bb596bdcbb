"""Launching a kernel: once through Triton, then straight to the compiled kernel.

A prepared call (ops.run.call) keeps one Launch per kernel it runs: the kernel and the keywords its plan fixed. The
first launch goes through Triton's own path (JITFunction.run: it binds and specializes the arguments, compiles or finds
the kernel); later launches call the compiled kernel that returned (CompiledKernel.run), pointers passed as integers. A
prepared call's spec fixes everything Triton specializes a kernel on -- the dtypes, every pointer's 16-byte alignment,
every integer's value or class, the constexprs -- so the kernel Triton found for the spec's first call is the one it
would find for each later call. Tests on a GPU set VERIFY_LAUNCH: each direct launch first asks Triton for its choice
(JITFunction.warmup, which compiles or finds without launching) and fails if it is not the remembered kernel.

Measured under a fake CUDA driver (bench/results/launch-host-cpu.md, "The Launch object": Triton's own compiled path on
the CPU, the driver stubbed): Triton's own path costs 9-39 us per launch, a Launch's direct call 2.9-4.4 us without
descriptors on triton 3.6 and 3.9 alike; with host-built TMA descriptors the compiled kernel's run encodes each at
every launch (~1 us each), except on 3.6 (DESCRIPTORS_ENCODED_ONCE), where a descriptor is encoded once per address
and shape (_described; 3.9's launcher takes other arguments there): 5.6-8.8 us there against 11-26 on 3.9.

Triton's own path always: in the interpreter, under a profiler's launch hooks (proton). The private names this
relies on: CompiledKernel.run, .function, .packed_metadata (and on 3.6 the launcher's closure, _described); torch's
_cuda_getCurrentRawStream.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton

from .. import _runtime

DESCRIPTORS_ENCODED_ONCE = triton.__version__.startswith("3.6.")
VERIFY_LAUNCH = False
_STUB = None  # stubbed(): each launch goes here instead
_WATCH = None  # watched(): each launch is shown to it first


@contextlib.contextmanager
def stubbed(record: list | None = None):
    """Inside the block no kernel runs: each launch is a no-op (appended to `record` as (kernel name, grid) when
    given). What is left is the host's path around the launches (`python -m flashattn2 bench host`; tests that count
    launches). Process-wide: for a benchmark or a test, not for a server."""
    global _STUB
    previous = _STUB
    if record is None:
        _STUB = lambda kernel, grid: None  # noqa: E731
    else:
        _STUB = lambda kernel, grid: record.append((kernel.__name__, grid))  # noqa: E731
    try:
        yield record
    finally:
        _STUB = previous


@contextlib.contextmanager
def watched(watch):
    """Inside the block each launch is first shown to watch(kernel, grid, args, kwargs), then runs (tests that check
    which kernels and constexprs a call launches). Process-wide, as stubbed()."""
    global _WATCH
    previous = _WATCH
    _WATCH = watch
    try:
        yield
    finally:
        _WATCH = previous


class HostDesc(tuple):
    """(tensor, shape, strides, block_shape, layout), all tuples but the tensor and the layout: a TMA descriptor built
    on the host (ops.launch.tma.host_desc), made in ~0.5 us. layout: None for a Triton kernel, the shared-memory layout
    (NVMMASharedLayout) for a Gluon one. Direct launches on 3.6 encode it themselves (_tma_map); otherwise Triton gets
    the TensorDescriptor it stands for (_for_triton)."""

    __slots__ = ()


def _for_triton(args: tuple) -> tuple:
    """args with each HostDesc replaced by the TensorDescriptor it stands for (triton's, or Gluon's with its layout)."""
    if not any(type(a) is HostDesc for a in args):
        return args
    out = []
    for a in args:
        if type(a) is HostDesc:
            if a[4] is None:
                desc = object.__new__(_descriptors()[0])  # its checks: done where the HostDesc was made
            else:
                desc = object.__new__(_descriptors()[1])
                desc.layout = a[4]
            desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = (
                a[0],
                list(a[1]),
                list(a[2]),
                list(a[3]),
                "zero",
            )
            a = desc
        out.append(a)
    return tuple(out)


@functools.cache
def _descriptors():
    """(triton's TensorDescriptor, Gluon's): imported once (an import statement per descriptor cost ~1 us each)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor, GluonDescriptor


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) through Triton's own path, for launches no prepared call repeats."""
    if _WATCH is not None:
        _WATCH(kernel, grid, args, kwargs)
    if _STUB is not None:
        _STUB(kernel, grid)
        return
    kernel[grid](*_for_triton(args), **kwargs)


class Launch:
    """One kernel as a prepared call launches it: `launch(grid, *args)` is kernel[grid](*args, **kwargs), every
    parameter not in kwargs positional. The kernel's constexpr parameters must follow its others (the kernels'
    convention: pointers, strides, sizes, scalars, then constexprs)."""

    __slots__ = ("kernel", "kwargs", "constexprs", "compiled", "described", "pointers", "_lock")

    def __init__(self, kernel, **kwargs):
        self.kernel, self.kwargs = kernel, kwargs
        params = getattr(kernel, "params", None)
        # the constexprs in parameter order: the compiled kernel's run takes every parameter
        self.constexprs = None if params is None else tuple(kwargs[p.name] for p in params if p.name in kwargs)
        self.compiled = self.described = self.pointers = None
        self._lock = threading.Lock()

    def __call__(self, grid: tuple, *args) -> None:
        if _WATCH is not None:
            _WATCH(self.kernel, grid, args, self.kwargs)
        if _STUB is not None:
            _STUB(self.kernel, grid)
            return
        compiled = self.compiled
        if compiled is None or _launch_hooks():
            self._first(grid, args)
            return
        if VERIFY_LAUNCH:
            chosen = self.kernel.warmup(*_for_triton(args), grid=grid, **self.kwargs)
            chosen = chosen.result() if hasattr(chosen, "result") else chosen
            if chosen is not compiled:
                raise AssertionError(f"launch of {self.kernel.__name__}: the remembered kernel is not Triton's choice")
        args = list(args)
        for i in self.pointers:
            args[i] = args[i].data_ptr()
        run = compiled.run
        described = self.described
        if described is _TRITON_ENCODES:
            args = _for_triton(args)
        elif described is not None:  # host-built descriptors, each encoded once per address and shape
            run, args = described.launch, described.expand(args)
        device = torch.cuda.current_device()
        run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *self.constexprs,
        )

    def _first(self, grid: tuple, args: tuple) -> None:
        """Through Triton's own path; the compiled kernel it launched is kept for the next launches (not in the
        interpreter, under launch hooks, or for a kernel whose constexprs do not follow its other parameters)."""
        compiled = self.kernel[grid](*_for_triton(args), **self.kwargs)
        if _runtime.interpreted() or _launch_hooks() or self.constexprs is None or not self._ordered(args):
            return
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        with self._lock:  # two threads' first launches: one kernel is kept, both are the same
            self.pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self.described = _described(compiled)
            self.compiled = compiled

    def _ordered(self, args: tuple) -> bool:
        names = [p.name for p in self.kernel.params]
        return len(args) + len(self.constexprs) == len(names) and all(n in self.kwargs for n in names[len(args) :])


# Host-built tensor descriptors (ops.launch.tma.host_desc): Triton's launcher encodes every descriptor argument into a
# CUtensorMap at every launch, in Python (~10 us each on the H200's host; a backward passes 11). On 3.6 a direct launch
# instead encodes a descriptor once per (address, shape, strides, box) -- the CUtensorMap is a function of those alone
# -- and calls the C launcher under Triton's wrapper with the encoded arguments.
_TRITON_ENCODES = object()  # a kernel with descriptor parameters that Triton's launcher must encode
_TMA_MAPS: dict = {}
_TMA_LOCK = threading.Lock()


class _Described:
    __slots__ = ("launch", "positions", "metas")

    def __init__(self, launch, positions, metas):
        self.launch, self.positions, self.metas = launch, positions, metas

    def expand(self, args) -> list:
        out, last = [], 0
        for pos, meta in zip(self.positions, self.metas):
            desc = args[pos]
            out.extend(args[last:pos])
            out.extend(_tma_map(desc, meta))
            last = pos + 1
        out.extend(args[last:])
        return out


def _described(compiled):
    """A _Described for a compiled kernel that takes host-built descriptors (on 3.6); _TRITON_ENCODES when it takes
    some and Triton's launcher must encode them; None when it takes none."""
    try:
        signature = list(compiled.src.signature.values())
    except AttributeError:
        return _TRITON_ENCODES
    positions = [i for i, ty in enumerate(signature) if isinstance(ty, str) and ty.startswith("tensordesc")]
    if not positions:
        return None
    if not DESCRIPTORS_ENCODED_ONCE:
        return _TRITON_ENCODES
    try:
        metas = compiled.metadata.tensordesc_meta
        run = compiled.run
        inner = run.launch
        raw = inner.__closure__[inner.__code__.co_freevars.index("launcher")].cell_contents
    except (AttributeError, ValueError, TypeError, IndexError):
        return _TRITON_ENCODES
    if (
        not metas
        or len(metas) != len(positions)
        or any(m["fp4_padded"] for m in metas)
        or run.global_scratch_size
        or run.profile_scratch_size
    ):
        return _TRITON_ENCODES
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    encoded = [
        (m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], tuple(m["block_size"])) for m in metas
    ]
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl

    def launch(gx, gy, gz, stream, function, *args):
        raw(gx, gy, gz, stream, function, coop, pdl, None, None, *args)

    return _Described(launch, positions, encoded)


def _tma_map(desc, meta) -> list:
    """[CUtensorMap, *shape, *strides]: what Triton's launcher passes for a descriptor (a HostDesc, or a triton
    TensorDescriptor)."""
    if type(desc) is HostDesc:
        tensor, shape, strides = desc[:3]
        padding = "zero"
    else:
        tensor, shape, strides, padding = desc.base, tuple(desc.shape), tuple(desc.strides), desc.padding
    key = (tensor.data_ptr(), shape, strides, meta, padding)
    found = _TMA_MAPS.get(key)
    if found is None:
        swizzle, elem_size, elem_type, block = meta
        cu_map = triton.runtime.driver.active.utils.fill_tma_descriptor(
            key[0], swizzle, elem_size, elem_type, list(block), list(shape), list(strides), 1 if padding == "nan" else 0
        )
        found = [cu_map, *shape, *strides]
        with _TMA_LOCK:
            if len(_TMA_MAPS) >= 4096:  # addresses of freed tensors: start over
                _TMA_MAPS.clear()
            _TMA_MAPS[key] = found
    return found


@functools.cache
def _triton_knobs():
    from triton import knobs

    return knobs


def _launch_hooks() -> bool:
    """Whether a profiler (proton) has hooked Triton's launches: those go through Triton's path."""
    knobs = _triton_knobs()
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
