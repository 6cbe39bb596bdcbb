"""The launch fast path: kernel[grid](*args, **kwargs) at a fraction of Triton's host cost, and host-built TMA
descriptors encoded once. Written against triton 3.6's JITFunction and launcher (WRITTEN_FOR); on another
Triton every launch takes Triton's own path (SUPPORTED), as it does with FLASHATTN2_DIRECT_LAUNCH=0, under a
profiler's launch hooks and in the interpreter."""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from . import _runtime

WRITTEN_FOR = "3.6."
SUPPORTED = triton.__version__.startswith(WRITTEN_FOR)

# Triton's JITFunction.run costs ~50 us of host time per launch on the H200's host (binding
# ~45 arguments, its cache key, a driver call per pointer to validate it), more than a decode
# kernel runs. After a kernel has been launched once through it, `launch` remembers the compiled
# kernel under a key that holds everything Triton specializes on -- the constexprs and options,
# each tensor's dtype and 16-byte alignment, each int's class (== 1, divisible by 16, 32/64-bit),
# the type of every other argument -- and relaunches it directly, pointers passed as integers.
# Tests on the GPU set VERIFY_LAUNCH: every direct launch then first asks Triton which kernel
# it would have launched (without launching) and fails if it is not the remembered one.
# FLASHATTN2_DIRECT_LAUNCH=0 sends every launch through Triton's JITFunction.run.
DIRECT_LAUNCH = SUPPORTED and _runtime.env_flag("FLASHATTN2_DIRECT_LAUNCH") is not False
VERIFY_LAUNCH = False
direct_launches = 0  # how many launches took the direct path (tests check that it is taken)
_LAUNCHED: dict = {}
_BINDERS: dict = {}
_KERNELS: list = []


def _binder(kernel, args: tuple, kwargs: dict):
    """A function of (args, kwargs) that returns (the key, the launcher's arguments), generated
    for the types of this call's arguments; None for arguments of other types."""
    params = kernel.params
    tail = [p.name for p in params[len(args) :]]
    missing = [n for n in tail if n not in kwargs]
    if missing:
        raise TypeError(f"launch of {kernel.__name__}: parameters {missing} not given by keyword")
    values = list(args) + [kwargs[n] for n in tail]
    exprs = [f"args[{i}]" for i in range(len(args))] + [f"kwargs[{n!r}]" for n in tail]
    lines = [f"a{i} = {e}" for i, e in enumerate(exprs)]
    every = ", ".join(f"a{i}" for i in range(len(values)))
    lines.append(f"if tuple(map(type, ({every},))) != types: return None")
    key, launch = [], []

    def specialized(expr: str, a) -> None:
        """key's terms for what Triton specializes an argument on (a tuple's elements each: the types check
        covers only the top level, so a tuple's element types enter the key too)."""
        if isinstance(a, torch.Tensor):
            key.append(f"{expr}.dtype, {expr}.data_ptr() & 15 == 0")
        elif type(a) is HostDesc:  # Triton specializes a descriptor on its dtype and box
            key.append(f"{expr}[0].dtype, {expr}[3]")
        elif type(a).__name__ == "TensorDescriptor":
            key.append(f"{expr}.base.dtype, tuple({expr}.block_shape)")
        elif type(a) is int:
            # Triton: 1 is a constant; others i32 / i64 / u64, divisible by 16 or not
            key.append(
                f"1 if {expr} == 1 else ({expr} & 15 == 0, -0x80000000 <= {expr} < 0x80000000, {expr} >= 1 << 63)"
            )
        elif type(a) is tuple:
            key.append(f"tuple(map(type, {expr}))")
            for j, element in enumerate(a):
                specialized(f"{expr}[{j}]", element)

    for i, (p, a) in enumerate(zip(params, values)):
        launch.append(f"a{i}")
        if p.is_constexpr:
            key.append(f"a{i}")
        elif isinstance(a, torch.Tensor):
            lines.append(f"p{i} = a{i}.data_ptr()")
            launch[-1] = f"p{i}"
            key.append(f"a{i}.dtype, p{i} & 15 == 0")
        else:
            specialized(f"a{i}", a)
    options = [n for n in kwargs if n not in tail]
    key.append("(" + "".join(f"kwargs[{n!r}], " for n in options) + ")")
    src = "\n    ".join(["def bind(args, kwargs):", *lines, f"return ({', '.join(key)}), ({', '.join(launch)},)"])
    scope: dict = {"types": tuple(map(type, values))}
    exec(src, scope)  # noqa: S102 -- code generated above from the kernel's parameters
    return scope["bind"]


def _bound(kernel, args: tuple, kwargs: dict):
    """(key, the launcher's arguments) of a call, or None when this call site has seen too many
    combinations of argument types. The key holds the call site, the binder (so the argument
    types: None, a float and a bool add nothing else to it), what Triton specializes on, and
    the debug knobs that are part of Triton's own cache key."""
    site = (id(kernel), len(args), tuple(kwargs))
    binders = _BINDERS.get(site)
    if binders is None:
        binders = _BINDERS[site] = []
        _KERNELS.append(kernel)  # keeps id(kernel) from being reused by another function
    for index, bind in enumerate(binders):  # one per combination of argument types seen here
        bound = bind(args, kwargs)
        if bound is not None:
            break
    else:
        if len(binders) >= 16:  # types that never settle: Triton's path
            return None
        binders.append(_binder(kernel, args, kwargs))
        index, bound = len(binders) - 1, binders[-1](args, kwargs)
    knobs = _triton_knobs()
    debug = (kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    return (site, index, debug, bound[0]), bound[1]


class HostDesc(tuple):
    """(tensor, shape, strides, block_shape, layout), all tuples but the tensor and the layout: a
    TMA descriptor built on the host (ops.tma.host_desc), made in ~0.5 us. layout: None for
    a Triton kernel, the shared-memory layout (NVMMASharedLayout) for a Gluon one. Direct
    launches encode it themselves (_tma_map); Triton's own path gets the TensorDescriptor it
    stands for (_for_triton)."""

    __slots__ = ()


def _for_triton(args: tuple) -> tuple:
    """args with each HostDesc replaced by a triton TensorDescriptor."""
    if not any(type(a) is HostDesc for a in args):
        return args
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = []
    for a in args:
        if type(a) is HostDesc:
            if a[4] is None:
                desc = object.__new__(TensorDescriptor)  # its checks: done where the HostDesc was made
            else:
                from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

                desc = object.__new__(GluonDescriptor)
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


_STUB = None  # stubbed(): each launch goes here instead


@contextlib.contextmanager
def stubbed(record: list | None = None):
    """Inside the block no kernel runs: each launch is a no-op (appended to `record` as (kernel name, grid) when
    given). What is left is the host's path around the launches (`python -m flashattn2 bench host`; tests that count
    launches). Process-wide: for a benchmark or a test, not for a server."""
    global _STUB
    previous = _STUB
    _STUB = (
        (lambda kernel, grid: None) if record is None else (lambda kernel, grid: record.append((kernel.__name__, grid)))
    )
    try:
        yield record
    finally:
        _STUB = previous


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs); every parameter after the positional ones by keyword."""
    if _STUB is not None:
        _STUB(kernel, grid)
        return
    if not DIRECT_LAUNCH or _runtime.interpreted() or kernel.pre_run_hooks or _launch_hooks():
        kernel[grid](*_for_triton(args), **kwargs)
        return
    bound = _bound(kernel, args, kwargs)
    if bound is None:
        kernel[grid](*_for_triton(args), **kwargs)
        return
    device = torch.cuda.current_device()
    key = (bound[0], device)
    entry = _LAUNCHED.get(key)
    if entry is None:
        compiled = kernel[grid](*_for_triton(args), **kwargs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        _LAUNCHED[key] = (compiled, _described(compiled))  # how its descriptor arguments are encoded
        return
    compiled, described = entry
    if VERIFY_LAUNCH and _triton_choice(kernel, device, _for_triton(args), kwargs) is not compiled:
        raise AssertionError(f"launch of {kernel.__name__}: the remembered kernel is not the one Triton chooses")
    global direct_launches
    direct_launches += 1
    args = bound[1]
    run = compiled.run
    if described is _TRITON_ENCODES:
        args = _for_triton(args)
    elif described is not None:  # host-built descriptors: encoded here, each one once
        run, args = described.launch, described.expand(args)
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
    )


# Host-built tensor descriptors (ops.tma.host_desc): Triton's launcher encodes every
# descriptor argument into a CUtensorMap at every launch, in Python (~10 us each on the H200's
# host; a backward passes 11). A direct launch instead encodes a descriptor once per (address,
# shape, strides, box) -- the CUtensorMap is a function of those alone -- and calls the C
# launcher under Triton's wrapper with the encoded arguments. Written against triton 3.6's
# launcher (backends/nvidia/driver.py); where its structure differs, Triton's path runs.
_TRITON_ENCODES = object()  # a kernel with descriptor parameters that Triton's launcher must encode
_TMA_MAPS: dict = {}


class _Described:
    __slots__ = ("launch", "positions", "metas")

    def __init__(self, launch, positions, metas):
        self.launch, self.positions, self.metas = launch, positions, metas

    def expand(self, args: tuple) -> list:
        out, last = [], 0
        for pos, meta in zip(self.positions, self.metas):
            desc = args[pos]
            out.extend(args[last:pos])
            out.extend(_tma_map(desc, meta))
            last = pos + 1
        out.extend(args[last:])
        return out


def _described(compiled):
    """A _Described for a compiled kernel that takes host-built descriptors; _TRITON_ENCODES when
    it takes some but Triton's launcher is not the one this was written for; None when it takes
    none."""
    try:
        signature = list(compiled.src.signature.values())
    except AttributeError:
        return _TRITON_ENCODES
    positions = [i for i, ty in enumerate(signature) if isinstance(ty, str) and ty.startswith("tensordesc")]
    if not positions:
        return None
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
    """[CUtensorMap, *shape, *strides]: what Triton's launcher passes for a descriptor (a HostDesc,
    or a triton TensorDescriptor)."""
    if type(desc) is HostDesc:
        tensor, shape, strides = desc[:3]
        padding = "zero"
    else:
        tensor, shape, strides, padding = desc.base, tuple(desc.shape), tuple(desc.strides), desc.padding
    key = (tensor.data_ptr(), shape, strides, meta, padding)
    found = _TMA_MAPS.get(key)
    if found is None:
        if len(_TMA_MAPS) >= 4096:  # addresses of freed tensors: start over
            _TMA_MAPS.clear()
        swizzle, elem_size, elem_type, block = meta
        import triton

        cu_map = triton.runtime.driver.active.utils.fill_tma_descriptor(
            key[0], swizzle, elem_size, elem_type, list(block), list(shape), list(strides), 1 if padding == "nan" else 0
        )
        found = _TMA_MAPS[key] = [cu_map, *shape, *strides]
    return found


def _triton_choice(kernel, device: int, args: tuple, kwargs: dict):
    """The compiled kernel JITFunction.run would launch for these arguments (its steps in
    triton 3.6, without the launch), or None if it has not compiled one."""
    from triton.runtime.jit import compute_cache_key

    knobs = _triton_knobs()
    kwargs = dict(
        kwargs,
        debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
        instrumentation_mode=knobs.compilation.instrumentation_mode,
    )
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    _, specialization, options = binder(*args, **kwargs)
    chosen = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    return chosen.result() if hasattr(chosen, "result") else chosen


@functools.cache
def _triton_knobs():
    from triton import knobs

    return knobs


def _launch_hooks() -> bool:
    """Whether a profiler (proton) has hooked Triton's launches: those go through Triton's path."""
    knobs = _triton_knobs()
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)
