"""Which kernel and tile run a dense attention call: one table (TABLE) and one pure function (plan).

    plan(arch, dtype, head_dim, causal, max_seqlen_k, features, direction, head_dim_v=None) -> Plan

reads TABLE's rows for (direction, arch, head-dim bucket, bytes per element) in order and returns the
first whose kernel the call can run (Features, REQUIRES) and whose causal, key-length and value-head-dim bounds
hold. head_dim is q's and k's, head_dim_v v's (None: head_dim); the bucket is the wider one's.
Every list of rows ends with a Triton kernel that runs everything, so a plan always exists. Each row
says in one line which measurement chose it; the full numbers, the runners-up and the rejected
variants are in bench/results/provenance-nvidia-h200.md, the method in docs/tuning.md.

Forcing a plan (A/Bs, tests): `with force(fwd=TileConfig(...), hopper=False, arch="sm80"): ...`, held in a
context variable (each thread and task its own). The environment has one switch: FLASHATTN2_HOPPER=0 turns
the Gluon (Hopper) kernels off.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from dataclasses import dataclass, replace

import torch

from ..errors import ArgumentError, ArgumentTypeError
from . import _runtime

# sm90: Hopper (and Blackwell datacenter parts: TMA, ~227 KB of shared memory per block); sm80: A100 / A800 /
# Orin (163 KB); sm86: the other CUDA GPUs (sm86, sm89, sm120...: 99 KB); interp: Triton's CPU interpreter
ARCHS = ("sm90", "sm80", "sm86", "interp")
HEAD_DIM_BUCKETS = (64, 128, 256, 512)  # BLOCK_D <= 64 share the 64 rows; a call's bucket is its wider head dim's
# the (q/k, v) head dims the Gluon kernels of each direction run (v's at most q's: O leaves through Q's buffer)
GLUON_HEAD_DIMS = {
    "fwd": ((64, 64), (128, 128), (256, 256), (192, 128)),
    "bwd": ((64, 64), (128, 128), (256, 256), (192, 128)),
}
# The kernels a plan names (force() takes a tile for each):
#   fwd, bwd_dkdv + bwd_dq: the Triton kernels (kernels/fwd.py, kernels/bwd.py), every arch and option;
#   fwd_hopper_persist: the persistent warp-specialized Gluon forward (kernels/fwd_hopper.py; grid = #SMs;
#     block_m rows per consumer warpgroup, num_warps the consumers' warps, 4 per warpgroup: 8 or 12; qbuf its
#     Q buffers per consumer);
#   fwd_hopper_ws: the warp-specialized Gluon forward (two consumer warpgroups of block_m rows);
#   bwd_hopper: the warp-specialized Gluon backward (kernels/bwd_hopper.py; num_warps its MMA partition's).
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "fwd_hopper_persist", "fwd_hopper_ws", "bwd_hopper")
GLUON_KERNELS = frozenset({"fwd_hopper_persist", "fwd_hopper_ws", "bwd_hopper"})  # what hopper=False turns off
DIRECTIONS = ("fwd", "bwd")


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
class Features:
    """What a call asks of a kernel beyond its shape and dtype (the launcher fills it in)."""

    varlen: bool = False
    score_mods: bool = False  # a window (other than causal's), softcap, ALiBi or dropout
    # the Gluon kernels can run: a wgmma device (sm_90 exactly), a Triton they build on, every tensor with its heads
    # adjacent and TMA's 16-byte alignment
    gluon: bool = False
    deterministic: bool = True  # backward: dQ in its own pass, bitwise-identical gradients run to run


@dataclass(frozen=True)
class Row:
    """One row of TABLE: where it applies, what runs, why."""

    direction: str
    arch: str
    head_dim: int  # head-dim bucket
    elem_bytes: int
    kernel: str
    tile: TileConfig
    why: str
    causal: bool | None = None  # None: both
    max_seqlen_k: int | None = None  # applies up to this many keys (None: any)
    dq_tile: TileConfig | None = None  # direction "bwd" with kernel bwd_dkdv: the dQ pass's tile
    constexprs: tuple[tuple[str, object], ...] = ()
    head_dim_v: int | None = None  # applies when v's head-dim bucket is at most this (None: any)


@dataclass(frozen=True)
class Plan:
    """What runs: the kernel, its tile (and the dQ pass's), its constexprs beyond the call's own, the launch's
    num_warps, query rows per program (block_m x consumers), and the backward's program order."""

    kernel: str
    tile: TileConfig
    why: str = ""
    causal: bool = False
    dq_tile: TileConfig | None = None
    constexprs: tuple[tuple[str, object], ...] = ()
    num_warps: int = 4
    consumers: int = 1
    # the Gluon backward's program order: 0, head-major; else heads in groups whose Q and dO fit this many bytes
    # (kernels/bwd_hopper_config.py's _ws_program; ops/launch_gluon.bwd_grid)
    l2_group_bytes: int = 0

    @property
    def rows(self) -> int:
        return self.tile.block_m * self.consumers


def _rings(split: bool, do_stages: int | None, dq_split: int, dq_stages: int) -> tuple:
    """The Gluon backward's ring constexprs: dO's own ring (SPLIT_RING, DO_STAGES deep; else dO shares Q's ring,
    DO_STAGES None: the tile's num_stages), dQ_i in DQ_SPLIT column parts, DQ_STAGES staging tiles."""
    return (("SPLIT_RING", split), ("DO_STAGES", do_stages), ("DQ_SPLIT", dq_split), ("DQ_STAGES", dq_stages))


def _triton(
    arch: str, d: int, elem_bytes: int, fwd: TileConfig, dkdv: TileConfig, dq: TileConfig, why: str, dsplit: int = 1
):
    """The Triton rows of one (arch, head-dim bucket, bytes per element): the forward, and the backward (dK/dV
    tile, dQ tile; dsplit > 1: each block's dK, dV and dQ columns over that many programs, kernels/bwd.py's
    DSPLIT)."""
    return (
        Row("fwd", arch, d, elem_bytes, "fwd", fwd, why),
        Row("bwd", arch, d, elem_bytes, "bwd_dkdv", dkdv, why, dq_tile=dq, constexprs=(("DSPLIT", dsplit),)),
    )


T = TileConfig
# (direction, arch, head-dim bucket, bytes per element) that no tile runs: plan() raises NotImplementedError saying why
UNSUPPORTED = {
    ("bwd", "sm86", 512, 4): "the fp32 backward with a head dim past 256 needs 130 KB of shared memory at its smallest "
    "tile (16x16); this GPU has 99 KB per block (fp16 and bf16 run)",
}
# The Gluon backward's causal program order: heads in groups whose Q and dO (a kv head's query heads') stay in
# L2 (50 MB on the H200), each group key block by key block, heaviest first. H200 fp16 bench ab, grouped /
# head-major, causal 512-16k: d256 1.00-1.11, d128 1.01-1.06, d64 0.96-1.03 (a second run 0.98-1.02).
# Counting the fp32 dQ accumulator too: 0.985-1.03x of this, no better. Non-causal programs are alike: head-major.
L2_GROUP_BYTES = 24 << 20

# fmt: off
# The rows of each (direction, arch, head-dim bucket, bytes per element), first match wins. Measured rows: H200,
# bench ab (median of alternated rounds, cuDNN in the same run) or a Triton tile sweep (bench/results/sweep-triton-*);
# TFLOP/s at 16k tokens unless said. Rejected, one line each (measurements in bench/results/provenance-nvidia-h200.md):
# - the one-warpgroup Gluon forward (128x64 s2): d128 0.84-0.89x (causal 0.85-0.98x) of the persistent kernel at
#   512-2k in one run; at d256 the warp-specialized kernel is 1.09-1.23x of it from 512 keys on;
# - the warp-specialized forward's ping-pong (consumers alternating GEMMs through mbarriers): 0.93-0.97x at d128
#   from 2k, 0.88-0.99x at d256;
# - the warp-specialized forward at d128 (64(x2)x128 s2): 0.94-0.98x (causal 0.82-0.91x) of the persistent kernel
#   at 4k-16k, where it was the row before;
# - the persistent forward at d256 (64(x2)x64 s2, 1 Q buffer): 0.87-1.02x of the warp-specialized one;
# - the Gluon backward's split ring at d64/d128: 0.99-1.01x, 0.97-1.01x (at d256 it is the row);
# - the Triton dK/dV kernel adding dQ with atomics (5 matmuls instead of 7): slower at every head dim (TMA
#   reduce: d128 386 -> 344 TFLOP/s, d64 causal 329 -> 320, d256 about half; scalar atomics 0.45-0.66x).
_SM90 = [
    # forward, d64
    Row("fwd", "sm90", 64, 2, "fwd_hopper_persist", T(64, 128, 8, 2, qbuf=2), causal=False, max_seqlen_k=1024,
        why="512/1k 373/391 TFLOP/s (64(x3)x128 s3: 326/387; cuDNN 378/419)"),
    Row("fwd", "sm90", 64, 2, "fwd_hopper_persist", T(64, 64, 12, 4, qbuf=2), causal=True, max_seqlen_k=2048,
        why="causal 512/1k/2k 238/308/347 (128(x2)x64 s3: 232/295/334; s3 238/304/343; cuDNN 257/323/374)"),
    Row("fwd", "sm90", 64, 2, "fwd_hopper_persist", T(64, 128, 12, 3, qbuf=2),
        why="FA3's 192x128: 512-16k 326-467, causal 183-428 (cuDNN 378-446, 259-428); s2 0.98-1.01x from 2k"),
    Row("fwd", "sm90", 64, 2, "fwd", T(128, 128, 4, 3),
        why="Triton sweep: 419/403 full/causal, 375/272 at 2k (128x64 w4 s3: 404/389)"),
    # forward, d128
    Row("fwd", "sm90", 128, 2, "fwd_hopper_persist", T(64, 64, 12, 3, qbuf=1), causal=True, max_seqlen_k=512,
        why="causal 512: 305 fp16, 308 bf16 (2 Q buffers 292/296; cuDNN 322/332)"),
    Row("fwd", "sm90", 128, 2, "fwd_hopper_persist", T(64, 64, 12, 3, qbuf=2), causal=True, max_seqlen_k=1024,
        why="causal 1k: 364 (s2 352; the long row 342; cuDNN 411)"),
    Row("fwd", "sm90", 128, 2, "fwd_hopper_persist", T(64, 64, 12, 2, qbuf=2), causal=True, max_seqlen_k=2048,
        why="causal 2k: 472 (s3 447; the long row 416; cuDNN 443)"),
    Row("fwd", "sm90", 128, 2, "fwd_hopper_persist", T(64, 128, 8, 2, qbuf=2),
        why="512-16k 513-636, causal 255-645 (cuDNN 512-670, 325-618); 1 Q buffer 0.84-0.99x"),
    Row("fwd", "sm90", 128, 2, "fwd", T(128, 64, 4, 2),
        why="Triton sweep: 527/488 full/causal, 470/358 at 2k (128x128 w8 s3: 486/467)"),
    # forward, d256 (and a value head dim of its own: DeepSeek-V3's 192/128)
    Row("fwd", "sm90", 256, 2, "fwd_hopper_persist", T(64, 64, 12, 2, qbuf=2), causal=True, max_seqlen_k=2048,
        head_dim_v=128, why="192/128 causal 2k: 476 (64(x2)x128 s2 q1: 449; cuDNN 467, our d128 490)"),
    Row("fwd", "sm90", 256, 2, "fwd_hopper_persist", T(64, 128, 8, 2, qbuf=1), head_dim_v=128,
        why="192/128 2k-16k 649-711, causal 4k-16k 602-668 (cuDNN 564-600, 470-534); ws 64(x2)x128 s2 0.93-1.0x"),
    Row("fwd", "sm90", 256, 2, "fwd", T(128, 64, 8, 3), head_dim_v=128,
        why="192/128 Triton sweep at 8k: 463/439 full/causal (the d256 row's 128x64 s2: 380/338)"),
    Row("fwd", "sm90", 256, 2, "fwd_hopper_ws", T(64, 64, 4, 2),
        why="512-16k 498-693, causal 326-716 (cuDNN 508-629, 336-528)"),
    Row("fwd", "sm90", 256, 2, "fwd", T(128, 64, 8, 2),
        why="Triton sweep: 516/506 full/causal, 465/361 at 2k (64x64 w4 s1: 446/445)"),
    # backward, d64
    Row("bwd", "sm90", 64, 2, "bwd_hopper", T(128, 128, 8, 2), constexprs=_rings(False, None, 1, 1),
        why="512/2k/8k/16k 322/429/440/453, causal 219/352/404/417 (64x128 s2: 278-398; cuDNN 278-473)"),
    Row("bwd", "sm90", 64, 2, "bwd_dkdv", T(32, 128, 4, 3), dq_tile=T(64, 64, 4, 3),
        why="Triton sweep: 347/322 full/causal, 301/230 at 2k (dK/dV 32x64 w4 s3: 347/316)"),
    # backward, d128
    Row("bwd", "sm90", 128, 2, "bwd_hopper", T(64, 128, 8, 2), constexprs=_rings(False, None, 1, 2),
        why="512-16k 386-540, causal 273-511 (s3 x1 dQ tile: 393-525; cuDNN 341-583, 213-578)"),
    Row("bwd", "sm90", 128, 2, "bwd_dkdv", T(64, 128, 8, 3), dq_tile=T(128, 32, 4, 3),
        why="Triton sweep: 370/357 full/causal, 315/237 at 2k (dK/dV 32x64 w4 s3: 353/345)"),
    # backward, d256 (192/128 first)
    Row("bwd", "sm90", 256, 2, "bwd_hopper", T(64, 64, 8, 2), constexprs=_rings(True, 1, 2, 2), causal=True,
        head_dim_v=128, why="192/128 causal 2k-16k 308-382 (cuDNN 378-488); one ring 0.98-1.0x, 64x128 0.87-0.88x"),
    Row("bwd", "sm90", 256, 2, "bwd_hopper", T(64, 128, 8, 2), constexprs=_rings(False, None, 2, 1), head_dim_v=128,
        why="192/128 2k-16k 353-403 (cuDNN 288-309; 64x64 split ring 0.95-1.01x; 128x64 s1 0.78-0.83x)"),
    Row("bwd", "sm90", 256, 2, "bwd_dkdv", T(32, 64, 4, 2), dq_tile=T(128, 64, 8, 2), head_dim_v=128,
        why="192/128 Triton sweep at 8k: 337 full (the d256 row's tiles 217; dK/dV 64x64 s3 184)"),
    Row("bwd", "sm90", 256, 2, "bwd_hopper", T(64, 64, 8, 2), constexprs=_rings(True, 1, 2, 1),
        why="split ring, dQ_i in two halves: 1.19-1.26x, causal 1.11-1.22x of one ring 64x64 s1 (0.92-1.10x cuDNN)"),
    Row("bwd", "sm90", 256, 2, "bwd_dkdv", T(64, 64, 8, 2), dq_tile=T(128, 32, 8, 2),
        why="Triton sweep: 189/184 full/causal, 187/141 at 2k (SDPA flash 259/253)"),
    # head dims past 256 (q/k or v): Triton only
    # d512 at 4k, 4 heads: fwd 64x64 w8 231 TFLOP/s (64x32 139, 128x64 110); bwd with dK/dV/dQ in 4 column chunks,
    # dK/dV 32x64 w4: 53.9 (2 chunks 56.4, 8 chunks 43.0; one chunk 4.6-12.7 in every tile: the accumulators
    # spill). dK/dV 64x64 w4 read 62.9 but hit an illegal memory access at 128/512 on the H200 (not explained)
    *_triton("sm90", 512, 2, T(64, 64, 8, 1), T(32, 64, 4, 1), T(64, 32, 4, 1),
             "d512 at 4k: fwd 231, bwd 53.9 TFLOP/s (SDPA efficient 139 / 38)", dsplit=4),
]
# The interpreter: ~4 ms per program step whatever the tile (TRITON-ON-CPU.md), so big tiles: every kernel.
INTERP = T(64, 64, 4, 1)
# sm80 and sm86: FA2's A100 tiles (paper, section 4) and smaller ones for 99 KB of shared memory; not measured
# here, tools/compile_check.py keeps them inside each target's shared memory. Each line: the forward's tile, the
# dK/dV and the dQ tiles.
_OTHER = [
    *_triton("sm80", 64, 2,  T(128, 64, 4, 3), T(64, 128, 8, 2), T(128, 64, 8, 2), "FA2's A100 tiles"),
    *_triton("sm80", 128, 2, T(128, 64, 8, 2), T(64, 128, 8, 1), T(128, 64, 8, 1), "FA2's A100 tiles"),
    *_triton("sm80", 256, 2, T(64, 64, 8, 1),  T(64, 64, 8, 1),  T(64, 64, 8, 1),  "FA2's A100 tiles"),
    *_triton("sm80", 512, 2, T(64, 32, 8, 1),  T(32, 64, 4, 1),  T(64, 32, 4, 1),  "fits 163 KB", dsplit=4),
    *_triton("sm86", 64, 2,  T(128, 64, 4, 2), T(64, 64, 4, 2),  T(64, 64, 4, 2),  "fits 99 KB"),
    *_triton("sm86", 128, 2, T(64, 64, 4, 2),  T(64, 64, 4, 1),  T(64, 64, 4, 1),  "fits 99 KB"),
    *_triton("sm86", 256, 2, T(64, 32, 4, 1),  T(32, 32, 4, 1),  T(32, 32, 4, 1),  "fits 99 KB"),
    *_triton("sm86", 512, 2, T(32, 32, 4, 1),  T(16, 32, 4, 1),  T(32, 32, 4, 1),  "fits 99 KB", dsplit=4),
    # fp32 inputs run full-precision dots on CUDA cores: small tiles keep registers and shared memory in bounds (a
    # correctness path, not tuned); every arch
    *(row for arch in ("sm90", "sm80", "sm86") for row in (
        *_triton(arch, 64, 4,  T(64, 32, 4, 2), T(64, 32, 4, 2), T(64, 32, 4, 2), "fp32: CUDA-core dots, small tiles"),
        *_triton(arch, 128, 4, T(32, 32, 4, 1), T(32, 32, 4, 1), T(32, 32, 4, 1), "fp32: CUDA-core dots, small tiles"),
        *_triton(arch, 256, 4, T(16, 16, 4, 1), T(16, 16, 4, 1), T(16, 16, 4, 1), "fp32: CUDA-core dots, small tiles"),
        *_triton(arch, 512, 4, T(16, 16, 4, 1), T(16, 16, 4, 1), T(16, 16, 4, 1), "fp32: CUDA-core dots, small tiles"),
    ) if (row.direction, row.arch, row.head_dim, row.elem_bytes) not in UNSUPPORTED),
    *(row for d in HEAD_DIM_BUCKETS for elem_bytes in (2, 4)
      for row in _triton("interp", d, elem_bytes, INTERP, INTERP, INTERP, "the interpreter: few big steps",
                         dsplit=2 if d > 256 else 1)),  # (the split backward, tested on the CPU)
]
# fmt: on

TABLE: tuple[Row, ...] = (*_SM90, *_OTHER)
assert not any((r.direction, r.arch, r.head_dim, r.elem_bytes) in UNSUPPORTED for r in TABLE)
_ROWS: dict[tuple[str, str, int, int], tuple[Row, ...]] = {}
for _row in TABLE:
    _key = (_row.direction, _row.arch, _row.head_dim, _row.elem_bytes)
    _ROWS[_key] = (*_ROWS.get(_key, ()), _row)


def _gluon_applies(direction: str):
    """Whether a call can run the Gluon kernels of `direction`: dense fp16/bf16 inputs with a (q/k, v) head-dim
    pair of GLUON_HEAD_DIMS, causal or not and no other score modification, keys present, on a device and
    tensors they run on (Features.gluon)."""
    pairs = GLUON_HEAD_DIMS[direction]
    return lambda features, dtype, head_dim, head_dim_v, max_seqlen_k: (
        features.gluon
        and not features.varlen
        and not features.score_mods
        and (head_dim, head_dim_v) in pairs
        and dtype in (torch.float16, torch.bfloat16)
        and max_seqlen_k > 0
    )


_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes

# kernel -> whether a call can run it (features, dtype, head_dim, head_dim_v, max_seqlen_k); the Triton kernels run
# everything
_GLUON_FWD, _GLUON_BWD = _gluon_applies("fwd"), _gluon_applies("bwd")
REQUIRES = {
    "fwd": lambda f, dtype, d, dv, n: True,
    "bwd_dkdv": lambda f, dtype, d, dv, n: True,
    "fwd_hopper_persist": _GLUON_FWD,
    "fwd_hopper_ws": _GLUON_FWD,
    # dQ added in any order: deterministic=False only; the key blocks (64 keys at least) on the grid's second axis
    "bwd_hopper": lambda f, dtype, d, dv, n: (
        not f.deterministic and _GLUON_BWD(f, dtype, d, dv, n) and -(-n // 64) <= _GRID_YZ
    ),
}


@dataclass(frozen=True)
class Forced:
    """What force() holds: tiles by kernel, and the switches below (None: not forced)."""

    tiles: tuple[tuple[str, TileConfig], ...] = ()
    arch: str | None = None  # another architecture's rows and load path (sm80 on an H200: pointer loads, no PDL)
    hopper: bool | None = None  # False: the Triton kernels where the Gluon ones would run
    tma: bool | None = None  # the TMA load path on (where alignment allows it; any arch) or off
    host_desc: bool | None = None  # host-built TMA descriptors on the Triton path (dense, power-of-two head dims)
    bwd_order: str | None = None  # the Gluon backward's program order: "head-major" or "grouped"

    def tile(self, kernel: str) -> TileConfig | None:
        for name, t in self.tiles:
            if name == kernel:
                return t
        return None


_FORCED: contextvars.ContextVar[Forced] = contextvars.ContextVar("flashattn2_forced", default=Forced())
_ENV_HOPPER = _runtime.env_flag("FLASHATTN2_HOPPER")
_BWD_ORDERS = ("head-major", "grouped")


def forced() -> Forced:
    """What force() holds in this context (a thread, a task); hashable: part of the launchers' plan-cache keys."""
    return _FORCED.get()


@contextlib.contextmanager
def force(
    arch: str | None = None,
    hopper: bool | None = None,
    tma: bool | None = None,
    host_desc: bool | None = None,
    bwd_order: str | None = None,
    **tiles: TileConfig,
):
    """Inside the with-block (this thread or task only), plans use these tiles (fwd=TileConfig(...),
    fwd_hopper_persist=..., a kernel of KERNELS each) and switches: arch (another architecture's rows and
    load path on a CUDA device; the interpreter ignores it), hopper=False (the Triton kernels instead of the
    Gluon ones; True: as the default, whatever FLASHATTN2_HOPPER says), tma (the TMA load path on or off),
    host_desc (host-built TMA descriptors on the Triton path), bwd_order ("head-major" or "grouped": the Gluon
    backward's program order). Arguments left None keep what an enclosing force() set. A call's backward through
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
    now = _FORCED.get()
    merged = dict(now.tiles)
    merged.update(tiles)
    switches = {
        name: value
        for name, value in dict(arch=arch, hopper=hopper, tma=tma, host_desc=host_desc, bwd_order=bwd_order).items()
        if value is not None
    }
    with entered(replace(now, tiles=tuple(sorted(merged.items())), **switches)):
        yield


@contextlib.contextmanager
def entered(state: Forced | None):
    """Plans under a Forced that forced() returned earlier: an autograd backward runs in the engine's worker
    thread, which sees no force() of the caller's, so it re-enters its forward's (ops.registry). None: as is."""
    if state is None:
        yield
        return
    token = _FORCED.set(state)
    try:
        yield
    finally:
        _FORCED.reset(token)


def head_dim_bucket(head_dim: int) -> int:
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return max(block_d, 64)


def plan(
    arch: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool,
    max_seqlen_k: int,
    features: Features,
    direction: str,
    head_dim_v: int | None = None,
) -> Plan:
    """The plan of one call (see the module docstring), under what force() holds."""
    return _plan(arch, dtype, head_dim, causal, max_seqlen_k, features, direction, head_dim_v, _FORCED.get())


@functools.lru_cache(maxsize=4096)
def _plan(arch, dtype, head_dim, causal, max_seqlen_k, features, direction, head_dim_v, forced: Forced) -> Plan:
    hopper = forced.hopper if forced.hopper is not None else _ENV_HOPPER is not False
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    v_bucket = head_dim_bucket(head_dim_v)
    key = (direction, arch, head_dim_bucket(max(head_dim, head_dim_v)), 4 if dtype == torch.float32 else 2)
    if key in UNSUPPORTED:
        raise NotImplementedError(
            f"flashattn2 on {arch}, {dtype}, head dim {head_dim}, {direction}: {UNSUPPORTED[key]}"
        )
    for row in _ROWS[key]:
        if (
            (row.causal is not None and row.causal != causal)
            or (row.max_seqlen_k is not None and max_seqlen_k > row.max_seqlen_k)
            or (row.head_dim_v is not None and v_bucket > row.head_dim_v)
        ):
            continue
        if (row.kernel in GLUON_KERNELS and not hopper) or not REQUIRES[row.kernel](
            features, dtype, head_dim, head_dim_v, max_seqlen_k
        ):
            continue
        return _derive(row, forced, causal)
    raise AssertionError(f"no row for {direction} {arch} d{head_dim} {dtype}")  # the Triton rows match everything


def _derive(row: Row, forced: Forced, causal: bool) -> Plan:
    """The row's plan with forced tiles in place and the constexprs that follow from the tile."""
    tile = forced.tile(row.kernel) or row.tile
    constexprs = dict(row.constexprs)
    num_warps, consumers, l2 = tile.num_warps, 1, 0
    if row.kernel == "fwd_hopper_persist":
        if tile.num_warps not in (8, 12):
            raise ArgumentError(
                f"fwd_hopper_persist: num_warps counts the consumer warps (8 or 12), got {tile.num_warps}"
            )
        consumers = tile.num_warps // 4
        # 4: the default partition's warps (the producer); snake order under a causal mask
        constexprs.update(QBUF=tile.qbuf or 2, SNAKE=causal, CONSUMERS=consumers)
        num_warps = 4
    elif row.kernel == "fwd_hopper_ws":
        consumers = 2
    elif row.kernel == "bwd_hopper":
        if constexprs["DO_STAGES"] is None:
            constexprs["DO_STAGES"] = tile.num_stages
        grouped = forced.bwd_order == "grouped" or (forced.bwd_order is None and causal)
        l2 = L2_GROUP_BYTES if grouped else 0
    dq_tile = (forced.tile("bwd_dq") or row.dq_tile) if row.kernel == "bwd_dkdv" else None
    return Plan(row.kernel, tile, row.why, causal, dq_tile, tuple(constexprs.items()), num_warps, consumers, l2)


def rows(arch: str | None = None):
    """TABLE's rows (of one arch if given): what the compile-only check builds."""
    return [row for row in TABLE if arch is None or row.arch == arch]


def arch_of(device: torch.device) -> str:
    """The table's architecture for a device ("interp" off CUDA), or what force(arch=...) says."""
    if device.type != "cuda":
        return "interp"
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _ARCH.get(index)
    if arch is None:  # get_device_capability costs ~5 us of host time per call
        arch = _ARCH[index] = native_arch(index)
    want = _FORCED.get().arch
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
    return "sm90" if major in (9, 10) else "sm80" if (major, minor) in ((8, 0), (8, 7)) else "sm86"


def wgmma(device: torch.device) -> bool:
    """Whether a CUDA device is sm_90 (Hopper): wgmma, which the Gluon kernels are written with."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _WGMMA.get(index)
    if found is None:
        # native_arch first: it refuses ROCm devices, whose capability can read (9, 0)
        found = _WGMMA[index] = native_arch(index) == "sm90" and torch.cuda.get_device_capability(index) == (9, 0)
    return found


_WGMMA: dict = {}
