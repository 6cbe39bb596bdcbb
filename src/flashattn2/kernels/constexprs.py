"""The bundles the Triton attention kernels (fwd.py, bwd.py, bwd_preprocess.py, dmask.py) take, one parameter each:
constexpr ones (Mods, Path, Tile) and run-time ones (the sizes, the score's scalars). The launchers build them by
keyword, the kernels read their fields by name (`MODS.CAUSAL`, `shape.nheads`), so that a field added never shifts
another. A run-time bundle flattens into one scalar parameter per field, in field order, as a plain tuple would.
Below them, the bundles the kernels build for their helpers (Scoring, Drop, TileSrc, ...), likewise by keyword.
Plain NamedTuples, no triton import, so the ops layer can import them before the kernels are (TRITON_INTERPRET must
be settled first)."""

from typing import NamedTuple


class Mods(NamedTuple):
    """The score modifications a kernel is compiled for; one that is off costs nothing."""

    CAUSAL: bool  # bottom-right causal mask (docs/design.md)
    LOCAL: bool  # a sliding window (window_left, window_right); excludes CAUSAL
    SOFTCAP: bool  # scores softcap * tanh(score / softcap)
    ALIBI: bool  # a per-(batch, head) slope times the query-key distance, subtracted
    DROPOUT: bool  # Philox dropout of P (common.dropout_keep)
    SINK: bool  # a learnable logit per head in every row's denominator (the forward's; False in the backward)


class Path(NamedTuple):
    """How a kernel reads and writes its tiles, and the arithmetic of its dots."""

    USE_TMA: bool  # TMA descriptors (common.make_desc_or_ptr), else pointers
    HOST_DESC: bool  # the descriptors built on the host (common.tile_src), not per program
    UPCAST: bool  # tiles converted to fp32 once loaded (fp32 inputs, and the interpreter's bf16)
    DOT_PRECISION: str  # tl.dot's input_precision: "ieee" where UPCAST, else "tf32"
    FP8: str = ""  # float8_e4m3fn q, k, v (the forward): one of FP8_PATHS below ("": none)
    VT_TMA: bool = False  # the e4m3 dots' transposed V (kernels/fwd.vt_src) by TMA: dense, on the TMA path


# Path.FP8: how e4m3 tiles meet the dots. FP8_DOTS: as they are (sm_89+: mma/wgmma e4m3; P rounded to e4m3 for the
# P V product, as FA3); FP8_BF16: the codes read as uint8 and decoded to bf16 once loaded (sm_80/86, whose Triton has no
# e4m3 type; P in bf16); FP8_FP32: the same decoded to fp32 (the interpreter's run of the sm_80/86 path: its bf16
# arithmetic is wrong, TRITON-ON-CPU.md); FP8_DOTS_INTERP: the interpreter's run of FP8_DOTS, decoded to fp32 (exact:
# e4m3 products are exact in fp32) with P rounded by kernels/fp8.e4m3_encode -- the interpreter's own e4m3 arithmetic
# loses the carry into the exponent when it rounds (0.4948 -> 0.25) and reads the NaN code as 480
FP8_NONE, FP8_DOTS, FP8_BF16, FP8_FP32, FP8_DOTS_INTERP = "", "e4m3", "bf16", "fp32", "e4m3-interp"

# The FP8 Gluon forward's key order in each group of FP8_KEY_GROUP keys (kernels/fwd_hopper_tile.FwdConfig.p_operand
# takes P's columns in it, ops.launch.launch_gluon.fp8_vt writes V^T's keys in it): a group's keys as dims FP8_KEY_DIMS
# (h, g, t, j: key 16 h + 8 g + 2 t + j, a thread t of the accumulator holding 2t, 2t + 1 of each 8), taken in the
# order FP8_KEY_ORDER (h, t, g, j: position 16 h + 4 t + 2 g + j, the e4m3 A operand's thread t holding 4t .. 4t + 3
# of each 16), so that P's registers are the A operand's as they stand
FP8_KEY_GROUP, FP8_KEY_DIMS, FP8_KEY_ORDER = 32, (2, 2, 4, 2), (0, 2, 1, 3)
# each as flashattn2.explain says it
FP8_PATHS = {
    FP8_DOTS: "e4m3 tiles into the dots, P rounded to e4m3",
    FP8_BF16: "e4m3 codes decoded to bf16 once loaded, P in bf16",
    FP8_FP32: "e4m3 codes decoded to fp32 once loaded (the interpreter's run of the bf16 path)",
    FP8_DOTS_INTERP: "e4m3 codes decoded to fp32, P rounded to e4m3 (the interpreter's run of the e4m3 dots)",
}


class Tile(NamedTuple):
    """A program's tile: its rows, and the head dims with the powers of two that hold them."""

    HEAD_DIM: int  # q's and k's head dim
    BLOCK_M: int  # query rows of a tile
    BLOCK_N: int  # key rows of a tile
    BLOCK_D: int  # HEAD_DIM's power of two
    HEAD_DIM_V: int  # v's head dim, the output's, dV's
    BLOCK_DV: int  # HEAD_DIM_V's power of two


class AttnShape(NamedTuple):
    """`shape` of attn_fwd_kernel, attn_bwd_dq_kernel and attn_dropout_mask_kernel (common.query_program's)."""

    batch: int  # sequences
    nheads: int  # query heads
    max_seqlen_q: int  # query rows of a sequence (varlen: of the longest)
    max_seqlen_k: int  # key rows of a sequence (varlen: of the longest)
    group_size: int  # query heads per K/V head (GQA; 1: MHA)


class DkdvShape(NamedTuple):
    """`shape` of attn_bwd_dkdv_kernel: its programs are (key block, batch, K/V head)."""

    nheads: int  # query heads
    nheads_k: int  # K/V heads
    max_seqlen_q: int  # query rows of a sequence (varlen: of the longest)
    max_seqlen_k: int  # key rows of a sequence (varlen: of the longest)
    group_size: int  # query heads per K/V head


class PreprocessShape(NamedTuple):
    """`shape` of attn_bwd_preprocess_kernel."""

    nheads: int  # query heads
    max_seqlen_q: int  # query rows of a sequence (varlen: of the longest)
    seqlen_pad: int  # rows of the padded Delta/lse (the Gluon backward's), else unused


class AttnScore(NamedTuple):
    """`score` of attn_fwd_kernel, attn_bwd_dkdv_kernel and attn_bwd_dq_kernel: the score's scalars."""

    window_left: int  # keys left of the diagonal a query sees (Mods.LOCAL; a bound that cannot bind otherwise)
    window_right: int  # keys right of the diagonal a query sees, likewise
    sm_scale: float  # the scores' scale
    softcap: float  # Mods.SOFTCAP's cap (1.0 without)
    dropout_p: float  # the probability of dropping a P entry (Mods.DROPOUT)


class DmaskScore(NamedTuple):
    """`score` of attn_dropout_mask_kernel: AttnScore without softcap (S_dmask's scores are not capped)."""

    window_left: int  # as AttnScore's
    window_right: int  # as AttnScore's
    sm_scale: float  # the scores' scale
    dropout_p: float  # the probability of dropping a P entry


# Built inside the kernels (by keyword, from the bundles above and what a program loads: its sequence's lengths, the
# descales, its head's ALiBi slope and dropout seed) and passed to their inner loops, which read them by name.


class Scoring(NamedTuple):
    """A program's base-2 score scalars: attn_fwd_kernel's and the backward kernels' inner loops, and
    attn_kvcache_kernel's _softmax_step (its slope2 a row's: the rows of one program are several heads)."""

    seqlen_q: int  # this program's sequence's query length
    seqlen_k: int  # its key length
    qk_scale: float  # sm_scale (times the Q and K descales) * log2(e)
    softcap_in: float  # sm_scale / softcap: tanh's argument per dot unit (Mods.SOFTCAP)
    softcap_out: float  # softcap * log2(e): tanh's result to a base-2 score (Mods.SOFTCAP)
    slope2: float  # this head's ALiBi slope * log2(e) (Mods.ALIBI)
    window_left: int  # AttnScore's
    window_right: int  # AttnScore's


class DmaskScoring(NamedTuple):
    """attn_dropout_mask_kernel's score scalars: Scoring without softcap."""

    seqlen_q: int
    seqlen_k: int
    qk_scale: float
    slope2: float
    window_left: int
    window_right: int


class Drop(NamedTuple):
    """What common.dropout_keep needs of a program: the Philox stream of its (batch, head)."""

    seed: int  # this call's seed (Mods.DROPOUT)
    rng_row0: int  # (batch * nheads + head) * max_seqlen_q: the stream's first row
    max_seqlen_k: int  # the stream's row length, in keys
    dropout_p: float  # the probability of dropping a score


class TileSrc(NamedTuple):
    """Where common.tile_src's rows are read or written: load_tile's and store_tile's source."""

    src: object  # a tensor descriptor (host-built or made in the kernel) or the rows' base pointer
    batch: int  # the batch entry a host descriptor is read at (0 otherwise)
    col: int  # the first column a host descriptor is read at (0 otherwise)
    seqlen: int  # the rows' count
    stride: int  # the row stride


class VtSrc(NamedTuple):
    """fwd.vt_src's transposed V: vt_load's source."""

    src: object  # a tensor descriptor of the sequence's keys or the rows' base pointer
    seqlen_k: int  # the keys' count
    stride_d: int  # the stride between V's columns (the copy's rows)


class DkdvHead(NamedTuple):
    """What attn_bwd_dkdv_kernel's inner loop reads of one query head."""

    q: TileSrc  # Q's rows
    do: TileSrc  # dO's rows
    lse: object  # pointer to its first logsumexp
    delta: object  # pointer to its first Delta


class DkdvChunk(NamedTuple):
    """This attn_bwd_dkdv_kernel program's chunk of dK's and dV's columns (read with DSPLIT > 1)."""

    q_cols: object  # Q's columns of the chunk of dK (a pointer)
    do_cols: object  # dO's columns of the chunk of dV (a pointer)
    ncols_k: int  # how many of dK's columns from the chunk's first on are real
    ncols_v: int  # likewise dV's


class DqRows(NamedTuple):
    """What attn_bwd_dq_kernel's inner loop holds of its query block."""

    q: object  # [BLOCK_M, BLOCK_D]
    do: object  # [BLOCK_M, BLOCK_DV]
    lse2: object  # [BLOCK_M]: the logsumexp in base 2
    delta: object  # [BLOCK_M]


class DqChunk(NamedTuple):
    """This attn_bwd_dq_kernel program's chunk of dQ's columns (read with DSPLIT > 1)."""

    k_cols: object  # K's columns of the chunk (a pointer)
    ncols_k: int  # how many of dQ's columns from the chunk's first on are real
