"""A fake CUDA driver for the CPU: Triton's real (non-interpreter) launch path without a GPU.

With `FakeCuda()` active, `kernel[grid](*args, **kwargs)` compiles for the chosen target (sm_90 unless told
otherwise; ptxas ships with Triton) and runs everything a GPU launch runs in Python -- JITFunction.run's
binding, specialization and cache lookup, CompiledKernel's launch metadata and `run`, the CudaLauncher's
wrapping and host TMA descriptor encoding (make_tensordesc_arg) -- up to the C launcher, which is replaced,
with the other pieces that need libcuda (loading the cubin, cuTensorMapEncodeTiled in the descriptor fill, the
current device and stream), by stubs. CPU tensors stand in for device tensors (their data_ptr is the address
the launcher receives).

What the C launcher would receive is recorded in `launches` (one `Launch` each: grid, stream, function handle,
cooperative/PDL flags, packed metadata, scratch, hooks, and the kernel arguments flattened with tensors as
their addresses, as the C launcher reads them; a descriptor's CUtensorMap is a `TensorMap`, the arguments of
its fill). `record=False` makes the C launcher a no-op (host-time measurements). `c_launcher=True` instead runs
Triton's own C launcher and descriptor fill, built against a stub libcuda.so.1 (`fake_libcuda`): their host time
counts, nothing is recorded.

Triton's driver internals differ between releases; this covers triton 3.6 (a C launcher module generated per
signature, `make_launcher`) and 3.9 (one generic C launcher in the driver's utils, `utils.launch`).
torch.cuda.current_device and torch._C._cuda_getCurrentRawStream (flashattn2's direct launch path asks them)
are patched too; the compiled kernels' handles are dropped on exit, so a kernel loaded under one FakeCuda is
loaded again (with that one's stubs) under the next.
"""

from __future__ import annotations

import gc
import itertools
from typing import NamedTuple

import torch
from triton.backends.nvidia import driver as nvidia_driver
from triton.runtime import _allocation
from triton.runtime.driver import driver as active_driver

# shared memory per block (opt-in maximum) by compute capability, as the devices report it
MAX_SHARED = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376}
STREAM = 0x5EED  # the current stream's handle the fake reports


class TensorMap(tuple):
    """A CUtensorMap: the arguments of the fill that made it (address, swizzle, element size, element type,
    box, shape, strides, padding); two maps are equal when they were filled alike."""

    __slots__ = ()


class Launch(NamedTuple):
    grid: tuple
    stream: int
    function: int
    cooperative: bool
    pdl: bool
    metadata: tuple  # packed: (num_warps, num_ctas, shared memory)
    scratch: tuple  # (global, profile) scratch, None where the kernel takes none
    hooks: tuple  # (launch metadata, enter hook, exit hook)
    args: tuple  # the kernel's arguments in order, tuples flattened, tensors as addresses, constexprs kept


def _flat(args) -> tuple:
    out = []
    for a in args:
        if isinstance(a, tuple) and not isinstance(a, TensorMap):
            out.extend(_flat(a))
        elif isinstance(a, torch.Tensor):
            out.append(a.data_ptr())  # the C launcher's getPointer: data_ptr() of an object that is not an int
        else:
            out.append(a)
    return tuple(out)


class _Module:
    """A loaded cubin: its kernel's name and size."""

    __slots__ = ("name", "size")

    def __init__(self, name, size):
        self.name, self.size = name, size


class _KernelArg:
    """triton 3.9's PyKernelArg (a launcher argument's annotation: kernel argument, constexpr, or tuple)."""

    __slots__ = ("nested_tuple", "type")

    def __init__(self, nested_tuple=None, type=None):
        self.nested_tuple, self.type = nested_tuple, type


class _Utils:
    """The driver's utils (the C module cuda_utils), stubbed."""

    def __init__(self, fake: FakeCuda, generic: bool):
        """generic: triton 3.9's utils (one C launcher for every kernel, `launch`); else 3.6's. Each release's
        utils have only its own names, as the real module has."""
        self.fake = fake
        if generic:
            self.launch = self.generic_launch
            self.build_signature_metadata = self.signature_metadata
            self.fill_tma_descriptor_tiled = self.fill_tiled
            self.fill_tma_descriptor_im2col = self.fill_im2col
        else:
            self.fill_tma_descriptor = self.fill_tiled

    def load_binary(self, name, kernel, shared, device):
        handle = next(self.fake._handles)
        self.fake.functions[handle] = name
        return _Module(name, len(kernel)), handle, 32, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {
            "max_shared_mem": self.fake.max_shared,
            "max_num_regs": 65536,
            "multiprocessor_count": 132,
            "warpSize": 32,
            "sm_clock_rate": 1980000,
            "mem_clock_rate": 2619000,
            "mem_bus_width": 5120,
        }

    def get_device_capability(self, device=None):
        return self.fake.capability

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_default_stream(self, device=None):
        return STREAM

    def is_stream_capturing(self, stream):
        return False

    def cuOccupancyMaxActiveClusters(self, *args):
        return 1

    def set_printf_fifo_size(self, size):
        pass

    def fill_tiled(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        """cuTensorMapEncodeTiled: utils.fill_tma_descriptor in 3.6, fill_tma_descriptor_tiled in 3.9."""
        desc = TensorMap((ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding))
        if self.fake.record:
            self.fake.tma_fills.append(desc)
        return desc

    def fill_im2col(self, *args):
        raise NotImplementedError("fake_cuda: im2col descriptors")

    # triton 3.9: the generic C launcher and its signature metadata
    def signature_metadata(self, kernel_signature):
        return tuple(kernel_signature)

    def generic_launch(self, *args):
        """3.9's C launcher: (grid x, y, z, stream, function, cooperative, pdl, packed metadata, launch metadata,
        enter hook, exit hook, global scratch, profile scratch, argument annotations, kernel signature, the kernel's
        arguments as a tuple)."""
        if len(args) != 16:
            raise TypeError(f"launch() takes exactly 16 arguments ({len(args)} given)")
        self.fake._launch(*args[:7], *args[11:13], *args[7:11], args[15])


class _LauncherModule:
    """triton 3.6's per-signature C launcher module (make_launcher's source, compiled there), stubbed: its
    `launch` takes (grid x, y, z, stream, function, cooperative, pdl, global scratch, profile scratch, packed
    metadata, launch metadata, enter hook, exit hook, *kernel arguments)."""

    def __init__(self, fake: FakeCuda):
        self.fake = fake

    def launch(self, *args):
        if len(args) < 13:
            raise TypeError(f"launch() takes at least 13 arguments ({len(args)} given)")
        self.fake._launch(*args[:13], args[13:])


# libcuda's entry points that Triton's C code (driver.c, the 3.6 launchers) calls, each doing nothing but filling
# its outputs plausibly: a pointer is its own device address, the context and module handles are 1.
_LIBCUDA = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUresult;
static const char *fake_error = "fake libcuda";
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) { *v = 1024; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = (void *)1; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxGetLimit(size_t *v, int limit) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int limit, size_t v) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)1; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = fake_error; return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t ptr) { *(uint64_t *)data = ptr; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, uint64_t ptr) { return 0; }
CUresult cuModuleLoadData(void **m, const void *image) { *m = (void *)1; return 0; }
CUresult cuModuleUnload(void *m) { return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { *f = (void *)1; return 0; }
CUresult cuFuncGetAttribute(int *v, int attr, void *f) { *v = 0; return 0; }
CUresult cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void *f, int config) { return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const void *config) { *n = 1; return 0; }
CUresult cuStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }
CUresult cuTensorMapEncodeTiled(void *map) { return 0; }
CUresult cuTensorMapEncodeIm2col(void *map) { return 0; }
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { return 0; }
"""


def fake_libcuda() -> str:
    """The folder of a stub libcuda.so.1 (_LIBCUDA, built once with the C compiler Triton uses), loaded into the
    process under that soname: Triton's C modules link against it and their dlopen("libcuda.so.1") finds it."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), "fake-libcuda-" + hashlib.sha256(_LIBCUDA.encode()).hexdigest()[:16])
    lib = os.path.join(folder, "libcuda.so.1")
    if not os.path.exists(lib):
        os.makedirs(folder, exist_ok=True)
        src = os.path.join(folder, "libcuda.c")
        with open(src, "w") as f:
            f.write(_LIBCUDA)
        cc = os.environ.get("CC", "gcc")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", src, "-o", lib + ".tmp"], check=True)
        os.replace(lib + ".tmp", lib)
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return folder


class FakeCuda:
    """Context manager: Triton's CUDA driver replaced by stubs (module docstring). capability: the target
    compiled for and reported; record: keep each launch's arguments (False: a no-op C launcher); c_launcher:
    Triton's own C launcher and descriptor fill, built against a stub libcuda (fake_libcuda; nothing recorded),
    so that their host time counts too."""

    def __init__(self, capability: tuple[int, int] = (9, 0), record: bool = True, c_launcher: bool = False):
        self.capability = capability
        self.c_launcher = c_launcher
        self.max_shared = MAX_SHARED.get(capability, 101376)
        self.record = record
        self.launches: list[Launch] = []
        self.tma_fills: list[TensorMap] = []
        self.functions: dict[int, str] = {}  # function handle -> kernel name
        self._handles = itertools.count(0x1000, 0x10)
        self._undo: list = []

    def _launch(self, gx, gy, gz, stream, function, coop, pdl, gs, ps, kmeta, lmeta, enter, exit_, args):
        """The C launcher's work besides the driver: the launch hooks (called as it calls them, with the
        launch metadata), and the record. A hook that calls nothing (an empty HookChain, Triton's default) is
        recorded as None, as is the launch metadata when no hook runs: the driver sees no difference."""
        if enter is not None:
            enter(lmeta)
        if self.record:
            hooks = tuple(h if getattr(h, "calls", True) else None for h in (enter, exit_))
            self.launches.append(
                Launch(
                    (gx, gy, gz),
                    stream,
                    function,
                    bool(coop),
                    bool(pdl),
                    tuple(kmeta),
                    (gs, ps),
                    (lmeta if hooks != (None, None) else None, *hooks),
                    _flat(args),
                )
            )
        if exit_ is not None:
            exit_(lmeta)

    def _set(self, obj, name, value) -> None:
        missing = object()
        old = getattr(obj, name, missing)
        self._undo.append((obj, name, old, missing))
        setattr(obj, name, value)

    def __enter__(self) -> FakeCuda:
        generic = not hasattr(nvidia_driver, "make_launcher")  # 3.6: a C launcher compiled per signature
        utils = _Utils(self, generic)
        drv = object.__new__(nvidia_driver.CudaDriver)  # its __init__ compiles cuda_utils against libcuda
        drv.utils = utils
        drv.launcher_cls = nvidia_driver.CudaLauncher
        drv.get_device_capability = utils.get_device_capability
        drv.get_current_stream = utils.get_default_stream
        drv.get_current_device = utils.get_current_device
        drv.set_current_device = utils.set_current_device
        self._set(active_driver, "_active", drv)
        if self.c_launcher:
            libcuda = fake_libcuda()
            self._set(nvidia_driver, "library_dirs", lambda: [nvidia_driver.libdevice_dir, libcuda])
            real = nvidia_driver.CudaUtils()  # driver.c, built against the stub (its globals set as on a GPU)
            if generic:
                utils.launch = real.launch
                utils.build_signature_metadata = real.build_signature_metadata
                utils.fill_tma_descriptor_tiled = real.fill_tma_descriptor_tiled
            else:
                utils.fill_tma_descriptor = real.fill_tma_descriptor
        elif not generic:
            launcher_module = _LauncherModule(self)
            self._set(nvidia_driver, "compile_module_from_src", lambda src, name, **kw: launcher_module)
            self._set(nvidia_driver, "library_dirs", lambda: [])  # where libcuda is: nowhere
        else:  # 3.9: the generic launcher; the annotations its CudaLauncher builds come from the C module
            self._set(nvidia_driver, "PyKernelArg", _KernelArg)
            for i, name in enumerate(("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE")):
                self._set(nvidia_driver, name, i)
        self._set(torch.cuda, "current_device", utils.get_current_device)
        self._set(torch._C, "_cuda_getCurrentRawStream", utils.get_default_stream)
        # global scratch (device-side descriptors, some Gluon kernels): host memory
        self._allocator_token = _allocation._allocator.set(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8)
        )
        return self

    def __exit__(self, *exc) -> None:
        _allocation._allocator.reset(self._allocator_token)
        for obj, name, old, missing in reversed(self._undo):
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._undo.clear()
        from triton.compiler.compiler import CompiledKernel

        for obj in gc.get_objects():  # handles and launchers made with this fake's stubs
            if type(obj) is CompiledKernel and isinstance(obj.module, _Module):
                obj.module = obj.function = obj._run = None
