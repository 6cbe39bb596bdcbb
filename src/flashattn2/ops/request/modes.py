"""What a call runs under, beside its arguments: planning.force()'s state (a context variable: each thread and task
its own) and the device's architecture as the plan table names it. Both enter every call's spec
(ops.request.spec.Modes). The names force() and the plan table share live here: the architectures (ARCHS), the kernels
(KERNELS), a tile (TileConfig).

Forcing a plan (A/Bs, tests): `with force(fwd=TileConfig(...), hopper=False, arch="sm80"): ...`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from dataclasses import dataclass, replace

import torch

from ...errors import ArgumentError, ArgumentTypeError

# sm90: Hopper (and Blackwell datacenter parts: TMA, ~227 KB of shared memory per block); sm80: A100 / A800 /
# Orin (163 KB); sm86: the other CUDA GPUs (sm86, sm89, sm120...: 99 KB); interp: Triton's CPU interpreter
ARCHS = ("sm90", "sm80", "sm86", "interp")
# The kernels a plan names (force() takes a tile for each):
#   fwd, bwd_dkdv + bwd_dq: the Triton kernels (kernels/fwd.py, kernels/bwd.py), every arch and option;
#   fwd_hopper_persist: the persistent warp-specialized Gluon forward (kernels/fwd_hopper.py; grid = #SMs;
#     block_m rows per consumer warpgroup, num_warps the consumers' warps, 4 per warpgroup: 8 or 12; qbuf its
#     Q buffers per consumer);
#   fwd_hopper_ws: the warp-specialized Gluon forward (two consumer warpgroups of block_m rows);
#   bwd_hopper: the warp-specialized Gluon backward (kernels/bwd_hopper.py; num_warps its MMA partition's).
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "fwd_hopper_persist", "fwd_hopper_ws", "bwd_hopper")


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    qbuf: int | None = None  # fwd_hopper_persist only: Q buffers per consumer (1 or 2; None: 2)

    def __str__(self) -> str:
        """'64x64w12s3', with 'q1' after it where qbuf is set: how bench ab and the tools write a tile."""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}" + (
            f"q{self.qbuf}" if self.qbuf is not None else ""
        )

    def __post_init__(self):
        if self.qbuf not in (None, 1, 2):
            raise ArgumentError(
                f"TileConfig: qbuf (the persistent forward's Q buffers per consumer) must be 1 or 2, got {self.qbuf}"
            )


_TILE_TEXT = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)(?:q(\d+))?")


def parse_tile(text: str) -> TileConfig | None:
    """The TileConfig that TileConfig.__str__ wrote as text ('64x64w12s3', '64x64w12s3q1'), else None."""
    m = _TILE_TEXT.fullmatch(text)
    return (
        None
        if m is None
        else TileConfig(*(int(x) for x in m.groups()[:4]), qbuf=None if m.group(5) is None else int(m.group(5)))
    )


@dataclass(frozen=True)
class Forced:
    """What force() holds: tiles by kernel, and the switches below (None: not forced)."""

    tiles: tuple[tuple[str, TileConfig], ...] = ()
    arch: str | None = None  # another architecture's rows and load path (sm80 on an H200: pointer loads, no PDL)
    hopper: bool | None = None  # False: the Triton kernels where the Gluon ones would run
    tma: bool | None = None  # the TMA load path on (where alignment allows it; any arch) or off
    host_desc: bool | None = None  # host-built TMA descriptors on the Triton path (dense, power-of-two head dims)
    bwd_order: str | None = None  # the Gluon backward's program order: "head-major" or "grouped"
    fp8_dots: bool | None = None  # FP8 inputs: e4m3 tiles into the dots (True) or decoded to bf16 first (False)

    def tile(self, kernel: str) -> TileConfig | None:
        for name, t in self.tiles:
            if name == kernel:
                return t
        return None


FORCED: contextvars.ContextVar[Forced] = contextvars.ContextVar("flashattn2_forced", default=Forced())

_BWD_ORDERS = ("head-major", "grouped")


def forced() -> Forced:
    """What force() holds in this context (a thread, a task); hashable: part of the launchers' plan-cache keys."""
    return FORCED.get()


@contextlib.contextmanager
def force(
    arch: str | None = None,
    hopper: bool | None = None,
    tma: bool | None = None,
    host_desc: bool | None = None,
    bwd_order: str | None = None,
    fp8_dots: bool | None = None,
    **tiles: TileConfig,
):
    """Inside the with-block (this thread or task only), plans use these tiles (fwd=TileConfig(...),
    fwd_hopper_persist=..., a kernel of KERNELS each) and switches: arch (another architecture's rows and
    load path on a CUDA device; the interpreter ignores it), hopper=False (the Triton kernels instead of the
    Gluon ones; True: as the default, whatever FLASHATTN2_HOPPER says), tma (the TMA load path on or off),
    host_desc (host-built TMA descriptors on the Triton path), bwd_order ("head-major" or "grouped": the Gluon
    backward's program order), fp8_dots (FP8 inputs: e4m3 tiles into the dots, sm_89+'s path, or False: decoded to
    bf16 once loaded, sm_80/86's; in the interpreter, fp32). Arguments left None keep what an enclosing force() set. A call's backward through
    autograd runs under its forward's force() (a with-block around the forward is enough; one around only the
    backward is not seen: autograd runs it in another thread)."""
    unknown = set(tiles) - set(KERNELS)
    if unknown:
        raise ArgumentError(f"force: unknown kernel(s) {sorted(unknown)}; expected one of {KERNELS}")
    for name, tile in tiles.items():
        if not isinstance(tile, TileConfig):
            raise ArgumentTypeError(f"force: {name} must be a TileConfig, got {type(tile).__name__}")
        if tile.qbuf is not None and name != "fwd_hopper_persist":
            raise ArgumentError(
                f"force: qbuf (Q buffers per consumer) is a fwd_hopper_persist setting, given for {name}"
            )
    if arch is not None and arch not in ARCHS[:-1]:
        raise ArgumentError(f"force: arch must be one of {ARCHS[:-1]}, got {arch!r}")
    if bwd_order is not None and bwd_order not in _BWD_ORDERS:
        raise ArgumentError(f"force: bwd_order must be one of {_BWD_ORDERS}, got {bwd_order!r}")
    now = FORCED.get()
    merged = dict(now.tiles)
    merged.update(tiles)
    switches = {
        name: value
        for name, value in dict(
            arch=arch, hopper=hopper, tma=tma, host_desc=host_desc, bwd_order=bwd_order, fp8_dots=fp8_dots
        ).items()
        if value is not None
    }
    with entered(replace(now, tiles=tuple(sorted(merged.items())), **switches)):
        yield


@contextlib.contextmanager
def entered(state: Forced | None):
    """Plans under a Forced that forced() returned earlier: an autograd backward runs in the engine's worker
    thread, which sees no force() of the caller's, so it re-enters its forward's (ops.run.registry). None: as is."""
    if state is None:
        yield
        return
    token = FORCED.set(state)
    try:
        yield
    finally:
        FORCED.reset(token)


def arch_of(device: torch.device) -> str:
    """The table's architecture for a device ("interp" off CUDA), or what force(arch=...) says."""
    if device.type != "cuda":
        return "interp"
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _ARCH.get(index)
    if arch is None:  # get_device_capability costs ~5 us of host time per call
        arch = _ARCH[index] = native_arch(index)
    want = FORCED.get().arch
    if want is not None:  # a test runs another architecture's tiles and load path
        if want == "sm90" and arch != "sm90":
            raise ArgumentError(f"force(arch='sm90') on a {arch} GPU: it has no TMA or PDL")
        return want
    return arch


_ARCH: dict = {}


def native_arch(index: int) -> str:
    """The table's architecture for CUDA device index, from its compute capability: sm90 for Hopper and
    Blackwell datacenter parts (TMA), sm80 for A100/Orin (164 KB shared memory), sm86 for the other Ampere and
    newer GPUs (99 KB). What the kernels were not built for raises NotImplementedError naming the GPU, never a
    fallback: ROCm devices (their capability reads like sm_9x on MI200/MI300, which would pick the Hopper paths;
    the tiles, TMA and wgmma are NVIDIA's) and NVIDIA GPUs before Ampere (flash_attn 2 refuses them too)."""
    name = torch.cuda.get_device_name(index)
    if torch.version.hip:
        raise NotImplementedError(
            f"flashattn2 runs on NVIDIA GPUs (CUDA) only: {name} is a ROCm device "
            f"(torch.version.hip {torch.version.hip}); its kernels and tiles are untested there"
        )
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        raise NotImplementedError(
            f"flashattn2 needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere or "
            f"newer, as flash_attn 2): {name} is sm_{major}{minor}"
        )
    return table_arch(major, minor)


def table_arch(major: int, minor: int) -> str:
    """The plan table's architecture for a compute capability of 8.0 or newer (native_arch's rule)."""
    return "sm90" if major in (9, 10) else "sm80" if (major, minor) in ((8, 0), (8, 7)) else "sm86"


# the GPUs explain() takes by name (--arch), beside the table's own architectures: their compute capability
GPU_ARCHS = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm120": (12, 0)}


def wgmma(device: torch.device) -> bool:
    """Whether a CUDA device is sm_90 (Hopper): wgmma, which the Gluon kernels are written with."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _WGMMA.get(index)
    if found is None:
        # native_arch first: it refuses ROCm devices, whose capability can read (9, 0)
        found = _WGMMA[index] = native_arch(index) == "sm90" and torch.cuda.get_device_capability(index) == (9, 0)
    return found


_WGMMA: dict = {}


def fp8_dots(device: torch.device, arch: str) -> bool:
    """Whether the e4m3 tiles of an FP8 call go straight into the dots: Triton has the e4m3 type, and the tensor
    cores take it, from sm_89 on (the sm86 rows cover sm_86 and sm_89: the capability decides); the interpreter runs
    them too. force(fp8_dots=...) overrides."""
    want = FORCED.get().fp8_dots
    if want is not None:
        return want
    if arch in ("interp", "sm90"):
        return True
    if arch == "sm80" or device.type != "cuda":  # (meta: explain's sm86 device, the lower of the two)
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _FP8_DOTS.get(index)
    if found is None:
        found = _FP8_DOTS[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return found


def fp8_cvt(device: torch.device, arch: str) -> bool:
    """Whether the KV-cache kernel converts e4m3 codes by cvt (Triton's e4m3 type: fp8_dots' rule) rather than by
    kernels.fp8.e4m3_decode's integer arithmetic (sm_80/86, and the interpreter, which runs that path)."""
    return arch != "interp" and fp8_dots(device, arch)


_FP8_DOTS: dict = {}
