"""Tile configurations: data, keyed by (arch, head-dim bucket, element size, causal, kernel).

Every entry says which measurement chose it. "interp" is the CPU interpreter, where the cost is
per program step, not per FLOP (../docs/notes.md): big tiles, few steps.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from ..errors import ArgumentError, ArgumentTypeError
from . import _runtime

# bwd_dkdv_atomic: dK/dV adding dQ with atomics; fwd_hopper: the Gluon forward (kernels/fwd_hopper.py);
# fwd_hopper_ws: its warp-specialized kernel (block_m: rows per consumer warpgroup, two per program;
# num_warps: the default partition's, always 4); fwd_hopper_persist: its persistent kernel (block_m
# the same; num_warps: the consumer warps, 4 per consumer warpgroup, 8 or 12); bwd_hopper: the
# warp-specialized Gluon backward (kernels/bwd_hopper.py; num_warps: the MMA partition's, always 8);
# bwd_hopper_split: its split-ring variant (GLUON_BWD_SPLIT; num_stages: Q's ring)
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic", "fwd_hopper", "fwd_hopper_ws", "fwd_hopper_persist",
           "bwd_hopper", "bwd_hopper_split")
# sm90: Hopper (and Blackwell datacenter parts: TMA, ~227 KB of shared memory per block);
# sm80: A100 / A800 / Orin (163 KB); sm86: the other CUDA GPUs (sm86, sm89, sm120...: 99 KB)
ARCHS = ("sm90", "sm80", "sm86", "interp")
HEAD_DIM_BUCKETS = (64, 128, 256)  # BLOCK_D <= 64 share the 64 entry


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    # fwd_hopper_persist only: Q buffers per consumer (1 or 2; None: GLUON_PERSIST_QBUF's for the head dim)
    qbuf: int | None = None

    def __str__(self) -> str:
        """'64x64w12s3', with 'q1' after it where qbuf is set: how bench ab and the tools write a tile."""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}" + (
            f"q{self.qbuf}" if self.qbuf is not None else "")

    def __post_init__(self):
        if self.qbuf not in (None, 1, 2):
            raise ArgumentError(f"TileConfig: qbuf (the persistent forward's Q buffers per consumer) must be 1 or 2, "
                             f"got {self.qbuf}")


# a tile as TileConfig.__str__ writes it
_TILE_TEXT = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)(?:q(\d+))?")


def parse_tile(text: str) -> TileConfig | None:
    """The TileConfig that TileConfig.__str__ wrote as text ('64x64w12s3', '64x64w12s3q1'), else None."""
    m = _TILE_TEXT.fullmatch(text)
    return None if m is None else TileConfig(*(int(x) for x in m.groups()[:4]),
                                             qbuf=None if m.group(5) is None else int(m.group(5)))


# fmt: off
# (arch, head-dim bucket, bytes per element, kernel) -> TileConfig; causal shares the entry
# unless _TABLE_CAUSAL overrides it.
_TABLE: dict[tuple[str, int, int, str], TileConfig] = {
    # H200, fp16, 16k tokens, TMA loads (tools/sweep.py; docs/notes.md has the table).
    # d64 fwd: 419/403 at 16k (full/causal), 375/272 at 2k; 128x64 w4 s3: 404/389/368/281
    ("sm90", 64, 2, "fwd"):        TileConfig(128, 128, 4, 3),
    # d128 fwd: 527/488 TFLOP/s at 16k (full/causal), 470/358 at 2k; next best 128x128 w8 s3: 486/467
    ("sm90", 128, 2, "fwd"):       TileConfig(128, 64, 4, 2),
    # d256 fwd: 516/506 at 16k, 465/361 at 2k (SDPA flash 320/292, 305/262); 64x64 w4 s1: 446/445
    ("sm90", 256, 2, "fwd"):       TileConfig(128, 64, 8, 2),
    # The Gluon forward (sm_90 exactly: wgmma; dense inputs without softcap/ALiBi/window/dropout).
    # H200, fp16, one run beside SDPA cuDNN (the prototype of the kernel, same schedule, 2-D descriptors):
    # d64 non-causal 128x64 w8 s2: 366/405/419 at 512/2k/16k (cuDNN 386/438/440; w4 356/393/409);
    # causal w4 (_TABLE_CAUSAL): 245/361/417 (cuDNN 257/374/423; w8 239/352/398).
    ("sm90", 64, 2, "fwd_hopper"):  TileConfig(128, 64, 8, 2),
    # d128 128x64 w4 s2: 468/520/527 non-causal, 314/441/515 causal (cuDNN 493/579/568, 328/465/557;
    # 128x128 w8: 382/467/502, 248/389/482)
    ("sm90", 128, 2, "fwd_hopper"): TileConfig(128, 64, 4, 2),
    # d256: the accumulator needs two warpgroups; 128x64 w8 s2 fits (197 KB of shared memory)
    ("sm90", 256, 2, "fwd_hopper"): TileConfig(128, 64, 8, 2),
    # The warp-specialized Gluon forward (ops.attention._hopper_forward: GLUON_WS_ABOVE_SEQLEN_K,
    # where the persistent kernel below is not taken: headdim 256, or gluon_persist turned off).
    # H200, fp16, interleaved A/B in one process through the library, one-warpgroup kernel -> this,
    # ping-pong off, at 512/1k/2k/4k/8k/16k (cuDNN in the same run):
    # d128 64(x2)x128 s2: 445/498/562/531/529/528 -> 401/489/572/597/610/607 (cuDNN 503/560/596/
    # 597/603/604); causal 265/347/414/442/480/502 -> 221/347/398/499/570/620 (cuDNN 330/416/445/
    # 463/479/511). Ping-pong on: 0.93-0.97x of off from 2k on. Prototype run: 64x2x64 s4
    # 0.87-0.92x and 128x2x32 s4 0.75-0.86x of this tile.
    ("sm90", 128, 2, "fwd_hopper_ws"): TileConfig(64, 128, 4, 2),
    # d256 64(x2)x64 s2: 459/535/600/567/582/578 -> 498/591/653/678/693/671 (cuDNN 508/564/606/
    # 614/629/620); causal 290/389/476/525/548/583 -> 326/441/524/586/675/716 (cuDNN 336/434/448/
    # 477/503/528). Ping-pong on: 0.88-0.99x of off.
    ("sm90", 256, 2, "fwd_hopper_ws"): TileConfig(64, 64, 4, 2),
    # The persistent warp-specialized Gluon forward (grid = #SMs; GLUON_PERSIST_QBUF), taken at
    # every length where it has an entry (gluon_persist). H200, fp16, its prototype (the same
    # kernel), one run beside
    # the library as routed then (ship: one warpgroup up to 2k keys at d128, warp-specialized past
    # it; one warpgroup at d64) and cuDNN, at 512/1k/2k/4k/8k/16k (d64: 512/1k/2k/4k/16k):
    # d128 64(x2)x128 s2, 2 Q buffers: 513/574/630/623/636/625 (ship 456/484/528/583/596/614,
    # cuDNN 512/591/638/657/667/670); causal 255/349/433/550/605/645 (ship 249/324/367/449/526/588,
    # cuDNN 325/417/502/527/558/618). 1 Q buffer: 0.84-0.99x of 2.
    ("sm90", 128, 2, "fwd_hopper_persist"): TileConfig(64, 128, 8, 2),
    # d64: three consumer warpgroups of 64 rows, 128 keys per block (FlashAttention-3's 192x128 at
    # this head dim), 3 stages; shorter key sequences take _TABLE_SHORT's tiles. H200, fp16, bench ab
    # (bench/results/ab-nvidia-h200.csv), at 512/1k/2k/4k/
    # 8k/16k against the table of the time (128(x2)x64 s2 up to 2k keys, the Triton forward past it)
    # and cuDNN in the same rounds: 326/387/426/437/463/467 (then 365/383/394/416/424/428, cuDNN 378/
    # 419/428/442/442/446); causal 183/257/328/371/396/428 (220/293/331/351/386/412, cuDNN 259/329/364/
    # 397/409/428). 64(x3)x128 s2: 0.98-1.01x of s3 from 2k; 64(x2)x128 s2 0.89-1.04x of the old table.
    # The earlier 128(x2)x64 s2 (2 Q buffers): 358/399/407/401/401 at 512/1k/2k/4k/16k, causal
    # 219/296/348/368/398 (cuDNN 388/434/458/483/492, 257/333/387/431/464).
    ("sm90", 64, 2, "fwd_hopper_persist"): TileConfig(64, 128, 12, 3),
    # d256 (64(x2)x64 s2, 1 Q buffer) measured 0.87-1.02x of the warp-specialized kernel: no entry.
    # The warp-specialized Gluon backward (deterministic=False; ops.attention._hopper_backward):
    # producer warp, two MMA warpgroups, dQ-writer warp; dQ by TMA reduce-add through
    # GLUON_BWD_DQ_STAGES staging tiles. H200, fp16, 16k tokens, its
    # prototype, zero of the dQ accumulator + kernel, beside the
    # library's backward of the time ("ours": the whole call, the Triton or the one-partition Gluon
    # backward) and cuDNN, in one run; at 512/2k/8k/16k for d64, 512/2k/16k d256, 512/1k/2k/4k/8k/
    # 16k d128 (the same-run A/B of whole calls: ab-gluon-nvidia-h200.md and GLUON_BWD below):
    # d64 128x128 s2 (1 dQ tile): 322/429/440/453, causal 219/352/404/417 (64x128 s2 x2:
    # 278/366/398/397; ours 265/349/376/382, 171/291/352/374; cuDNN 278/423/473/440, 168/327/425/436)
    ("sm90", 64, 2, "bwd_hopper"): TileConfig(128, 128, 8, 2),
    # d128 64x128 s2 (2 dQ tiles): 386/466/507/540/517/518, causal 273/370/445/482/490/511 (s3 x1:
    # 393..525, 276..514; ours 278/338/385/392/384/393, 171/261/323/369/397/435; cuDNN 341/442/514/
    # 560/583/525, 213/316/409/479/529/578)
    ("sm90", 128, 2, "bwd_hopper"): TileConfig(64, 128, 8, 2),
    # d256 64x64 s1 (1 dQ tile): 249/289/297, causal 200/275/309 (s2 with atomics instead of the
    # writer: 240/273/283, 193/259/295; ours 213/263/283, 108/240/290; cuDNN 240/361/349, 179/319/387).
    # The one-partition Gluon backward measured earlier had 128x128 w8 s2 at d64, 64x128 w8 s2 at d128,
    # 64x64 w8 s2 (dQ by atomics) at d256.
    ("sm90", 256, 2, "bwd_hopper"): TileConfig(64, 64, 8, 1),
    # The split-ring variant of the Gluon backward (GLUON_BWD_SPLIT, config.gluon_bwd_split): dO has a ring of its
    # own, released as soon as dV is computed (the next dO loads while dQ_i and dK run), and at d256 dQ_i is
    # staged in two 32 KB column halves. At d256 the one-stage kernel above waits for every position's Q and dO
    # (the next ones load only once this position's dK is done); the halves free the shared memory for a second
    # Q stage: K, V 32 KB each, Q 2 x 32, dO 32, P, dS 8 each, one half dQ tile 32 = 208 KB (213,388 bytes).
    # At d64/d128 the same tiles and stages as above, only dO's early release. Measured on the H200: see
    # GLUON_BWD_SPLIT_DEFAULT (the default at d256 only). Spills only in the causal + GQA builds, d64 16 bytes
    # and d128 40, as the shipped d128.
    ("sm90", 64, 2, "bwd_hopper_split"): TileConfig(128, 128, 8, 2),
    ("sm90", 128, 2, "bwd_hopper_split"): TileConfig(64, 128, 8, 2),
    ("sm90", 256, 2, "bwd_hopper_split"): TileConfig(64, 64, 8, 2),
    # d64 bwd (with dQ 128x64 w8 s2): 347/322 at 16k, 301/230 at 2k; 32x64 w4 s3: 347/316
    ("sm90", 64, 2, "bwd_dkdv"):   TileConfig(32, 128, 4, 3),
    # d128 bwd (with dQ 128x64 w8 s2): 370/357 at 16k, 315/237 at 2k; 32x64 w4 s3: 353/345
    ("sm90", 128, 2, "bwd_dkdv"):  TileConfig(64, 128, 8, 3),
    # d256 bwd (with dQ 64x64 w8 s1): 189/184 at 16k, 187/141 at 2k (SDPA flash 259/253, 228/189)
    ("sm90", 256, 2, "bwd_dkdv"):  TileConfig(64, 64, 8, 2),
    # d64 dQ (with dK/dV 64x128 w8 s2): 318/287 at 16k, 258/188 at 2k; 128x64 w8 s2: 310/291
    ("sm90", 64, 2, "bwd_dq"):     TileConfig(64, 64, 4, 3),
    # d128 dQ (with dK/dV 64x128 w8 s2): 369/370 at 16k, 328/264 at 2k; 128x128 w8 s2: 358/360
    ("sm90", 128, 2, "bwd_dq"):    TileConfig(128, 32, 4, 3),
    # d256 dQ (with dK/dV 64x64 w8 s1): 222/188 at 16k, 220/152 at 2k; 64x64 w8 s2: 186/163
    ("sm90", 256, 2, "bwd_dq"):    TileConfig(128, 32, 8, 2),
    # sm80 and anything without TMA: FA2's A100 tiles (paper, section 4), not measured here;
    # the compile-only check keeps them inside sm80's 163 KB of shared memory.
    ("sm80", 64, 2, "fwd"):        TileConfig(128, 64, 4, 3),
    ("sm80", 128, 2, "fwd"):       TileConfig(128, 64, 8, 2),
    ("sm80", 256, 2, "fwd"):       TileConfig(64, 64, 8, 1),
    ("sm80", 64, 2, "bwd_dkdv"):   TileConfig(64, 128, 8, 2),
    ("sm80", 128, 2, "bwd_dkdv"):  TileConfig(64, 128, 8, 1),
    ("sm80", 256, 2, "bwd_dkdv"):  TileConfig(64, 64, 8, 1),
    ("sm80", 64, 2, "bwd_dq"):     TileConfig(128, 64, 8, 2),
    ("sm80", 128, 2, "bwd_dq"):    TileConfig(128, 64, 8, 1),
    ("sm80", 256, 2, "bwd_dq"):    TileConfig(64, 64, 8, 1),
    # 99 KB of shared memory (RTX 3090/4090, A10, L4, L40, RTX 5090): smaller tiles, not measured
    # here; the compile-only check keeps them inside the limit.
    ("sm86", 64, 2, "fwd"):        TileConfig(128, 64, 4, 2),
    ("sm86", 128, 2, "fwd"):       TileConfig(64, 64, 4, 2),
    ("sm86", 256, 2, "fwd"):       TileConfig(64, 32, 4, 1),
    ("sm86", 64, 2, "bwd_dkdv"):   TileConfig(64, 64, 4, 2),
    ("sm86", 128, 2, "bwd_dkdv"):  TileConfig(64, 64, 4, 1),
    ("sm86", 256, 2, "bwd_dkdv"):  TileConfig(32, 32, 4, 1),
    ("sm86", 64, 2, "bwd_dq"):     TileConfig(64, 64, 4, 2),
    ("sm86", 128, 2, "bwd_dq"):    TileConfig(64, 64, 4, 1),
    ("sm86", 256, 2, "bwd_dq"):    TileConfig(32, 32, 4, 1),
}
# The dK/dV kernel that also adds dQ with atomics (deterministic=False where _DQ_ATOMIC allows):
# the dK/dV tile where it fits (H200: 64x128 w8 s2, 128x128 (too much shared memory)
# and 64x64 w4 s3 were no better). sm90 headdim 256: 64x64 w8 s2 needs 263 KB of shared memory
# with the extra dS K product (compile_check), so one stage.
for (_arch, _bucket, _bytes, _kernel), _cfg in list(_TABLE.items()):
    if _kernel == "bwd_dkdv":
        _TABLE[(_arch, _bucket, _bytes, "bwd_dkdv_atomic")] = _cfg
_TABLE[("sm90", 256, 2, "bwd_dkdv_atomic")] = TileConfig(64, 64, 8, 1)
# fp32 inputs run full-precision dots on CUDA cores: small tiles keep registers and shared
# memory in bounds (correctness path, not tuned).
_FP32 = {
    64: TileConfig(64, 32, 4, 2),
    128: TileConfig(32, 32, 4, 1),
    256: TileConfig(16, 16, 4, 1),
}
# fmt: on
for _arch in ("sm90", "sm80", "sm86"):
    for _bucket, _cfg in _FP32.items():
        for _kernel in KERNELS[:4]:
            _TABLE[(_arch, _bucket, 4, _kernel)] = _cfg
_TABLE_CAUSAL: dict[tuple[str, int, int, str], TileConfig] = {
    ("sm90", 64, 2, "fwd_hopper"): TileConfig(128, 64, 4, 2),  # see the non-causal entry
}
# (arch, head-dim bucket, bytes per element, kernel, causal) -> ((longest key sequence, tile), ...):
# tiles for short key sequences, the first whose length bound max_seqlen_k does not pass, before
# _TABLE_CAUSAL / _TABLE. H200, fp16, 16k tokens, bench ab against the
# entries above and cuDNN in the same rounds (bench/results/ab-nvidia-h200.csv):
_TABLE_SHORT: dict[tuple[str, int, int, str, bool], tuple[tuple[int, TileConfig], ...]] = {
    # d64 64(x2)x128 s2 at 512/1k: 373/391 (64(x3)x128 s3 326/387; cuDNN 378/419)
    ("sm90", 64, 2, "fwd_hopper_persist", False): ((1024, TileConfig(64, 128, 8, 2)),),
    # d64 causal 128(x2)x64 s2 at 512/1k/2k: 220/293/331 (64(x3)x128 s3 183/257/328; cuDNN 259/329/364).
    # Earlier (K and V of a step in one ring unit): s3 223/294/335 against s2's 218/290/332
    # (cuDNN 258/334/386)
    # Earlier (masked blocks of one compare and one select, causal tiles aligned to the last row;
    # 4 rounds, alternating order): 64(x3)x64 s4 at 512/1k/2k/4k/8k/16k 238/308/347/371/401/425 fp16,
    # 244/314/358/386/413/434 bf16, against this entry (then 128(x2)x64 s3 up to 2k, 64(x3)x128 s3 past it)
    # 232/295/334/378/418/449 and 234/303/344/392/432/469 (cuDNN 257/323/374/402/419/431, 260/329/381/415/432/441);
    # s3 238/304/343/364/400/423 and 241/311/354/376/414/435
    ("sm90", 64, 2, "fwd_hopper_persist", True): ((2048, TileConfig(64, 64, 12, 4)),),
    # d128 causal 64(x3)x64 s2 at 512/1k/2k/4k: 281/349/429/471 (the 64(x2)x128 entry 242/342/416/502;
    # 64(x2)x64 273/348/381/437; cuDNN 324/398/439/472). Earlier (ring units): s3 at
    # 512/1k/2k 285/364/447 against s2's 275/352/472 (cuDNN 327/411/443)
    # Earlier (4 rounds, alternating order): one Q buffer per consumer instead of two at 512/1k/2k
    # 305/387/450 fp16, 308/402/466 bf16 against 292/397/450 and 296/413/472 (cuDNN 322/408/476, 332/424/480);
    # one Q buffer with 5 stages (4 at 2k) 290/376/444, 294/392/467; two Q buffers with 4 stages 292/395/452,
    # 294/415/480. One Q buffer: 144 KB of shared memory instead of 192. In isolation (ncu, one call, caches
    # flushed) it read 3% slower at 512 (docs/notes.md): the bench's gain is not explained yet
    ("sm90", 128, 2, "fwd_hopper_persist", True): ((512, TileConfig(64, 64, 12, 3, qbuf=1)),
                                                   (1024, TileConfig(64, 64, 12, 3)),
                                                   (2048, TileConfig(64, 64, 12, 2))),
}
# The interpreter: ~4 ms per program step whatever the tile (TRITON-ON-CPU.md), so big tiles.
_INTERP = TileConfig(64, 64, 4, 1)

# (arch, head-dim bucket) -> True where deterministic=False adds dQ with atomics inside the dK/dV
# kernel (5 matmuls per block pair instead of 7, flash_attn's own non-deterministic default).
# Off everywhere: on the H200 (fp16, 16k and 2k tokens) it made the backward slower at
# every head dim (TMA bulk reduce: d128 386 -> 344 TFLOP/s, d64 causal 329 -> 320, d256 about
# half; scalar atomics 0.45-0.66x), so every backward is the deterministic two-pass one.
# FLASHATTN2_DQ_ATOMIC=1 or override(dq_atomic=True) turns it on for deterministic=False calls;
# deterministic=True never takes it.
_DQ_ATOMIC: dict[tuple[str, int], bool] = {}

_overrides: dict[str, TileConfig] = {}
# what override() forces (None: not forced): the TMA path, the architecture, the atomic dQ
_forced: dict[str, object] = {"tma": None, "arch": None, "dq_atomic": None, "host_desc": None, "gluon": None,
                              "gluon_ws": None, "gluon_persist": None, "gluon_bwd": None, "gluon_bwd_split": None,
                              "gluon_bwd_grouped": None}


def head_dim_bucket(head_dim: int) -> int:
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return max(block_d, 64)


def arch_of(device: torch.device) -> str:
    if device.type != "cuda":
        return "interp"
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _ARCH.get(index)
    if arch is None:  # get_device_capability costs ~5 us of host time per call
        arch = _ARCH[index] = native_arch(index)
    forced = _forced["arch"]
    if forced is not None:  # a test runs another architecture's tiles and load path
        if forced == "sm90" and arch != "sm90":
            raise ArgumentError(f"config.override(arch='sm90') on a {arch} GPU: it has no TMA or PDL")
        return forced
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
        raise NotImplementedError(f"flashattn2 runs on NVIDIA GPUs (CUDA) only: {name} is a ROCm device "
                                  f"(torch.version.hip {torch.version.hip}); its kernels and tiles are untested there")
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        raise NotImplementedError(f"flashattn2 needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere or "
                                  f"newer, as flash_attn 2): {name} is sm_{major}{minor}")
    return "sm90" if major in (9, 10) else "sm80" if (major, minor) in ((8, 0), (8, 7)) else "sm86"


def select(kernel: str, arch: str, head_dim: int, dtype: torch.dtype, causal: bool,
           max_seqlen_k: int | None = None) -> TileConfig:
    """The tile for one launch: an override (tests, tuning) if set, else the table entry (with the
    longest key sequence given, _TABLE_SHORT's tile where one covers it)."""
    if kernel in _overrides:
        return _overrides[kernel]
    if arch == "interp":
        return _INTERP
    key = (arch, head_dim_bucket(head_dim), 4 if dtype == torch.float32 else 2, kernel)
    if max_seqlen_k is not None:
        for longest, cfg in _TABLE_SHORT.get((*key, causal), ()):
            if max_seqlen_k <= longest:
                return cfg
    return (_TABLE_CAUSAL.get(key) if causal else None) or _TABLE[key]


def table_entries():
    """Every (key, TileConfig) the table can select on a GPU (for the compile-only check; a
    _TABLE_SHORT tile under its key without the causal flag)."""
    yield from _TABLE.items()
    yield from _TABLE_CAUSAL.items()
    for key, tiles in _TABLE_SHORT.items():
        for _, cfg in tiles:
            yield key[:4], cfg


_ENV_DQ_ATOMIC = _runtime.env_flag("FLASHATTN2_DQ_ATOMIC")
_ENV_TMA = _runtime.env_flag("FLASHATTN2_TMA")
_ENV_HOST_DESC = _runtime.env_flag("FLASHATTN2_HOST_DESC")
_ENV_GLUON = _runtime.env_flag("FLASHATTN2_GLUON")
_ENV_GLUON_WS = _runtime.env_flag("FLASHATTN2_GLUON_WS")
_ENV_GLUON_PERSIST = _runtime.env_flag("FLASHATTN2_GLUON_PERSIST")
_ENV_GLUON_BWD = _runtime.env_flag("FLASHATTN2_GLUON_BWD")
_ENV_GLUON_BWD_SPLIT = _runtime.env_flag("FLASHATTN2_GLUON_BWD_SPLIT")


def _forced_or_env(name: str, env: bool | None) -> bool | None:
    """What override(name=...) forces, else what its environment variable says (env, read at
    import), else None."""
    forced = _forced[name]
    return forced if forced is not None else env


def state() -> tuple:
    """What may change between calls among what the kernel choices read besides a call's arguments:
    overrides (tiles and switches) and the FLASHATTN2_* flags. Part of the key under which
    ops.attention remembers a call signature's choices, so that a change of any of them is seen at
    the next call. The tables (_TABLE, _TABLE_SHORT, the GLUON_* dicts and constants) are taken as constants: whoever
    edits one at run time must clear attention._FWD_PLANS and _BWD_PLANS."""
    return (tuple(_forced.values()), tuple(_overrides.items()), _ENV_DQ_ATOMIC, _ENV_TMA, _ENV_HOST_DESC,
            _ENV_GLUON, _ENV_GLUON_WS, _ENV_GLUON_PERSIST, _ENV_GLUON_BWD, _ENV_GLUON_BWD_SPLIT)


def dq_atomic(arch: str, head_dim: int) -> bool:
    """Whether a deterministic=False backward adds dQ with atomics (see _DQ_ATOMIC)."""
    forced = _forced_or_env("dq_atomic", _ENV_DQ_ATOMIC)
    return forced if forced is not None else _DQ_ATOMIC.get((arch, head_dim_bucket(head_dim)), False)


def tma_forced() -> bool | None:
    """True/False when a test or FLASHATTN2_TMA=0/1 forces the TMA path on (where the tensors'
    alignment allows it) or off, else None (the default: on for aligned tensors on sm90)."""
    return _forced_or_env("tma", _ENV_TMA)


# Host-built descriptors: where the TMA path is taken for dense inputs whose head dim is a power of
# two, the launchers build the descriptors of Q, K, V, O (and dO, dQ, dK, dV) once on the host
# over (batch, seqlen, heads * headdim) and pass them to the kernels, instead of every program
# writing its own (kernels.common.tile_src). H200, fp16, 16k tokens, interleaved A/B in one
# process, outputs bitwise equal (docs/notes.md): backward 1.04-1.41x at
# 512 and 2k tokens for every head dim, the Triton forward 1.0-1.33x except headdim 256 at 512
# tokens (0.92-0.94x); earlier: 1.0-1.03x at 16k. On by default; the GPU suite ran with it
# (no failure in ~1130 tests before its time limit).
# FLASHATTN2_HOST_DESC=0 or override(host_desc=False) turns it off.
def host_desc() -> bool:
    """Whether the TMA path may use host-built descriptors (see above)."""
    return _forced_or_env("host_desc", _ENV_HOST_DESC) is not False


# The Gluon forward (kernels/fwd_hopper.py) where it applies (ops.attention._hopper_forward): on by
# default on sm_90 (it uses wgmma, which sm_100 lacks). H200, interleaved A/B against
# the Triton forward (docs/notes.md) at 512 / 2k / 16k tokens: headdim 128 1.42-1.51x /
# 1.11-1.19x / 1.09-1.12x, 256 1.00-1.31x / 1.30-1.34x / 1.34-1.39x; headdim 64: the fwd_hopper_persist entry.
# FLASHATTN2_GLUON=0 or override(gluon=False) turns it off.
def gluon() -> bool:
    """Whether the forward may take the Gluon kernel (see above)."""
    return _forced_or_env("gluon", _ENV_GLUON) is not False


# head-dim bucket -> the warp-specialized Gluon forward (kernels/fwd_hopper.attn_fwd_ws_kernel) is
# chosen when the longest key sequence is longer than this (absent: never). Its two consumer
# warpgroups need 240 registers per thread: one program per SM, so its prologue and epilogue are
# not hidden by a second program's work, and short sequences run faster on the one-warpgroup
# kernel (H200, the fwd_hopper_ws entries): headdim 128 0.90x/0.83x at 512 keys
# (non-causal/causal), 0.98x/1.00x at 1k, 1.02x/0.96x at 2k, 1.12-1.23x from 4k on; headdim 256
# 1.09-1.23x from 512 on; headdim 64 (prototype, 128x2x64) 0.71-0.97x everywhere.
# (Headdim 128 takes the persistent kernel by default, config.gluon_persist: this rule applies there
# only when that is turned off.)
GLUON_WS_ABOVE_SEQLEN_K: dict[int, int] = {128: 2048, 256: 0}
# head-dim bucket -> whether its two consumers alternate their GEMMs through mbarriers (ping-pong):
# measured slower at both head dims (see the entries), kept as an option of the kernel
GLUON_WS_PINGPONG: dict[int, bool] = {128: False, 256: False}

# head-dim bucket -> the persistent forward's Q buffers per consumer: two let a tile's O store and
# the next tile's Q load overlap the compute (headdim 256 would need 256 KB of shared memory).
GLUON_PERSIST_QBUF: dict[int, int] = {64: 2, 128: 2}


def gluon_persist_constexprs(cfg: TileConfig, head_dim: int, causal: bool) -> dict:
    """The persistent forward's constexprs beyond the tile: Q buffers per consumer (cfg.qbuf, else
    GLUON_PERSIST_QBUF's), the snake order (causal), and its consumer warpgroups, cfg.num_warps // 4 (2 or 3)."""
    if cfg.num_warps not in (8, 12):
        raise ArgumentError(f"fwd_hopper_persist: num_warps counts the consumer warps (8 or 12), got {cfg.num_warps}")
    qbuf = GLUON_PERSIST_QBUF[head_dim_bucket(head_dim)] if cfg.qbuf is None else cfg.qbuf
    return dict(QBUF=qbuf, SNAKE=causal, CONSUMERS=cfg.num_warps // 4)


# head-dim bucket -> the Gluon backward's dQ staging tiles (fp32 BLOCK_M x headdim each): two
# where they fit in shared memory beside the rings (headdim 128: 229,740 of 232,448 bytes), else
# one. Measurements: the bwd_hopper entries.
GLUON_BWD_DQ_STAGES: dict[int, int] = {64: 1, 128: 2, 256: 1}
# head-dim bucket -> the split-ring variant's constexprs (the bwd_hopper_split entries): dO's ring depth,
# dQ_i in DQ_SPLIT column parts, DQ_STAGES staging tiles of that width
def gluon_bwd_rings(head_dim: int, split: bool, num_stages: int) -> dict:
    """The Gluon backward's ring constexprs (SPLIT_RING, DO_STAGES, DQ_SPLIT, DQ_STAGES) for the
    one-ring kernel (dO shares Q's num_stages-deep ring) or the split-ring variant (GLUON_BWD_SPLIT)."""
    bucket = head_dim_bucket(head_dim)
    if split:
        return dict(SPLIT_RING=True, **GLUON_BWD_SPLIT[bucket])
    return dict(SPLIT_RING=False, DO_STAGES=num_stages, DQ_SPLIT=1, DQ_STAGES=GLUON_BWD_DQ_STAGES[bucket])


GLUON_BWD_SPLIT: dict[int, dict] = {64: dict(DO_STAGES=2, DQ_SPLIT=1, DQ_STAGES=1),
                                    128: dict(DO_STAGES=2, DQ_SPLIT=1, DQ_STAGES=2),
                                    256: dict(DO_STAGES=1, DQ_SPLIT=2, DQ_STAGES=1)}


def gluon_persist(head_dim: int) -> bool:
    """Whether the Gluon forward takes its persistent kernel: wherever the head dim has a table
    entry for it, unless turned off. What decides, first to last: override(gluon_persist=...);
    override(gluon_ws=...) either way (off: it asks for one of the other two kernels);
    FLASHATTN2_GLUON_PERSIST=0/1; FLASHATTN2_GLUON_WS=0/1 either way (off, as the override)."""
    bucket = head_dim_bucket(head_dim)
    if ("sm90", bucket, 2, "fwd_hopper_persist") not in _TABLE:
        return False
    if _forced["gluon_persist"] is not None:
        return _forced["gluon_persist"]
    if _forced["gluon_ws"] is not None:
        return False
    if _ENV_GLUON_PERSIST is not None:
        return _ENV_GLUON_PERSIST
    return _ENV_GLUON_WS is None


def gluon_ws(head_dim: int, max_seqlen_k: int) -> bool:
    """Where the persistent kernel is not taken (gluon_persist): whether the Gluon forward takes its
    warp-specialized kernel (GLUON_WS_ABOVE_SEQLEN_K) or the one-warpgroup one, unless
    override(gluon_ws=...) or FLASHATTN2_GLUON_WS=0/1 forces it off or on (where the head dim has
    a table entry for it)."""
    bucket = head_dim_bucket(head_dim)
    if ("sm90", bucket, 2, "fwd_hopper_ws") not in _TABLE:
        return False
    forced = _forced_or_env("gluon_ws", _ENV_GLUON_WS)
    if forced is not None:
        return forced
    return bucket in GLUON_WS_ABOVE_SEQLEN_K and max_seqlen_k > GLUON_WS_ABOVE_SEQLEN_K[bucket]


# The Gluon backward (kernels/bwd_hopper.py) for every deterministic=False call where it applies
# (ops.attention._hopper_backward): 5 matmuls per block pair, dQ added in any order into an fp32
# accumulator that is zeroed before and cast into dq after. H200, fp16, 16k tokens,
# interleaved A/B of whole backward calls through the library (median of 3;
# bench/results/ab-gluon-nvidia-h200.md): it is faster than the Triton backward at every point of
# the fp16 grid, 1.02x (d64 causal, 512 tokens) to 1.43x (d128 causal, 8k), so there is no length
# rule (the bf16 grid, bench/results/kernels-nvidia-h200.md, shows the same ratios to SDPA).
def gluon_bwd() -> bool:
    """Whether a deterministic=False backward takes the Gluon kernel where it applies, unless
    override(gluon_bwd=False) or FLASHATTN2_GLUON_BWD=0 turns it off. deterministic=True never
    takes it."""
    return _forced_or_env("gluon_bwd", _ENV_GLUON_BWD) is not False


# head-dim buckets where the Gluon backward takes its split-ring variant by default. H200, fp16, 16k tokens, `bench ab` (median of 3 alternated rounds, cuDNN in the
# same run), split / shipped at 512/2k/8k/16k: d256 1.19/1.26/1.26/1.26, causal 1.11/1.17/1.22/1.22
# (to 0.92-1.10x cuDNN, from 0.75-0.92x); d128 0.97-1.01, d64 0.99-1.01 (dO's early release alone
# buys nothing there): headdim 256 only. The second dQ half staged by the next position
# (kernels/bwd_hopper.py): bench ab against the kernel before it, fp16/bf16, 1k-16k keys, 1.05-1.10x (d256 bwd
# 330-404 TFLOP/s, 0.94-1.17x cuDNN in the grid, 22 of 24 points >= 1.0x).
GLUON_BWD_SPLIT_DEFAULT = frozenset({256})


def gluon_bwd_split(head_dim: int) -> bool:
    """Whether the Gluon backward takes its split-ring variant (the bwd_hopper_split entries): by
    default where GLUON_BWD_SPLIT_DEFAULT has the head dim, unless override(gluon_bwd_split=...) or
    FLASHATTN2_GLUON_BWD_SPLIT=0/1 says otherwise (where the head dim has an entry)."""
    bucket = head_dim_bucket(head_dim)
    if ("sm90", bucket, 2, "bwd_hopper_split") not in _TABLE:
        return False
    forced = _forced_or_env("gluon_bwd_split", _ENV_GLUON_BWD_SPLIT)
    return bucket in GLUON_BWD_SPLIT_DEFAULT if forced is None else forced


# The Gluon backward's program order (its grid's shape: ops.attention._bwd_grid, kernels/bwd_hopper._ws_program). Under
# a causal mask key block n's program walks the query blocks below the diagonal (key block 0 all of them, the last one),
# and in the head-major order (one head's key blocks heaviest first, then the next head's) the last heads' heaviest
# programs start late and run past the others: an event model of the block scheduler (tools/bwd_grid_order.py; the
# table's tiles, 132 SMs) puts the last wave's idle SMs at 5-6% of the causal backward at headdim 128 from 512 to 8k
# keys and at headdim 256 to 4k, 3% at headdim 64 to 8k (the longer ones balance already). So causal programs go in
# groups of heads, each group key block by key block (heaviest first: the longest-first rule), every group whole:
# 0.98-1.0 in the model. A group's heads' Q and dO, which the programs running at once read, are sized to stay in L2 (50
# MB on the H200): GLUON_BWD_L2_BYTES of them. Non-causal programs are alike and keep the head-major order (unless
# _bwd_grid must group heads to stay within CUDA's 65535 on the grid's third axis). H200,
# fp16, 16k tokens, bench ab (bench/results/ab-gluon-nvidia-h200.md), grouped / head-major, causal, at
# 512/1k/2k/4k/8k/16k: d256 1.11/1.03/1.03/1.03/1.01/1.00, d128 1.01/1.02/1.04/1.06/1.04/1.01, d64
# 0.96/0.88/1.02/1.03/1.02/1.00 (3 rounds); a second run at 512/1k/2k/4k (where, non-causal, the same kernel under other
# names read 0.96-1.00x of itself): d256 0.98/1.04/1.03/1.03, d128 0.98/1.02/1.04/1.04, d64 0.98/0.99/1.02/1.02, and the
# head-major grid against the commit before (5fbd374) 0.98-1.01 causal and not. The first run's d64 1k (0.88) did not
# repeat (0.99; that run's 512 points read 0.67-0.91x of every run before it in both orders: its start on a cold GPU).
# Counting the fp32 dQ accumulator into a head's bytes too (half the heads per group): 0.985-1.03x of this, no better.
GLUON_BWD_L2_BYTES = 24 << 20


def gluon_bwd_l2_heads(causal: bool, n_bh: int, bytes_per_bh: int) -> int:
    """Heads (batch, kv head pairs) per group in the Gluon backward's program order (see above): 1, the head-major
    order, unless causal (and override(gluon_bwd_grouped=False) does not turn it off); else as many of the n_bh
    heads as GLUON_BWD_L2_BYTES holds of bytes_per_bh each (a head's Q and dO, its group of query heads')."""
    if not causal or _forced["gluon_bwd_grouped"] is False:
        return 1
    return max(1, min(n_bh, GLUON_BWD_L2_BYTES // bytes_per_bh))


def wgmma(device: torch.device) -> bool:
    """Whether a CUDA device is sm_90 (Hopper): wgmma, which the Gluon kernel is written with."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _WGMMA.get(index)
    if found is None:
        # native_arch first: it refuses ROCm devices, whose capability can read (9, 0)
        found = _WGMMA[index] = native_arch(index) == "sm90" and torch.cuda.get_device_capability(index) == (9, 0)
    return found


_WGMMA: dict = {}


@contextlib.contextmanager
def override(tma: bool | None = None, arch: str | None = None, dq_atomic: bool | None = None,
             host_desc: bool | None = None, gluon: bool | None = None, gluon_ws: bool | None = None,
             gluon_persist: bool | None = None, gluon_bwd: bool | None = None, gluon_bwd_split: bool | None = None,
             gluon_bwd_grouped: bool | None = None, **tiles: TileConfig):
    """Force tiles (fwd=..., bwd_dkdv=..., bwd_dq=...), the TMA path and/or the architecture
    whose table entries and load path a CUDA device uses (arch="sm80" on an H200 runs the
    non-Hopper path: sm80 tiles, pointer loads, no PDL), whether deterministic=False backwards
    add dQ with atomics, whether the TMA path may use host-built descriptors, whether the
    forward may take the Gluon kernel, and/or whether that takes its warp-specialized kernel
    (gluon_ws; True forces it whatever the sequence length, where the head dim has one) or its
    persistent kernel (gluon_persist), and/or
    whether deterministic=False backwards may take the Gluon backward (gluon_bwd), its split-ring
    variant (gluon_bwd_split) and, causal, its grouped program order (gluon_bwd_grouped; False: head-major),
    inside a with-block. The CPU interpreter
    ignores arch."""
    unknown = set(tiles) - set(KERNELS)
    if unknown:
        raise ArgumentError(f"override: unknown kernel(s) {sorted(unknown)}; expected {KERNELS}")
    for name, cfg in tiles.items():
        if not isinstance(cfg, TileConfig):
            raise ArgumentTypeError(f"override: {name} must be a TileConfig, got {type(cfg).__name__}")
        if cfg.qbuf is not None and name != "fwd_hopper_persist":
            raise ArgumentError(f"override: qbuf (Q buffers per consumer) is a fwd_hopper_persist setting, given for {name}")
    if arch is not None and arch not in ARCHS[:-1]:
        raise ArgumentError(f"override: arch must be one of {ARCHS[:-1]}, got {arch!r}")
    saved = dict(_overrides), dict(_forced)
    _overrides.update(tiles)
    _forced.update(tma=tma, arch=arch, dq_atomic=dq_atomic, host_desc=host_desc, gluon=gluon, gluon_ws=gluon_ws,
                   gluon_persist=gluon_persist, gluon_bwd=gluon_bwd, gluon_bwd_split=gluon_bwd_split,
                   gluon_bwd_grouped=gluon_bwd_grouped)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved[0])
        _forced.update(saved[1])
