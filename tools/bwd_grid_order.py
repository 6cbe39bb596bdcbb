"""The Gluon backward's program order (kernels/bwd_hopper.py, _ws_program; the grid ops.attention._bwd_grid
launches), with an event model of how the H200's block scheduler fills its 132 SMs with it.

One program per (key block, (batch, kv head)) pair, on a grid (G, key blocks, heads / G): CUDA starts programs x
fastest, then y, then z, so the heads go in groups of G, each group key block by key block. One program per SM at a
time (~197-230 KB of shared memory). Under a causal mask key block n walks n_m - n * BLOCK_N / BLOCK_M query blocks,
so the programs' lengths differ up to n_m-fold. The model: programs start in grid order, each on the first SM that
frees, and run for their query blocks plus a fixed cost (K/V load, dK/dV store: OVERHEAD query blocks' worth).
Efficiency = the total work over 132 SMs / the time the last program ends.

`python tools/bwd_grid_order.py` prints the model's efficiency of the head-major order (G = 1) and of the grid the
launcher takes at the grid's causal points (batch * seqlen = 16k tokens, nheads = 2048 / headdim). No GPU.
"""
import heapq
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
from flashattn2.ops import attention, config  # noqa: E402

SMS = 132
OVERHEAD = 1.5  # query blocks' worth of a program's fixed cost (an estimate)
# headdim -> (BLOCK_M, BLOCK_N) of the backward table entry taken (bwd_hopper, or bwd_hopper_split where default)
TILES = {d: (lambda cfg: (cfg.block_m, cfg.block_n))(config.select(
    "bwd_hopper_split" if config.gluon_bwd_split(d) else "bwd_hopper", "sm90", d, torch.float16, True))
    for d in (64, 128, 256)}


def programs(grid):
    """(key block, head) of each program of a (G, key blocks, heads / G) grid, in the order CUDA starts them
    (kernels/bwd_hopper._ws_program: pid_n = y, pid_bh = z * G + x)."""
    g, n_n, n_z = grid
    return [(n, z * g + x) for z in range(n_z) for n in range(n_n) for x in range(g)]


def efficiency(headdim, seqlen, grouped=True, tokens=16384, hidden=2048, sms=SMS):
    """The event model's efficiency at one causal grid point, with the launcher's grid (grouped) or the
    head-major one."""
    block_m, block_n = TILES[headdim]
    batch, heads = max(1, tokens // seqlen), hidden // headdim
    n_n, n_m, n_bh = seqlen // block_n, seqlen // block_m, batch * heads
    cap = config.gluon_bwd_l2_heads(True, n_bh, 4 * seqlen * headdim) if grouped else 1
    grid = attention._bwd_grid(n_n, n_bh, cap)
    work = [n_m - n * block_n // block_m + OVERHEAD for n in range(n_n)]
    free = [0.0] * sms
    end = 0.0
    for n, _ in programs(grid):
        t = heapq.heappop(free) + work[n]
        end = max(end, t)
        heapq.heappush(free, t)
    return sum(work) * n_bh / sms / end, grid[0]


def main():
    print("headdim seqlen  G  head-major  grouped   (causal; event model, efficiency)")
    for d in TILES:
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            grouped, g = efficiency(d, s)
            print(f"{d:7d} {s:6d} {g:3d} {efficiency(d, s, grouped=False)[0]:11.3f} {grouped:8.3f}")


if __name__ == "__main__":
    main()
