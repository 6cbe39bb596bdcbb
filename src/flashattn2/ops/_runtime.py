"""What the launchers need from Triton's runtime: the kernels, whether they run in the
interpreter, allocation (poisonable by tests) and the TMA scratch allocator.
The kernels are imported on first use. TRITON_INTERPRET=1 must be set before triton is first
imported (flashattn2's ops modules import it: `from flashattn2 import ...` does; `import torch` does not): Triton
builds its own language functions for the interpreter or not at that import (_check_interpreter_setting)."""

from __future__ import annotations

import contextlib
import functools
import os
import types

import torch

# Tests set this so every buffer a kernel must fill starts as NaN (or -1 for integers).
POISON = False


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else -1)
    return t


def output_lse(holder, shape, device: torch.device, wanted: bool) -> torch.Tensor:
    """The logsumexp a launch writes: a new tensor for a caller who keeps it; for one who drops it (an eager call
    without return_softmax_lse / return_attn_probs, nothing else reading it), the one tensor kept on
    holder.dropped_lse (a prepared launch: one spec, one device), which every such call writes, at once too, and
    nothing reads: an allocation less per call."""
    if wanted:
        return empty(shape, torch.float32, device)
    lse = holder.dropped_lse
    if lse is None:
        lse = holder.dropped_lse = empty(shape, torch.float32, device)
    return lse


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype, t.device)


@functools.cache
def kernels() -> types.SimpleNamespace:
    from ..kernels import append, bwd, bwd_preprocess, decode, dmask, fill, fwd, merge, rotary

    _check_interpreter_setting(fwd.attn_fwd_kernel)
    return types.SimpleNamespace(
        fwd=fwd,
        bwd=bwd,
        bwd_preprocess=bwd_preprocess,
        fill=fill,
        dmask=dmask,
        rotary=rotary,
        decode=decode,
        append=append,
        merge=merge,
    )


def _check_interpreter_setting(kernel) -> None:
    """Triton builds each @triton.jit function for its interpreter or not by TRITON_INTERPRET at that moment: its own
    language functions (tl.cdiv, tl.sum, ...) when triton is imported, flashattn2's kernels when kernels() imports
    them. Built under two settings, the kernels cannot call Triton's functions (the interpreter raises
    "Cannot call @triton.jit'd outside of the scope of a kernel"): say what happened instead."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    ours = isinstance(kernel, InterpretedFunction)
    if ours == isinstance(tl.standard.cdiv, InterpretedFunction):
        return
    change = "set to 1" if ours else "unset"
    raise RuntimeError(
        f"flashattn2: TRITON_INTERPRET was {change} after triton was imported, so Triton's own functions and "
        "flashattn2's kernels were built for different targets (one for the interpreter, one for the GPU). "
        "TRITON_INTERPRET must be set before triton is imported (importing flashattn2's functions or layers "
        "imports it): in the environment (TRITON_INTERPRET=1 python script.py) or at the top of the script, before "
        "its imports."
    )


# The Triton releases the Gluon kernels were measured and tested on (the H200 suite and the bench). Gluon's API is
# experimental and moves between releases: the kernels compile on every release in pyproject's range (its moves
# are shimmed in kernels/pipeline.py; tests/test_compile_targets.py compiles them), but on a release not listed
# here they run only when FLASHATTN2_HOPPER=1 asks for them (FLASHATTN2_HOPPER=0 turns them off on any release:
# gluon_switch).
GLUON_TESTED = ("3.6.",)


@functools.cache
def gluon_modules() -> types.SimpleNamespace:
    """The Gluon kernels whatever the Triton release (kernels/fwd_hopper.py as .fwd, kernels/bwd_hopper.py as
    .bwd, each None where it does not import: the backward also uses two private names of Triton, the builder's
    TMA reduce). The compile check takes them from here; launches ask hopper_kernels()."""
    import importlib

    found = {}
    for name in ("fwd", "bwd"):
        try:
            found[name] = importlib.import_module(f"..kernels.{name}_hopper", __package__)
        except (ImportError, AttributeError):
            found[name] = None
    return types.SimpleNamespace(**found)


def gluon_tested() -> bool:
    """Whether this Triton release is one the Gluon kernels were measured and tested on (GLUON_TESTED)."""
    import triton

    return triton.__version__.startswith(GLUON_TESTED)


def gluon_switch() -> bool | None:
    """FLASHATTN2_HOPPER, read once: False (0) the Gluon kernels off (the plan table's rows for them are passed
    over; force(hopper=True) still runs them), True (1) on, also on a Triton release they were not measured on,
    None (unset) on where they were measured (GLUON_TESTED)."""
    return _GLUON_SWITCH


@functools.cache
def hopper_kernels() -> types.SimpleNamespace | None:
    """The Gluon kernels the launchers may take (gluon_modules()) on a Triton release they were tested on
    (gluon_tested()) or with FLASHATTN2_HOPPER=1; None on another release: the Triton kernels run then."""
    return gluon_modules() if gluon_tested() or gluon_switch() is True else None


_WARNED_WITHOUT_GLUON = False


def warn_without_gluon(direction: str) -> None:
    """Once per process, a warning that a call on a Hopper GPU takes the Triton kernels where the Gluon ones would
    run: which Triton, what it costs, how to opt in. Silent when FLASHATTN2_HOPPER=0 turned them off."""
    global _WARNED_WITHOUT_GLUON
    if _WARNED_WITHOUT_GLUON or gluon_switch() is False:
        return
    _WARNED_WITHOUT_GLUON = True
    import warnings

    import triton

    tested = ", ".join(v + "x" for v in GLUON_TESTED)
    if hopper_kernels() is None:
        why = (
            f"triton {triton.__version__} is not a release they were measured on ({tested}); "
            "FLASHATTN2_HOPPER=1 in the environment runs them on it (they compile on it; their speed there is "
            "unmeasured)"
        )
    else:
        why = f"its {direction} kernel does not import under triton {triton.__version__}"
    warnings.warn(
        f"flashattn2: this Hopper GPU runs the Triton kernels, not the faster Gluon ones: {why}. On an H200 the "
        "Triton kernels reach about 0.73x the Gluon forward's and 0.74x the Gluon backward's TFLOP/s (headdim 128, "
        "fp16, 8 x 2k); the README's compatibility table has the details. FLASHATTN2_HOPPER=0 keeps them off "
        "without this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


@torch.compiler.assume_constant_result
def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().fwd.attn_fwd_kernel, InterpretedFunction)


_NO_SWITCH = contextlib.nullcontext()


def env_flag(name: str) -> bool | None:
    """A FLASHATTN2_* switch from the environment: False for 0/false/off/no, True for any other
    value, None when unset. Read at import by the modules that use it (not per launch)."""
    env = os.environ.get(name)
    return None if env is None else env.lower() not in ("0", "false", "off", "no")


_GLUON_SWITCH = env_flag("FLASHATTN2_HOPPER")


def device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (flash_attn's CUDAGuard)."""
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(t.device)


def on_device_of(t: torch.Tensor, fn, *args):
    """fn(*args) with t's CUDA device current (device_of without a context entered where none is switched)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):
            return fn(*args)
    return fn(*args)


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a scratch allocator; Triton keeps it in a ContextVar,
    so a fresh thread (autograd's backward thread) starts without one."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


# On sm90 the split-KV combine kernel is launched as a programmatic dependent launch of the
# decode kernel, so its launch overlaps the decode kernel's tail instead of following it.
# H200, CUDA-graph GB/s, median of 5 interleaved rounds: GQA-8 1 x 1k
# 341 -> 359, MHA 1 x 1k 1020 -> 1044, GQA-8 1 x 8k 1394 -> 1404; ties at 1 x 32k and 8 x 8k.
PDL = True


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's number of streaming multiprocessors (cached per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
