"""The plan table's data: which kernel and tile run a call, one row each with the measurement that chose it.

TABLE: the dense and varlen attention rows, keyed by direction ("fwd", "bwd"), arch, head-dim bucket and bytes per
element, first match wins (ops.planning reads it). DECODE_ROWS: the KV-cache kernel's rows (flash_attn_with_kvcache,
the paged prefill, the batch-invariant mode), beside it in the same form. The full numbers, the runners-up and the
rejected variants of each measured row are in bench/results/provenance-nvidia-h200.md; the method in docs/tuning.md.
The names the rows use, ARCHS, KERNELS and TileConfig, are ops.request.modes' (force() takes them before any plan is
made).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from ..request.modes import TileConfig

HEAD_DIM_BUCKETS = (64, 128, 256, 512)  # BLOCK_D <= 64 share the 64 rows; a call's bucket is its wider head dim's
# the (q/k, v) head dims the Gluon kernels of each direction run (v's at most q's: O leaves through Q's buffer)
GLUON_HEAD_DIMS = {
    "fwd": ((64, 64), (128, 128), (256, 256), (192, 128)),
    "bwd": ((64, 64), (128, 128), (256, 256), (192, 128)),
}
# the (q/k, v) head dims the Gluon forward runs on e4m3 inputs (FP8; no backward)
GLUON_FP8_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))
GLUON_KERNELS = frozenset({"fwd_hopper_persist", "fwd_hopper_ws", "bwd_hopper"})  # what hopper=False turns off
DIRECTIONS = ("fwd", "bwd")


class AtMost(NamedTuple):
    """A bound a fact must not pass (a condition's want: keys up to 1024)."""

    bound: int

    def __repr__(self) -> str:
        return f"at most {self.bound}"


# what a fact means, where its name does not say it (explain's reasons)
FACT_NOTES = {
    "plain_causal": "causal without a window",
    "keys": "max_seqlen_k",
    "v_bucket": "v's head-dim bucket",
    "hopper": "the Gluon kernels on: FLASHATTN2_HOPPER=0 or force(hopper=False) turns them off",
    "tma": "Hopper or force(tma=True), 16-byte aligned bases and leading strides",
}


class When(NamedTuple):
    """One condition of a row: a call's fact (ops.planning's facts of each table) and the value it must take, or the
    bound it must keep (AtMost). Every table's rows hold them; one walker (planning.common.walk) matches them."""

    fact: str
    want: object

    def unmet(self, facts: dict) -> str | None:
        """Why the call's facts miss this condition, None when they meet it."""
        have = facts[self.fact]
        if have <= self.want.bound if isinstance(self.want, AtMost) else have == self.want:
            return None
        note = FACT_NOTES.get(self.fact)
        return f"{self.fact} is {have!r}, not {self.want!r}" + (f" ({note})" if note else "")


def _whens(row) -> None:
    """A row's `when` written as (fact, value) pairs, held as When conditions (LoadRow's and DecodeRow's)."""
    object.__setattr__(row, "when", tuple(When(*pair) for pair in row.when))


@dataclass(frozen=True)
class Row:
    """One row of TABLE: where it applies, what runs, why. Its bounds (causal, max_seqlen_k, head_dim_v) and the
    Gluon switch its kernel needs are conditions (`when`) on a dense call's facts (planning.dense.facts)."""

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

    @functools.cached_property
    def when(self) -> tuple[When, ...]:
        return (
            *((When("plain_causal", self.causal),) if self.causal is not None else ()),
            *((When("keys", AtMost(self.max_seqlen_k)),) if self.max_seqlen_k is not None else ()),
            *((When("v_bucket", AtMost(self.head_dim_v)),) if self.head_dim_v is not None else ()),
            *((When("hopper", True),) if self.kernel in GLUON_KERNELS else ()),
        )


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
# FP8 (float8_e4m3fn q, k, v with descales; the forward only, as FA3). On sm_90 the Gluon forward at d64/128/256
# (fwd_hopper_tile.FwdConfig's FP8: e4m3 wgmmas, V^T staged by the producer, O through a bf16 buffer of its own),
# else the Triton forward. On sm_90 (and sm_89) the e4m3 tiles go straight into the dots (wgmma/mma e4m3), V read
# transposed (kernels/fwd.vt_src: wgmma's e4m3 operands are K-major); sm_80/86 decode the codes to bf16 once loaded and
# keep their bf16 tiles (shared memory holds e4m3: half of what those tiles were sized for; not measured). sm_90 Triton
# rows: H100 sweep, non-causal 8k, hidden 2048, TFLOP/s beside our bf16 forward (Gluon) in the same run; the Gluon rows'
# numbers: an H100 (bench/results/fp8-nvidia-h100.md), hidden 2048 -- d64/d256 bench fp8 at 16k tokens, d128 the tile
# sweep at 8k and 2k there. Rejected: V as
# it is (Triton transposing each tile through registers): d128 262-299, d256 173-187, d64 389
# (bench/results/fp8-nvidia-h200.md, its H100 sweep).
_FP8_WHY = "FP8: "
_FP8_GLUON_WHY = _FP8_WHY + "the 16-bit row's tile, "
_FP8 = [
    Row("fwd", "sm90", 64, 1, "fwd_hopper_persist", T(64, 128, 12, 3, qbuf=2),
        why=_FP8_GLUON_WHY + "H100 16k 625, causal 568 TFLOP/s (Triton row 540/416; bf16 502/471)"),
    # d128 also swept: 3 consumers s2 702/618/459, s3 692/620/461; bf16 Gluon 661/614/625 in the same run
    Row("fwd", "sm90", 128, 1, "fwd_hopper_persist", T(64, 128, 8, 3, qbuf=2),
        why=_FP8_WHY + "H100 8k 768, causal 654, 2k 502 (s2 740/603/484; 64x256 691/576/465; Triton 704/551/436)"),
    Row("fwd", "sm90", 256, 1, "fwd_hopper_ws", T(64, 64, 4, 2),
        why=_FP8_GLUON_WHY + "H100 16k 905, causal 871 TFLOP/s (Triton row 791/689; bf16 700/655)"),
    Row("fwd", "sm90", 64, 1, "fwd", T(64, 128, 4, 3),
        why=_FP8_WHY + "H100 sweep d64 8k: 506 (128x128w4s3 485, 128x64w4s3 432; bf16 Gluon 515)"),
    Row("fwd", "sm90", 128, 1, "fwd", T(64, 128, 4, 3),
        why=_FP8_WHY + "H100 sweep d128 8k: 710 (128x64w4s3 659, 128x256w8s2 585, 128x128w8s3 575; bf16 Gluon 700)"),
    Row("fwd", "sm90", 256, 1, "fwd", T(128, 128, 8, 2),
        why=_FP8_WHY + "H100 sweep d256 8k: 751 (128x64w8s3 720, 64x64w4s2 719; bf16 Gluon 709)"),
    Row("fwd", "sm90", 512, 1, "fwd", T(64, 32, 8, 1),
        why=_FP8_WHY + "not yet measured; pointer-path spills 169 stores (64x64: 932; bf16 at 64x32: 362)"),
    *(
        Row("fwd", row.arch, row.head_dim, 1, "fwd", row.tile, why=_FP8_WHY + "not yet measured; decoded to bf16, bf16's tile")
        for row in _OTHER
        if row.arch in ("sm80", "sm86") and row.direction == "fwd" and row.elem_bytes == 2
    ),
    *(Row("fwd", "interp", d, 1, "fwd", INTERP, why="the interpreter: few big steps") for d in HEAD_DIM_BUCKETS),
]
# fmt: on

TABLE: tuple[Row, ...] = (*_SM90, *_OTHER, *_FP8)
assert not any((r.direction, r.arch, r.head_dim, r.elem_bytes) in UNSUPPORTED for r in TABLE)
# TABLE's rows by (direction, arch, head-dim bucket, bytes per element), in order
ROWS: dict[tuple[str, str, int, int], tuple[Row, ...]] = {}
for _row in TABLE:
    _key = (_row.direction, _row.arch, _row.head_dim, _row.elem_bytes)
    ROWS[_key] = (*ROWS.get(_key, ()), _row)


@dataclass(frozen=True)
class LoadRow:
    """One row of a load-path table: the path, the facts a call must have (When, written as (fact, value) pairs),
    why."""

    path: str
    when: tuple[When, ...]
    why: str

    __post_init__ = _whens


# fmt: off
# The Triton attention kernels' loads (dense and varlen; the Gluon kernels always take host-built descriptors),
# first match wins; the facts: planning.dense.load_facts (tma: tma_ok's Hopper, alignment and stride rule).
ATTENTION_LOADS: tuple[LoadRow, ...] = (
    LoadRow("host_desc", (("tma", True), ("host_desc_off", False), ("varlen", False), ("pow2_heads_adjacent", True),
                          ("columns_int32", True), ("fp8", False), ("dsplit", 1)),
            why="descriptors over (batch, seqlen, heads * headdim) built once on the host: H200 A/B, outputs bitwise "
                "equal, backward 1.04-1.41x at 512 and 2k tokens, the forward 1.0-1.33x (d256 at 512: 0.92-0.94x); "
                "a program's fixed cost 7.7 us, 46.6 making its own (provenance: host_desc)"),
    LoadRow("tma", (("tma", True),),
            why="descriptors made by each program: the sm_90 Triton rows' tiles were swept on TMA loads"),
    LoadRow("pointers", (), why="pointer loads: every GPU, layout and alignment"),
)
# The KV-cache kernel's key blocks: by TMA only for MLA's latent cache, paged, whole key blocks in a page (the
# latent rows' sweep); else pointer loads. The facts: planning.decoding.load_facts.
DECODE_LOADS: tuple[LoadRow, ...] = (
    LoadRow("kv_tma", (("invariant", False), ("latent_cache", True), ("fp8", False), ("tma_arch", True),
                       ("paged", True), ("leftpad", False), ("page_holds_blocks", True), ("pages_contiguous", True),
                       ("cache_rows_int32", True), ("tma", True)),
            why="MLA's latent cache, paged: h64-h128 209-221 TFLOP/s by TMA, 169-172 without (H200, bf16, page 64); "
                "16-bit tiles straight into the dots (an FP8 cache converts its codes in registers)"),
    LoadRow("pointers", (), why="pointer loads: every cache layout"),
)
# fmt: on


@dataclass(frozen=True)
class DecodeRow:
    """One row of DECODE_ROWS: the facts a call must have (ops.planning's decode facts: When, a name and the value it
    must take), what runs, why. tile.block_m 0: the packed rows' block (planning's register bound, 16 to 64 rows).
    scaled: the tile's BLOCK_N, warps and stages were measured at head dims 128/128 in 16-bit types and other head
    dims keep the bytes of a key block (planning's rule); the latent rows were measured at their own 576/512."""

    when: tuple[When, ...]  # written as (fact, value) pairs
    tile: TileConfig
    why: str
    scaled: bool = True

    __post_init__ = _whens


# KV-cache splits: at most this many (the combine's reduction width); 0 (the default) chooses from the GPU's size
MAX_SPLITS = 128
# the contiguous path's refinements (sweeps below): splits of at most SHORT_SPLIT keys, or at least MANY_PROGRAMS
# programs without splits
SHORT_SPLIT = 1024
MANY_PROGRAMS = 1024
# Batch-invariant mode (ops.request.invariance): one tile per (head dims, dtype) and splits of a fixed number of keys,
# counted from each sequence's first key, every row through the combine, whose reduction over the splits has one fixed
# width (INVARIANT_MAX_SPLITS lanes: empty splits are exact zeros in fixed places). The interpreter splits every 32
# keys, so that the CPU tests cross split boundaries. Not yet tuned on the GPU.
INVARIANT_SPLIT_KEYS = 4096
INVARIANT_SPLIT_KEYS_INTERP = 32
INVARIANT_MAX_SPLITS = 256

# The KV-cache kernel's pipeline where a block has 99 KB of shared memory (sm86's rows: the other Ampere GPUs, and
# Ada's): (the q/k and v block widths from which it runs one stage, the stages it runs at most below them). The rows'
# stages were swept on the H200 (227 KB), and need up to 141 KB at 16 rows (three stages of 128 keys at head dim 128)
# and 106 KB at 64 rows and head dim 256 (two stages) on sm86 (compile_check, pointers and strides specialized as a
# launch specializes them); with the cap every decode tile fits.
DECODE_STAGE_CAP = {"sm86": (512, 2)}

# fmt: off
# The KV-cache kernel's rows, first match wins. Paths: "contiguous" (a cache row per sequence), "page-block" (pages
# a multiple of the key block, no left padding: a key block lies in one page), "page-row" (a page per key row: small
# pages). The contiguous, page-block and page-row rows: a sweep of 12 tiles on the H200 (CUDA-graph GB/s of K/V read
# at bf16, 32 query heads, MHA and GQA-8, batch 1/8/64, cache 1k-128k); the numbers name points where the row won or
# came within 2%. The contiguous refinements: H200 sweeps of 9 and 5 tiles (CUDA-graph GB/s, median of 3
# interleaved rounds, two runs for the non-split points). The latent rows (MLA's latent cache: v_cache the K cache's
# first 512 columns, q/k one more block, 576 = 512 + 64; sm90, 16-bit types; whole key blocks by TMA): H200 sweeps,
# bf16, paged 64, CUDA graphs, 3 alternated rounds (provenance, "latent cache"); TFLOP/s count 2 * (576 + 512) per
# query head and key; the 64-row tile is the one whose wgmma spans the heads (ptxas: 255 registers and ~1 KB of
# spills beside the 64 x 512 fp32 accumulator, with TMA too).
DECODE_ROWS: tuple[DecodeRow, ...] = (
    DecodeRow((("interp", True),), T(0, 16, 1, 1), scaled=False,
              why="the interpreter: ~4 ms per program step whatever the tile, so few steps"),
    DecodeRow((("invariant", True),), T(16, 128, 4, 2),
              why="batch-invariant mode: the contiguous split row's tile at 16 rows for every call (prefill, decode, "
                  "any batch or cache layout), a function of head dims and element size only"),
    DecodeRow((("latent", True), ("rows", 64)), T(64, 64, 8, 2), scaled=False,
              why="TMA: h128 64x16k 221, 128x8k 221, 8x8k 146-148; h64 209-221 TFLOP/s (s1 175-186; 64x32w8 s2 "
                  "195, s3 188; without TMA 64x64w8s1 169-172; the generic 16x32w8: 66, 66, 72, 64; 32x32w4 124-127)"),
    DecodeRow((("latent", True), ("rows", 32)), T(32, 64, 8, 2), scaled=False,
              why="TMA: h32 64x16k 129 = 0.77x a device copy's GB/s (32x32w4 s2 122, s1 110; 16x32w4s2 106; "
                  "64x64w8s2 110)"),
    DecodeRow((("latent", True), ("rows", 16)), T(16, 32, 4, 2), scaled=False,
              why="TMA: h16 64x16k 97 = 1.16x the copy's (s1 76-77; 16x64w8s2 84; without TMA 66; 16x32w8 57)"),
    # FP8 caches (e4m3 codes converted in registers, half a 16-bit cache's bytes): the 16-bit contiguous rows' tiles,
    # the key block as wide as a 16-bit cache's (its registers and shared memory after the conversion); not swept.
    # H200 (bench/results/fp8-decode-nvidia-h200.md): 2.1-2.4 TB/s of codes (bf16 4.2-4.5), 0.87x bf16's time at
    # batch 64 x 64k keys; H100: 0.58-0.64x. The integer decode on sm_90 (before NATIVE): 1.47x on the H100
    DecodeRow((("fp8", True), ("split", True)), T(0, 128, 4, 2),
              why="FP8 cache, the 16-bit split row's tile: not swept (H200 64x64k 0.87x bf16's step time)"),
    DecodeRow((("fp8", True), ("split", False)), T(0, 128, 4, 3),
              why="FP8 cache, the 16-bit row's tile: not swept (H200 64x64k 2434 GB/s of codes, 0.87x bf16's time)"),
    DecodeRow((("path", "contiguous"), ("split", True), ("short", True)), T(0, 64, 4, 3),
              why="splits of <= SHORT_SPLIT keys: GQA 1x32k 2670 GB/s (128/4/2: 2610), 1x8k 1444 (1389); MHA 1x8k "
                  "2769 (2685); longer splits keep 128/4/2: GQA 8x32k 4249 vs 4225, MHA 1x128k 4431 vs 4399"),
    DecodeRow((("path", "contiguous"), ("split", True)), T(0, 128, 4, 2),
              why="MHA 1x32k 3626 GB/s, 1x128k 4017; GQA 8x32k 3996"),
    DecodeRow((("path", "contiguous"), ("split", False), ("many", True)), T(0, 128, 4, 2),
              why=">= MANY_PROGRAMS programs (3 resident per SM, not 1): MHA 64x1k 4318 and 4320 GB/s (128/4/3: "
                  "4224, 4225), 64x8k 4629 (4545)"),
    DecodeRow((("path", "contiguous"), ("split", False)), T(0, 128, 4, 3),
              why="GQA 64x8k 4462 GB/s (stages 2: 3995), 64x128k 4659; MHA 64x32k 4580; with fewer than "
                  "MANY_PROGRAMS programs it beats 128/4/2: GQA 64x8k 4455 vs 3995, 64x1k 3355 vs 3268"),
    DecodeRow((("path", "page-block"), ("split", True)), T(0, 128, 8, 2),
              why="page 256: MHA 1x32k 3662 GB/s, 1x128k 4118; GQA 1x32k 2195"),
    DecodeRow((("path", "page-block"), ("split", False)), T(0, 128, 8, 3),
              why="page 256: MHA 8x8k 4247 GB/s, 64x32k 4550; GQA 64x8k 4403"),
    DecodeRow((("path", "page-row"), ("split", True)), T(0, 128, 4, 2),
              why="page 16: MHA 1x128k 4000 GB/s; GQA 8x32k 4000"),
    DecodeRow((("path", "page-row"), ("split", False)), T(0, 128, 8, 2),
              why="page 16: MHA 8x8k 4043 GB/s, 8x128k 4313, 64x32k 4309; GQA 64x128k 4317 (64/4/3 wins at batch "
                  "64, 4513 and 4509, but loses 20% at batch 8)"),
)
# fmt: on
