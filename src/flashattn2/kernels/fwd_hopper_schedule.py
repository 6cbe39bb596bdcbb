"""Which query tiles the Gluon forward kernels' programs compute, and which key blocks a tile sees: computed alike in
every partition (the consumers and the producer of a program walk the same tiles) from the kernel's FwdArgs and
FwdConfig. attn_fwd_ws_kernel: one tile per program (_program_tile); attn_fwd_persist_kernel: a CTA's tiles pid,
pid + G, pid + 2G, ... (PersistSchedule)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fwd_hopper_tile import FwdArgs, FwdConfig
from .pipeline import Scalar, aggregate


@gluon.jit
def _tile_blocks(start_m, args, cfg):
    """The key blocks of the query tile starting at row start_m: (n_blocks, mask_from); blocks
    [0, n_blocks), those from mask_from on cross the causal diagonal or the keys' end. A tile that
    sees no key (causal, seqlen_q > seqlen_k) still gets one block, all masked; a tile past
    seqlen_q (the second tile of the warp-specialized kernel's last program) or before row 0 (the
    persistent kernel's first causal tile, PersistSchedule.tile_coords) gets none."""
    seqlen_q = args.seqlen_q
    seqlen_k = args.seqlen_k
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    diag = seqlen_k - seqlen_q
    n_end = seqlen_k
    mask_from = seqlen_k // BLOCK_N
    if cfg.CAUSAL:
        n_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag), 1)
        mask_from = gl.minimum(mask_from, gl.maximum(start_m + diag + 1, 0) // BLOCK_N)
    n_blocks = (n_end + BLOCK_N - 1) // BLOCK_N
    if (start_m >= seqlen_q) | (start_m < 0):
        n_blocks = 0
    return n_blocks, mask_from


@gluon.jit
def _program_tile(args, cfg):
    """attn_fwd_ws_kernel's tile: the grid's order (kernels.common.query_block_program) on programs of CTA_M query
    rows: (batch entry, head, first row). Query blocks of one head together; causal heaviest first, those of all
    heads first when a head has more than 8."""
    batch = args.batch
    nheads = args.nheads
    CTA_M: gl.constexpr = cfg.CTA_M
    num_m = (args.seqlen_q + CTA_M - 1) // CTA_M
    pid = gl.program_id(0)
    pid_m = pid % num_m
    off_bh = pid // num_m
    if cfg.CAUSAL:
        if num_m > 8:
            pid_m = pid // (batch * nheads)
            off_bh = pid % (batch * nheads)
        pid_m = num_m - 1 - pid_m
    return off_bh // nheads, off_bh % nheads, pid_m * CTA_M


@aggregate
class PersistSchedule:
    """attn_fwd_persist_kernel's tiles (batch entry, head, CTA_M query rows) for CTA pid of nprog: tile
    it * nprog + pid is the CTA's it-th (SNAKE: odd rounds reversed, so a CTA that got a round's heaviest tile gets
    the next round's lightest). Every partition builds it (persist_schedule) and walks it alike."""

    num_m: Scalar  # a head's tiles
    pid: gl.tensor
    nprog: gl.tensor
    args: FwdArgs
    cfg: FwdConfig

    @gluon.constexpr_function
    def __init__(self, num_m, pid, nprog, args, cfg):
        self.num_m = num_m
        self.pid = pid
        self.nprog = nprog
        self.args = args
        self.cfg = cfg

    @gluon.jit
    def my_tiles(self):
        """How many tiles this CTA runs: the full rounds, plus one if its index in the last (partial) round
        exists."""
        num_tiles = self.num_m * self.args.batch * self.args.nheads
        pid = self.pid
        nprog = self.nprog
        full = num_tiles // nprog
        idx = pid
        if self.cfg.SNAKE:
            idx = pid + (full % 2) * (nprog - 1 - 2 * pid)
        return full + (idx < num_tiles - full * nprog).to(gl.int32)

    @gluon.jit
    def tile_coords(self, it):
        """The CTA's it-th tile: (batch entry, head, first row). Non-causal: one head's tiles together (K/V reuse in
        L2); causal: heaviest first over all heads (_program_tile's order for more than 8 tiles per head), and the
        tiles aligned to the last row rather than the first (shifted up by the whole parts of the
        num_m * CTA_M - seqlen_q rows left over), so the parts left empty (before row 0) fall in the lightest tile,
        not the heaviest: at 512 rows in 192-row tiles the tiles' longest parts sum to 15 key blocks (of 64)
        instead of 17."""
        pid = self.pid
        nprog = self.nprog
        batch = self.args.batch
        nheads = self.args.nheads
        num_m = self.num_m
        CTA_M: gl.constexpr = self.cfg.CTA_M
        BLOCK_M: gl.constexpr = self.cfg.BLOCK_M
        idx = pid
        if self.cfg.SNAKE:
            idx = pid + (it % 2) * (nprog - 1 - 2 * pid)
        t = it * nprog + idx
        if self.cfg.CAUSAL:
            pid_m = num_m - 1 - t // (batch * nheads)
            off_bh = t % (batch * nheads)
            shift = (num_m * CTA_M - self.args.seqlen_q) // BLOCK_M * BLOCK_M
        else:
            pid_m = t % num_m
            off_bh = t // num_m
            shift = 0
        return off_bh // nheads, off_bh % nheads, pid_m * CTA_M - shift

    @gluon.jit
    def max_blocks(self, cta_m):
        """The largest block count of the CONSUMERS parts of the tile at row cta_m (_tile_blocks of each): how far
        the ring moves per tile."""
        n_max, _ = _tile_blocks(cta_m, self.args, self.cfg)
        for t in gl.static_range(1, self.cfg.CONSUMERS):
            n_t, _ = _tile_blocks(cta_m + t * self.cfg.BLOCK_M, self.args, self.cfg)
            n_max = gl.maximum(n_max, n_t)
        return n_max


@gluon.jit
def persist_schedule(args, cfg):
    """This CTA's PersistSchedule."""
    num_m = (args.seqlen_q + cfg.CTA_M - 1) // cfg.CTA_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    return PersistSchedule(num_m, pid, nprog, args, cfg)
