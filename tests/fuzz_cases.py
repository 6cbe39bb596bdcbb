"""The fuzzer: random calls across flashattn2's public API against the package's reference (flashattn2.reference), by
flash_attn's tolerance rule (tests/tolerance.py). tests/test_fuzz.py runs it in CI for a fixed time at tiny sizes
through the interpreter; tools/fuzz.py runs it longer, on a GPU at realistic sizes.

A case is drawn from (seed, index) alone (`draw`), so any one replays without the others, and is plain data
(`Case`: the function, a data seed, the parameters), so a failure's printed `Case(...)` pasted into a test is that
test (`run`). What is drawn:

- the functions: flash_attn_func, the qkv- and kv-packed forms, flash_attn_varlen_func and its packed forms, the
  paged prefill (flash_attn_varlen_func with block_table), flash_attn_with_kvcache (appends, rotary, contiguous or
  paged caches, cache_batch_idx, cache_leftpad, int or tensor cache_seqlens, num_splits); forward and backward;
- every option: causal, window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads)), dropout (its mask
  read back from S_dmask, as tests/test_dropout.py does), deterministic (a repeated backward must be bitwise equal),
  learnable_sink (its gradient too), return_attn_probs (the logsumexp and its gradient), softmax_scale; the
  batch-invariant mode; forced tiles, the TMA load path, another arch's table rows (planning.force);
- shapes: lengths 0, 1, primes, and lengths and `seqlen_k - seqlen_q` at -1, 0 and +1 around multiples of every
  block size the plan can choose (`tile_sizes`); GQA ratios; head dims 1 to 512 (576 for the KV cache), a value
  head dim of its own; fp16, bf16, fp32; non-contiguous views (axes stored in another order, padded head dims,
  every other element, a strided last dimension);
- bad values among the index tensors (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens):
  with the value checks on, the error naming the argument and the caches untouched; with them off, no error and the
  other sequences' results right (what the bad sequence reads or writes is not checked).

KNOWN_DEFECTS lists what the fuzzer does not draw until it is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import time

import torch

import flashattn2
from flashattn2.ops import _runtime, planning
from flashattn2.ops.request import checks
from flashattn2.ops.planning import decoding
from flashattn2.reference import BWD_FACTOR, FWD_FACTOR, attention_ref, tolerance
from flashattn2.reference.kvcache import kvcache_ref
from tolerance import assert_close

# Known defects (issue 45), each kept out of the draw until it is fixed; remove an entry with its fix.
KNOWN_DEFECTS = {
    # a bad cache_batch_idx or block_table entry clamped onto row or page 0 or the last: with the checks off the
    # bad cases keep those out of the good sequences (canaries), so the append they receive is not seen
    "clamped-writes": "with the value checks off, an out-of-range append is clamped onto a row or page it does not own",
    # window edges stay below MAX_WINDOW
    "window-overflow": "a window edge near 2**31 overflows int32 in the kernels' key ranges",
    # the inputs are finite
    "nan-splits": "NaN inputs give 0 on the split-KV and batch-invariant paths",
}
MAX_WINDOW = 2**20

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PRIMES = [p for p in range(2, 5000) if all(p % d for d in range(2, int(p**0.5) + 1))]
API = {
    "func": "flash_attn_func",
    "qkvpacked": "flash_attn_qkvpacked_func",
    "kvpacked": "flash_attn_kvpacked_func",
    "varlen": "flash_attn_varlen_func",
    "varlen_qkvpacked": "flash_attn_varlen_qkvpacked_func",
    "varlen_kvpacked": "flash_attn_varlen_kvpacked_func",
    "varlen_paged": "flash_attn_varlen_func",
    "kvcache": "flash_attn_with_kvcache",
    "bad_kvcache": "flash_attn_with_kvcache",
    "bad_varlen": "flash_attn_varlen_func",
}
WEIGHTS = {
    "func": 34,
    "qkvpacked": 5,
    "kvpacked": 7,
    "varlen": 14,
    "varlen_qkvpacked": 3,
    "varlen_kvpacked": 4,
    "varlen_paged": 6,
    "kvcache": 15,
    "bad_kvcache": 7,
    "bad_varlen": 5,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How large a drawn case may be."""

    max_len: int  # a sequence's queries or keys, a cache's capacity
    max_batch: int
    max_heads_k: int
    max_group: int  # query heads per K/V head
    max_work: int  # batch x nheads x seqlen_q x seqlen_k x head-dim blocks of 128 (the reference's work)
    max_new: int  # tokens appended to a KV cache per call
    budget: float  # the interpreter's programs a call may take (_attention_cost; inf on a GPU)
    gpu: bool


CPU = Sizes(max_len=200, max_batch=3, max_heads_k=2, max_group=4, max_work=200_000, max_new=9, budget=16, gpu=False)
GPU = Sizes(
    max_len=4200, max_batch=4, max_heads_k=4, max_group=8, max_work=1 << 26, max_new=300, budget=math.inf, gpu=True
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: fn (a key of API), seed (its tensors' values and dropout's Philox seed), p (its parameters)."""

    fn: str
    seed: int
    p: dict

    def __str__(self) -> str:
        return repr(self)


# ---------------------------------------------------------------------------------------------------------------
# The block sizes the plan chooses


def _triton_tiles(kernel: str):
    """TABLE's Triton tiles of one kernel, each (block_m, block_n) once: what the CPU fuzzer forces."""
    seen = []
    for row in planning.TABLE:
        tile = row.dq_tile if kernel == "bwd_dq" else row.tile
        if row.kernel == ("fwd" if kernel == "fwd" else "bwd_dkdv") and tile is not None:
            if (tile.block_m, tile.block_n) not in seen:
                seen.append((tile.block_m, tile.block_n))
    return seen


FORCED_TILES = {kernel: _triton_tiles(kernel) for kernel in ("fwd", "bwd_dkdv", "bwd_dq")}


def tile_sizes(archs, head_dims=(32, 64, 128, 256, 512)) -> tuple[int, ...]:
    """Every block size the plan can choose on these archs ("sm90", "sm80", "sm86", "interp"): TABLE's tiles (block_m,
    block_n, the dQ pass's, the Gluon forwards' rows per program: block_m x their consumer warpgroups), the KV-cache
    kernel's key blocks (its rows scaled to these head dims, both element sizes) and packed rows, and the
    batch-invariant mode's split."""
    sizes = set()
    for row in planning.TABLE:
        if row.arch not in archs:
            continue
        for tile in (row.tile, row.dq_tile):
            if tile is not None:
                sizes |= {tile.block_m, tile.block_n}
        if row.kernel == "fwd_hopper_persist":
            sizes.add(row.tile.block_m * row.tile.num_warps // 4)
        elif row.kernel == "fwd_hopper_ws":
            sizes.add(2 * row.tile.block_m)
    for arch in archs:
        for row in planning.DECODE_ROWS:
            facts = dict(row.when)
            if facts.get("interp", arch == "interp") != (arch == "interp"):
                continue
            for d in head_dims:
                for elem_bytes in (2, 4):
                    sizes.add(planning.decode_tile(row, 16, d, d, elem_bytes).block_n)
        sizes |= {decoding.rows_block(r) for r in (1, 17, 33)}
        sizes.add(planning.INVARIANT_SPLIT_KEYS_INTERP if arch == "interp" else planning.INVARIANT_SPLIT_KEYS)
    return tuple(sorted(sizes))


# ---------------------------------------------------------------------------------------------------------------
# Drawing


def _near(rng, tiles, hi):
    """A length at -1, 0 or +1 around a multiple of one of the tiles, in [0, hi]."""
    fitting = [t for t in tiles if t <= hi] or [1]
    t = rng.choice(fitting)
    return min(hi, max(0, rng.randint(1, max(1, hi // t)) * t + rng.choice((-1, 0, 1))))


def _length(rng, tiles, hi):
    r = rng.random()
    if r < 0.12:
        return min(hi, rng.choice((0, 1, 1, 2)))
    if r < 0.3:
        return rng.choice([p for p in PRIMES if p <= hi] or [min(hi, 1)])
    if r < 0.8:
        return _near(rng, tiles, hi)
    return rng.randint(0, hi)


def _offset(rng, tiles, hi):
    """seqlen_k - seqlen_q: +-(k * tile + delta), or +-(k * tile_n - tile_m + delta) (where a query block's last row
    meets a key block's first key), delta in -1, 0, 1."""
    t = rng.choice(tiles)
    off = rng.randint(0, max(0, hi // t)) * t
    if rng.random() < 0.3:
        off -= rng.choice(tiles)
    return (off + rng.choice((-1, 0, 1))) * rng.choice((1, -1))


def _pair(rng, tiles, hi, same=False, diagonal=0.6):
    """(seqlen_q, seqlen_k) in [0, hi]: with probability `diagonal` seqlen_k - seqlen_q near a tile boundary (_offset)
    and seqlen_q around a multiple of a tile (a block or more: a full query block meets the diagonal), else two lengths
    of _length."""
    for _ in range(200):
        on_diagonal = not same and rng.random() < diagonal
        sq = _near(rng, tiles, hi) if on_diagonal else _length(rng, tiles, hi)
        if same:
            return sq, sq
        sk = sq + _offset(rng, tiles, hi) if on_diagonal else _length(rng, tiles, hi)
        if 0 <= sk <= hi:
            return sq, sk
    return 1, 1


def _head_dim(rng, sizes, limit=512):
    """1 to 512: the model sizes' powers of two, any other; on the CPU mostly small ones (the interpreter's 16-bit
    matmuls cost ~3x more at 128 than at 32)."""
    r = rng.random() * (1 if sizes.gpu else 0.9)
    if r < 0.25:
        return rng.choice((16, 32, 64, 128) if sizes.gpu else (16, 32, 64))
    if r < 0.5 or (not sizes.gpu and r < 0.65):
        return rng.randint(1, 64)
    if r < 0.8:
        return rng.randint(65, 256)
    return min(limit, rng.choice((rng.randint(257, 512), 512, 320)))


def _layout(rng, ndim, last_ok=True):
    """How a tensor lies in memory: (order of its axes but the last, padding of the last, an axis taking every other
    element (-1: none), a strided last dimension)."""
    order = list(range(ndim - 1))
    if rng.random() < 0.35:
        rng.shuffle(order)
    pad = rng.choice((1, 3, 8)) if rng.random() < 0.3 else 0
    step = rng.randrange(ndim - 1) if rng.random() < 0.2 else -1
    last = last_ok and rng.random() < 0.05
    return (tuple(order), pad, step, last)


def _window(rng, tiles, hi):
    def edge():
        r = rng.random()
        if r < 0.25:
            return -1
        if r < 0.45:
            return rng.choice((0, 1, 2))
        if r < 0.75:
            return _near(rng, tiles, hi)
        if r < 0.9:
            return rng.randint(0, hi)
        return rng.randint(hi, MAX_WINDOW - 1)  # past every key (KNOWN_DEFECTS: window-overflow)

    return (edge(), edge())


def _options(rng, p, tiles, hi, dropout=True):
    """The score options every attention function takes."""
    # the masks whose key-block ranges the kernels compute, weighted toward causal's (where most calls are)
    mask = rng.choices(("none", "causal", "window", "causal-window"), (15, 55, 15, 15))[0]
    p["causal"] = mask.startswith("causal")
    p["window"] = _window(rng, tiles, hi) if mask.endswith("window") else (-1, -1)
    p["softcap"] = round(rng.uniform(0.3, 30.0), 3) if rng.random() < 0.2 else 0.0
    p["alibi"] = rng.choice((None, None, None, "h", "bh"))
    p["sink"] = rng.random() < 0.2
    r = rng.random()
    p["scale"] = None if r < 0.8 else 0.0 if r < 0.83 else round(rng.uniform(0.01, 1.0), 4)
    p["dropout"] = round(rng.uniform(0.05, 0.5), 3) if dropout and p["softcap"] == 0 and rng.random() < 0.15 else 0.0


def _modes_draw(rng, p, sizes, dense):
    """The batch-invariant mode, and what planning.force may change: on the CPU a Triton tile of each kernel from
    TABLE and the TMA load path, on a GPU another arch's rows or the Gluon kernels off."""
    p["invariant"] = p.get("dropout", 0) == 0 and rng.random() < 0.1
    if not dense or p["invariant"]:
        return
    if not sizes.gpu and rng.random() < 0.25:
        p["tiles"] = {kernel: rng.choice(FORCED_TILES[kernel]) for kernel in ("fwd", "bwd_dkdv", "bwd_dq")}
        p["tma"] = rng.random() < 0.3
    if sizes.gpu:
        p["arch"] = rng.choice((None, None, "sm80", "sm86"))
        p["hopper"] = False if rng.random() < 0.2 else None


def _tiles_of(p, sizes, decode=False):
    """The block sizes a case's lengths are drawn around: what its plan can run."""
    if sizes.gpu:
        return tile_sizes(("sm90", "sm80", "sm86"))
    if decode or p.get("invariant"):
        return (16, 32, 64)
    if "tiles" in p:
        return tuple(sorted({x for tile in p["tiles"].values() for x in tile}))
    return (planning.INTERP.block_m, planning.INTERP.block_n)


def _dtype(rng, fp32=True):
    return rng.choices(("fp16", "bf16", "fp32"), (4, 4, 2 if fp32 else 0))[0]


def _blocks(n, tile):
    return -(-n // tile)


def _width(p):
    """How a program's cost grows with the head dims in the interpreter (numpy's 16-bit matmuls are slow)."""
    return 1 + max(p["d"], p["dv"]) / 128


def _decode_cost(p, batch, rows, keys, splits=1):
    """The KV-cache kernel's programs (and a quarter per key block each loops over), in interpreter units."""
    programs = batch * p["nheads_k"] * _blocks(max(rows, 1), decoding.rows_block(rows)) * splits
    return _width(p) * (programs * (1 + _blocks(max(keys, 1), splits * 16) / 4) + (programs if splits > 1 else 0))


def _attention_cost(p, pairs):
    """What a dense or varlen call costs the interpreter, in programs (each ~30-100 ms), a quarter more per key or
    query block each loops over: the forward, the backward's dK/dV and dQ passes (split by columns past head dim
    256), the repeated backward. A varlen grid has each sequence's programs for the longest: the shorter ones' extra
    programs return at once (a third)."""
    h = p["nheads"]
    if p.get("invariant"):
        fwd = sum(_decode_cost(p, 1, h // p["nheads_k"] * sq, sk, _blocks(max(sk, 1), 32)) for sq, sk in pairs)
    else:
        bm, bn = p.get("tiles", {}).get("fwd", (planning.INTERP.block_m, planning.INTERP.block_n))
        fwd = h * _width(p) * sum(_blocks(sq, bm) * (1 + _blocks(sk, bn) / 4) for sq, sk in pairs)
        fwd *= 2 if p["dropout"] else 1  # S_dmask: a second pass
    longest_q, longest_k = max(q for q, _ in pairs), max(k for _, k in pairs)
    idle = len(pairs) * h * (_blocks(longest_q, 64) + _blocks(longest_k, 64)) / 3
    if not p["backward"]:
        return fwd + idle
    bm, bn = p.get("tiles", {}).get("bwd_dkdv", (planning.INTERP.block_m, planning.INTERP.block_n))
    bwd = h * _width(p) * sum(_blocks(sk, bn) * (1 + _blocks(sq, bm) / 4) + _blocks(sq, bm) * (1 + _blocks(sk, bn) / 4)
                              for sq, sk in pairs)  # fmt: skip
    bwd *= 2 if max(p["d"], p["dv"]) > 256 else 1
    return fwd + idle + bwd * (2 if p["repeat"] else 1)


def _grad_draw(rng, p, sizes, backward=True):
    p["deterministic"] = rng.random() < 0.5
    p["backward"] = backward and rng.random() < 0.7
    # a second backward must give the same bits: on the CPU (deterministic whatever the flag) now and then
    p["repeat"] = p["backward"] and p["deterministic"] and not p["dropout"] and (sizes.gpu or rng.random() < 0.15)
    p["lse"] = p["dropout"] > 0 or (p["sink"] and p["backward"]) or rng.random() < 0.5
    p["dlse"] = p["lse"] and p["backward"] and rng.random() < 0.5


def _fit_heads(rng, p, sizes, cost, same=False):
    """nheads_k and nheads (a GQA ratio) and batch (where p has one) as drawn, then smaller until cost(p) (the
    fraction of the sizes' budget and work a case takes) is at most 1: False if even one head does not fit."""
    p["nheads_k"] = rng.randint(1, sizes.max_heads_k)
    group = 1 if same else rng.choice([g for g in (1, 1, 2, 3, 4, 5, 8) if g <= sizes.max_group])
    p["nheads"] = p["nheads_k"] * group
    if "batch" in p:
        p["batch"] = rng.randint(1, sizes.max_batch)
    while cost(p) > 1:
        if p.get("batch", 1) > 1:
            p["batch"] -= 1
        elif p["nheads"] > p["nheads_k"]:
            p["nheads"] -= p["nheads_k"]
        elif p["nheads_k"] > 1:
            p["nheads"] = p["nheads_k"] = p["nheads_k"] - 1
        else:
            return False
    return True


def _unsupported_arch(p):
    """sm86's rows have no fp32 backward past head dim 256 (tables.UNSUPPORTED): another arch's rows for those."""
    if p.get("arch") == "sm86" and p["dtype"] == "fp32" and max(p["d"], p["dv"]) > 256 and p["backward"]:
        p["arch"] = "sm80"


def _draw_dense(rng, sizes, fn):
    p = {"dtype": _dtype(rng), "d": _head_dim(rng, sizes)}
    p["dv"] = _head_dim(rng, sizes) if fn == "func" and rng.random() < 0.25 else p["d"]
    _options(rng, p, (64,), sizes.max_len)
    _modes_draw(rng, p, sizes, dense=True)
    _grad_draw(rng, p, sizes)
    _unsupported_arch(p)
    tiles = _tiles_of(p, sizes)
    if p["window"] != (-1, -1) and rng.random() < 0.5:
        p["window"] = _window(rng, tiles, sizes.max_len)
    hi = sizes.max_len
    for _ in range(30):  # shorter each time nothing fits
        p["seqlen_q"], p["seqlen_k"] = _pair(rng, tiles, hi, same=fn == "qkvpacked", diagonal=0.85)
        p["batch"] = 1

        def cost(p):
            work = p["batch"] * p["nheads"] * p["seqlen_q"] * p["seqlen_k"] * _blocks(max(p["d"], p["dv"]), 128)
            return max(
                work / sizes.max_work, _attention_cost(p, [(p["seqlen_q"], p["seqlen_k"])] * p["batch"]) / sizes.budget
            )

        if _fit_heads(rng, p, sizes, cost, same=fn == "qkvpacked"):
            break
        hi = max(2, hi * 3 // 4)
    if rng.random() < 0.02:
        p["batch"] = 0
    names = {"qkvpacked": ("qkv",), "kvpacked": ("q", "kv")}.get(fn, ("q", "k", "v"))
    p["layouts"] = {name: _layout(rng, 5 if name in ("qkv", "kv") else 4) for name in names}
    return p


def _draw_varlen(rng, sizes, fn):
    p = {"dtype": _dtype(rng), "d": _head_dim(rng, sizes)}
    same, paged = fn == "varlen_qkvpacked", fn == "varlen_paged"
    p["dv"] = _head_dim(rng, sizes) if fn in ("varlen", "varlen_paged") and rng.random() < 0.25 else p["d"]
    _options(rng, p, (64,), sizes.max_len, dropout=not paged)
    _modes_draw(rng, p, sizes, dense=not paged)
    _grad_draw(rng, p, sizes, backward=not paged)
    _unsupported_arch(p)
    if paged:
        p["page"] = rng.choice((1, 3, 5, 16, 64, 128, 256) if sizes.gpu else (1, 3, 5, 16, 32, 64))
    tiles = _tiles_of(p, sizes, decode=paged)
    if p["window"] != (-1, -1) and rng.random() < 0.5:
        p["window"] = _window(rng, tiles, sizes.max_len)

    def cost(p):
        pairs = list(zip(p["lengths_q"], p["lengths_k"]))
        work = p["nheads"] * sum(a * b for a, b in pairs) * _blocks(max(p["d"], p["dv"]), 128)
        if paged:
            group = p["nheads"] // p["nheads_k"]
            rows = group * max(p["lengths_q"], default=0)
            keys = max(p["lengths_k"], default=0)
            return max(work / sizes.max_work, _decode_cost(p, len(pairs), rows, keys) / sizes.budget)
        return max(work / sizes.max_work, _attention_cost(p, pairs) / sizes.budget)

    p["lengths_q"], p["lengths_k"] = [1], [1]
    _fit_heads(rng, p, sizes, cost, same=same)
    p["lengths_q"], p["lengths_k"] = [], []
    for _ in range(rng.randint(1, sizes.max_batch + 1)):
        hi = sizes.max_len
        for _ in range(10):  # shorter each time it does not fit
            sq, sk = _pair(rng, tiles, hi, same=same, diagonal=0.85)
            p["lengths_q"].append(sq)
            p["lengths_k"].append(sk)
            if cost(p) <= 1:
                break
            p["lengths_q"].pop()
            p["lengths_k"].pop()
            hi = max(2, hi * 2 // 3)
        else:  # the budget is spent: no more sequences (but one)
            if p["lengths_q"]:
                break
            p["lengths_q"].append(1)
            p["lengths_k"].append(1)
    p["tail_q"] = rng.choice((0, 0, 0, 1, 3))
    p["tail_k"] = p["tail_q"] if same else rng.choice((0, 0, 0, 2))
    p["slack"] = rng.choice((0, 0, 0, 1, 7))  # max_seqlen past the longest sequence
    p["max_tensor"] = rng.random() < 0.1
    if paged:
        p["layouts"] = {"q": _layout(rng, 3), "k": _layout(rng, 4, last_ok=False), "v": _layout(rng, 4, False)}
        return p
    names = {"varlen_qkvpacked": ("qkv",), "varlen_kvpacked": ("q", "kv")}.get(fn, ("q", "k", "v"))
    p["layouts"] = {name: _layout(rng, 4 if name in ("qkv", "kv") else 3) for name in names}
    return p


def _draw_kvcache(rng, sizes, bad=False):
    p = {"dtype": _dtype(rng)}
    if rng.random() < 0.05:
        p["d"], p["dv"] = 576, 512  # MLA's latent shape; v_cache the K cache's first 512 columns, or a cache of its own
        p["latent"] = rng.random() < 0.6
    else:
        p["d"] = _head_dim(rng, sizes)
        p["dv"] = _head_dim(rng, sizes) if rng.random() < 0.25 else p["d"]
    _options(rng, p, (16,), sizes.max_len, dropout=False)
    p["invariant"] = not bad and rng.random() < 0.1
    tiles = _tiles_of(p, sizes, decode=True)
    p["page"] = rng.choice((None, None, 1, 3, 5, 16, 32, 64, 128, 256 if sizes.gpu else 48))
    if bad and p["page"] is None and rng.random() < 0.5:
        p["page"] = rng.choice((3, 16))
    p["num_splits"] = rng.choice((0, 0, 1, 1, 2, 3, 5, 64))
    new = 0 if rng.random() < 0.4 else _length(rng, tiles, sizes.max_new) or 1
    seqlen_q = _length(rng, tiles, max(1, sizes.max_new)) if rng.random() < 0.5 else 1
    p["seqlen_q"] = new if rng.random() < 0.1 else seqlen_q  # a chunked prefill: the new tokens' queries

    def cost(p):
        rows = p["nheads"] // p["nheads_k"] * p["seqlen_q"]
        splits = (
            _blocks(p["capacity"], 32) if p["invariant"] else max(1, min(p["num_splits"], _blocks(p["capacity"], 16)))
        )
        work = p["batch"] * p["nheads"] * p["seqlen_q"] * p["capacity"] * _blocks(max(p["d"], p["dv"]), 128)
        return max(work / sizes.max_work, _decode_cost(p, p["batch"], rows, p["capacity"], splits) / sizes.budget)

    hi = sizes.max_len
    for _ in range(30):  # shorter each time nothing fits
        capacity = max(1, _near(rng, tiles, hi) if rng.random() < 0.7 else rng.randint(1, hi))
        if p["page"]:
            capacity = -(-capacity // p["page"]) * p["page"]
        p["capacity"], p["batch"] = capacity, 1
        if _fit_heads(rng, p, sizes, cost):
            break
        hi = max(1, hi * 3 // 4)
    if not bad and not p["page"] and rng.random() < 0.03:
        p["capacity"], new = 0, 0  # a cache of no positions
    new = min(new, p["capacity"])
    p["seqlen_new"] = new
    kind = "tensor" if bad else rng.choices(("tensor", "int", "none"), (7, 2, 1 if new == 0 else 0))[0]
    p["seqlens_kind"] = kind
    room = p["capacity"] - new

    def seqlen():
        r = rng.random()
        return room if r < 0.2 else rng.randint(0, room) if r < 0.5 else min(room, _near(rng, tiles, room + 1))

    batch = p["batch"]
    p["cache_seqlens"] = [seqlen() for _ in range(batch)] if kind == "tensor" else seqlen() if kind == "int" else None
    p["batch_idx"] = p["page"] is None and (bad or rng.random() < 0.3)
    p["extra"] = rng.randint(0, 3)  # cache rows or pages no sequence owns
    p["leftpad"] = kind == "tensor" and rng.random() < 0.25
    if p["leftpad"]:
        p["leftpads"] = [rng.randint(0, s) for s in p["cache_seqlens"]]
    # rotary rotates k's first columns: not where a latent cache's v (those columns of the same memory) is appended
    rotary = new and p["d"] > 1 and not p.get("latent") and rng.random() < 0.4
    p["rotary"] = rng.choice(("neox", "gptj")) if rotary else None
    if p["rotary"]:
        p["rotary_dim"] = 2 * rng.randint(1, max(1, p["d"] // 2))
    p["lse"] = rng.random() < 0.6
    p["layouts"] = {
        "q": _layout(rng, 4),
        "k_cache": _layout(rng, 4, last_ok=False),
        "v_cache": _layout(rng, 4, last_ok=False),
        "k": _layout(rng, 4),
        "v": _layout(rng, 4),
    }
    return p


def _draw_bad_kvcache(rng, sizes):
    p = _draw_kvcache(rng, sizes, bad=True)
    p["checks"] = rng.random() < 0.5
    targets = ["cache_seqlens", "cache_seqlens_int", "cache_leftpad"]
    targets.append("block_table" if p["page"] else "cache_batch_idx")
    which = rng.choice(targets)
    b = rng.randrange(p["batch"])
    room = p["capacity"] - p["seqlen_new"]
    if which == "cache_leftpad" and not p["leftpad"]:
        p["leftpad"], p["leftpads"] = True, [0] * p["batch"]
    if which == "cache_seqlens":
        value = room + rng.randint(1, 4) if rng.random() < 0.8 else -rng.randint(1, 3)
    elif which == "cache_seqlens_int":
        value = room + rng.randint(1, 4)
    elif which == "cache_leftpad":
        value = p["cache_seqlens"][b] + rng.randint(1, 3) if rng.random() < 0.7 else -rng.randint(1, 3)
    elif which == "cache_batch_idx":
        value = p["batch"] + p["extra"] + 2 + rng.randint(0, 3) if rng.random() < 0.7 else -rng.randint(1, 3)
    else:  # a page the sequence uses: it holds at least one key
        p["cache_seqlens"][b] = max(1, p["cache_seqlens"][b]) if room >= 1 else p["cache_seqlens"][b]
        used = max(1, -(-(p["cache_seqlens"][b] + p["seqlen_new"]) // p["page"]))
        blocks = p["batch"] * (p["capacity"] // p["page"]) + p["extra"] + 2
        value = (rng.randrange(used), blocks + rng.randint(0, 3) if rng.random() < 0.7 else -rng.randint(1, 3))
    p["bad"] = (which, b, value)
    return p


def _draw_bad_varlen(rng, sizes):
    paged = rng.random() < 0.35
    p = _draw_varlen(rng, sizes, "varlen_paged" if paged else "varlen")
    p.update(paged=paged, backward=False, dlse=False, dropout=0.0, invariant=False, checks=rng.random() < 0.5)
    p.pop("tiles", None)
    lengths_q, lengths_k = p["lengths_q"], p["lengths_k"]
    n = len(lengths_q)
    which = rng.choice(["cu_seqlens_q", "cu_seqlens_k"] + (["block_table"] if paged else []))
    if which == "block_table":
        with_keys = [b for b in range(n) if lengths_k[b] > 0] or [0]
        b = rng.choice(with_keys)
        lengths_k[b] = max(1, lengths_k[b])
        used = -(-lengths_k[b] // p["page"])
        p["bad"] = (which, b, (rng.randrange(used), None if rng.random() < 0.7 else -rng.randint(1, 3)))
        return p
    lengths = lengths_q if which == "cu_seqlens_q" else lengths_k
    kinds = ["start", "decrease", "past"] + (["longest"] if p["checks"] and max(lengths) > 0 else [])
    kind = rng.choice(kinds)
    i = {"start": 0, "past": n}.get(kind, rng.randint(1, n))
    p["bad"] = (which, kind, i, rng.randint(1, 4))
    return p


DRAW = {
    "func": _draw_dense,
    "qkvpacked": _draw_dense,
    "kvpacked": _draw_dense,
    "varlen": _draw_varlen,
    "varlen_qkvpacked": _draw_varlen,
    "varlen_kvpacked": _draw_varlen,
    "varlen_paged": _draw_varlen,
    "kvcache": lambda rng, sizes, fn: _draw_kvcache(rng, sizes),
    "bad_kvcache": lambda rng, sizes, fn: _draw_bad_kvcache(rng, sizes),
    "bad_varlen": lambda rng, sizes, fn: _draw_bad_varlen(rng, sizes),
}


def draw(seed: int, index: int, sizes: Sizes = CPU, functions=None) -> Case:
    """Case `index` of the run seeded `seed` (the same whatever came before it); functions: the keys of API to draw
    from (None: all, by WEIGHTS)."""
    rng = random.Random(f"{seed}:{index}")
    names = [f for f in WEIGHTS if functions is None or f in functions]
    fn = rng.choices(names, [WEIGHTS[f] for f in names])[0]
    p = DRAW[fn](rng, sizes, fn)
    return Case(fn, rng.randrange(2**31), p)


# ---------------------------------------------------------------------------------------------------------------
# Running


def _tensor(gen, shape, dtype, device, layout):
    """A standard-normal tensor of `shape` laid out in memory as `layout` (_layout) says."""
    order, pad, step, last = layout
    full = list(shape)
    if step >= 0:
        full[step] *= 2
    stored = [full[i] for i in order] + [full[-1] + pad] + ([2] if last else [])
    base = torch.randn(stored, generator=gen, device=device, dtype=dtype)
    if last:
        base = base[..., 0]
    t = base[..., : full[-1]].permute(*sorted(range(len(order)), key=order.__getitem__), len(order))
    if step >= 0:
        t = t[(slice(None),) * step + (slice(None, None, 2),)]
    assert tuple(t.shape) == tuple(shape), (t.shape, shape)
    return t


def _rand(gen, shape, device, dtype=torch.float32, scale=1.0):
    return torch.randn(shape, generator=gen, device=device, dtype=dtype) * scale


@contextlib.contextmanager
def _modes(p):
    """The case's planning.force() state, batch-invariant mode and value checks."""
    forced = {kernel: planning.TileConfig(bm, bn, 4, 1) for kernel, (bm, bn) in p.get("tiles", {}).items()}
    if p.get("tma"):
        forced["tma"] = True
    if p.get("arch"):
        forced["arch"] = p["arch"]
    if p.get("hopper") is False:
        forced["hopper"] = False
    previous = checks.set_value_checks(bool(p.get("checks", False)))
    try:
        with planning.force(**forced), flashattn2.batch_invariant(bool(p.get("invariant"))):
            yield
    finally:
        checks.set_value_checks(previous)


def _score_kwargs(p, alibi, sink, keys=None):
    """The options of a call; keys: the reference's, with flash_attn's window rule for the API's seqlen_k (dense) or
    max_seqlen_k (varlen): an edge at or past the keys' end is no edge (ops.run.call.window_edges)."""
    window = tuple(p["window"]) if keys is None else tuple(-1 if w >= keys else w for w in p["window"])
    return dict(
        softmax_scale=p["scale"],
        causal=p["causal"],
        window_size=window,
        softcap=p["softcap"],
        alibi_slopes=alibi,
        learnable_sink=sink,
    )


def _alibi(p, gen, batch, device):
    if p["alibi"] is None:
        return None
    return _rand(gen, (p["nheads"],) if p["alibi"] == "h" else (batch, p["nheads"]), device).abs() * 0.3


def _sink(p, gen, device):
    return _rand(gen, (p["nheads"],), device, scale=2.0) if p["sink"] else None


def _leaf(t, grad=True):
    return t.detach().clone().requires_grad_(grad)


def _compare(name, ours, ref, low, allowance=None):
    """Each of out, lse, dq, dk, dv present in ours against the oracle, by the rule (lse: where finite; +inf where
    the oracle's is); dq and dk with allowance's (_delta_allowance) beside it."""
    for key, got in ours.items():
        if key == "lse":
            inf = torch.isposinf(ref["lse"])
            assert torch.equal(torch.isposinf(got), inf), f"{name} lse: rows without keys must have lse=+inf, only they"
            assert_close(f"{name} lse", got[~inf], ref["lse"][~inf], low["lse"][~inf].float(), FACTORS["lse"])
        elif key != "dsink":
            extra = (allowance or {}).get(key)
            _close(f"{name} {key}", got, ref[key], low[key].to(got.dtype), FACTORS[key], extra)


def _check_dsink(name, dsink, sink, out, lse, ref_out, ref_lse, dout, dlse):
    """d sink = -sum over rows of exp(sink - L_i) (rowsum(dO_i O_i) - dlse_i): equal to that formula on our out and
    lse (1e-4), and to the oracle's within what our out's and lse's errors can move it (as tests/test_sinks.py).
    out, ref_out, dout (rows, nheads, dv); lse, ref_lse, dlse (nheads, rows)."""
    s = sink.detach().double()[:, None]
    dlse = torch.zeros_like(lse) if dlse is None else dlse

    def delta(o):
        return (dout.double() * o.detach().double()).sum(-1).T - dlse.double()

    def formula(o, lse_):
        return -(torch.exp(s - lse_.detach().double()) * delta(o)).nan_to_num(0).sum(1)

    torch.testing.assert_close(
        dsink.double(), formula(out, lse), rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} dsink: {m}"
    )
    finite = torch.isfinite(ref_lse)
    out_err = (out.double() - ref_out.detach().double()).abs().max() if out.numel() else 0.0
    lse_err = (lse.double() - ref_lse.detach().double())[finite].abs().max() if finite.any() else 0.0
    w = torch.exp(s - ref_lse.detach().double())
    l1 = dout.double().abs().sum(-1).T
    bound = (w * (l1 * out_err + delta(ref_out).abs() * lse_err)).nan_to_num(0).sum(1) + 1e-4
    err = (dsink.double() - formula(ref_out, ref_lse)).abs()
    assert (err <= bound).all(), f"{name} dsink: error {err.tolist()} > bound {bound.tolist()}"


def _grads(outputs, grad_outputs, inputs, repeat):
    """Gradients of inputs; repeat: a second backward, which must give the same bits (deterministic)."""
    grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=repeat)
    if repeat:
        again = torch.autograd.grad(outputs, inputs, grad_outputs)
        for i, (a, b) in enumerate(zip(grads, again)):
            assert torch.equal(a, b), f"deterministic=True: a second backward differs (gradient {i})"
    return grads


def _gradients(fn: str, outputs, grad_outputs, inputs, repeat: int, dim: int) -> dict:
    """dq, dk, dv (and dsink) of a call: outputs (out, lse) with grad_outputs (dout, dlse or None), inputs the leaves
    and the sink or None; a packed call's gradient split along dim (its q/k/v axis)."""
    if grad_outputs[1] is None:
        outputs, grad_outputs = outputs[:1], grad_outputs[:1]
    sink = inputs[-1]
    grads = _grads(outputs, grad_outputs, inputs if sink is not None else inputs[:-1], repeat)
    if fn.endswith("qkvpacked"):
        found = dict(zip(("dq", "dk", "dv"), grads[0].unbind(dim)))
    elif fn.endswith("kvpacked"):
        found = dict(dq=grads[0], dk=grads[1].select(dim, 0), dv=grads[1].select(dim, 1))
    else:
        found = dict(zip(("dq", "dk", "dv"), grads[:3]))
    if sink is not None:
        found["dsink"] = grads[-1]
    return found


FACTORS = {"out": FWD_FACTOR, "lse": FWD_FACTOR, "dq": BWD_FACTOR, "dk": BWD_FACTOR, "dv": BWD_FACTOR}


def _delta_allowance(p, q, k, opts, dout, out, ref_out):
    """What FlashAttention-2's backward may add to dq and dk (elementwise, like q and k) that PyTorch's does not: it
    takes delta_i = rowsum(dO_i * O_i) - dlse_i from the output it stored, rounded to the input dtype (with dropout
    scaled by 1 / (1 - p)), and sums it and dP in fp32 in another order, where PyTorch's softmax backward takes it
    from P exactly. With delta off by e_i, dS_ij = P_ij (dP_ij - delta_i) moves by P_ij e_i (times softcap's
    derivative, at most 1): dq_i by at most scale |e_i| (P |k|)_i and dk_j by scale (P^T (|e| |q|))_j. The rule's
    yardstick misses this where dq or dk is small by cancellation (rows that see one key or two: exactly 0 or
    nearly), and its max over the tensor then has no larger element to hide it. e_i: our output's error, as
    delta sees it, plus fp32's rounding of the two sums. P: the oracle's, without dropout (delta meets P
    undropped)."""
    r = ref_out.detach().double()
    do = dout.double()
    e = (do * (out.detach().double() - r)).sum(-1).abs() + 2 * torch.finfo(torch.float32).eps * (do * r).abs().sum(-1)
    scale = p["scale"] if p["scale"] is not None else q.shape[-1] ** -0.5
    opts = {key: value for key, value in opts.items() if key not in ("dropout_mask", "dropout_p")}
    q, k = q.detach(), k.detach()
    dummy = torch.zeros_like(k, requires_grad=True)  # a value whose gradient is P^T (the output's gradient)
    with torch.enable_grad():
        p_k, _ = attention_ref(q, k, k.abs(), **opts)
        o, _ = attention_ref(q, k, dummy, **opts)
        (pt,) = torch.autograd.grad(o, dummy, (e[..., None] * q.double().abs()).to(o.dtype))
    return scale * e[..., None] * p_k.double(), scale * pt.double()


def _close(name, ours, ref, low, factor, allowance=None):
    """assert_close, with an elementwise allowance (_delta_allowance) beside the rule's bound."""
    if allowance is not None:
        ok, err, bound = tolerance.check(ours, ref, low, factor)
        excess = (ours.double() - ref.double()).abs() - allowance
        if ok or (math.isfinite(bound) and not torch.isnan(excess).any() and excess.max().item() <= bound):
            return
    assert_close(name, ours, ref, low, factor)


def _run_dense(fn, p, gen, device):
    dtype = DTYPES[p["dtype"]]
    b, sq, sk, h, hk, d, dv = (p[x] for x in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "d", "dv"))
    lay, grad = p["layouts"], p["backward"]
    if fn == "qkvpacked":
        packed = _tensor(gen, (b, sq, 3, h, d), dtype, device, lay["qkv"]).requires_grad_(grad)
        q, k, v = packed.unbind(2)
        args, leaves = (packed,), (packed,)
    elif fn == "kvpacked":
        q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        packed = _tensor(gen, (b, sk, 2, hk, d), dtype, device, lay["kv"]).requires_grad_(grad)
        k, v = packed.unbind(2)
        args, leaves = (q, packed), (q, packed)
    else:
        q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        k = _tensor(gen, (b, sk, hk, d), dtype, device, lay["k"]).requires_grad_(grad)
        v = _tensor(gen, (b, sk, hk, dv), dtype, device, lay["v"]).requires_grad_(grad)
        args = leaves = (q, k, v)
    alibi, sink = _alibi(p, gen, b, device), _sink(p, gen, device)
    if sink is not None:
        sink.requires_grad_(grad)
    kwargs = _score_kwargs(p, alibi, sink)
    with _modes(p):
        result = getattr(flashattn2, API[fn])(
            *args, dropout_p=p["dropout"], deterministic=p["deterministic"], return_attn_probs=p["lse"], **kwargs
        )
    out, lse, s_dmask = result if p["lse"] else (result, None, None)
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype, (out.shape, out.dtype)
    keep = s_dmask[:, :, :sq, :sk] >= 0 if p["dropout"] else None
    dout = _rand(gen, out.shape, device, dtype)
    dlse = _rand(gen, lse.shape, device) if p["dlse"] else None
    ours = {"out": out} | ({"lse": lse} if lse is not None else {})
    if grad:
        ours.update(_gradients(fn, (out, lse), (dout, dlse), (*leaves, sink), p["repeat"], 2))
    qr, kr, vr = (_leaf(t, grad) for t in (q, k, v))
    sr = _leaf(sink, grad) if sink is not None else None
    opts = _score_kwargs(p, alibi, sr, sk) | dict(dropout_mask=keep, dropout_p=p["dropout"])
    ref, low = {}, {}
    for upcast, into in ((True, ref), (False, low)):
        into["out"], into["lse"] = attention_ref(qr, kr, vr, upcast=upcast, **opts)
        if grad:
            outputs = [into["out"]]
            grad_outputs = [dout.to(into["out"].dtype)]
            if dlse is not None:
                finite = torch.isfinite(into["lse"])
                outputs.append(into["lse"].masked_fill(~finite, 0))
                grad_outputs.append(dlse.to(into["lse"].dtype))
            into.update(zip(("dq", "dk", "dv"), torch.autograd.grad(outputs, (qr, kr, vr), grad_outputs)))
    allowance = None
    if grad:
        ropts = _score_kwargs(p, alibi, sr, sk)
        allowance = dict(zip(("dq", "dk"), _delta_allowance(p, qr, kr, ropts, dout, out, ref["out"])))
    _compare(fn, ours, ref, low, allowance)
    if sink is not None and grad:
        _check_dsink(
            fn, ours["dsink"], sink, out.reshape(-1, h, dv), lse.permute(1, 0, 2).reshape(h, -1),
            ref["out"].reshape(-1, h, dv), ref["lse"].permute(1, 0, 2).reshape(h, -1), dout.reshape(-1, h, dv),
            None if dlse is None else dlse.permute(1, 0, 2).reshape(h, -1),
        )  # fmt: skip


def cu_of(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32).to(device)


def _page_table(seed, lengths, page, extra, canaries):
    """A block table (batch, max_blocks) of random distinct blocks for sequences of these lengths, and the number of
    blocks; canaries: blocks 0 and the last are nobody's (a bad entry is clamped onto them)."""
    max_blocks = max(1, max((-(-n // page) for n in lengths), default=1))
    num_blocks = len(lengths) * max_blocks + extra + (2 if canaries else 0)
    first = 1 if canaries else 0
    order = torch.randperm(num_blocks - 2 * first, generator=torch.Generator().manual_seed(seed)) + first
    return order[: len(lengths) * max_blocks].view(len(lengths), max_blocks), num_blocks


def _pages(gen, x, lengths, page, table, num_blocks, layout):
    """Random pages (num_blocks, page, heads, headdim) holding the rows of sequences packed in x (total, heads,
    headdim) through table."""
    pages = _tensor(gen, (num_blocks, page, *x.shape[1:]), x.dtype, x.device, layout)
    with torch.no_grad():
        start = 0
        for b, n in enumerate(lengths):
            for j in range(0, n, page):
                m = min(page, n - j)
                pages[int(table[b, j // page]), :m] = x[start + j : start + j + m]
            start += n
    return pages


def _run_varlen(fn, p, gen, device, bad=None):
    dtype = DTYPES[p["dtype"]]
    lq, lk, h, hk, d, dv = (p[x] for x in ("lengths_q", "lengths_k", "nheads", "nheads_k", "d", "dv"))
    batch = len(lq)
    tq, tk = sum(lq) + p["tail_q"], sum(lk) + p["tail_k"]
    lay, grad = p["layouts"], p["backward"]
    paged = fn == "varlen_paged"
    if fn == "varlen_qkvpacked":
        packed = _tensor(gen, (tq, 3, h, d), dtype, device, lay["qkv"]).requires_grad_(grad)
        q, k, v = packed.unbind(1)
        leaves = (packed,)
    elif fn == "varlen_kvpacked":
        q = _tensor(gen, (tq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        packed = _tensor(gen, (tk, 2, hk, d), dtype, device, lay["kv"]).requires_grad_(grad)
        k, v = packed.unbind(1)
        leaves = (q, packed)
    else:
        q = _tensor(gen, (tq, h, d), dtype, device, lay["q"]).requires_grad_(grad)
        contiguous = ((0, 1), 0, -1, False)
        k = _tensor(gen, (tk, hk, d), dtype, device, contiguous if paged else lay["k"]).requires_grad_(grad)
        v = _tensor(gen, (tk, hk, dv), dtype, device, contiguous if paged else lay["v"]).requires_grad_(grad)
        leaves = (q, k, v)
    cu_q, cu_k = cu_of(lq, device), cu_of(lk, device)
    if fn == "varlen_qkvpacked":
        cu_k = cu_q
    max_q, max_k = max(lq, default=0) + p["slack"], max(lk, default=0) + p["slack"]
    if p["max_tensor"]:
        max_q, max_k = torch.tensor([max_q]), torch.tensor(max_k)
    alibi, sink = _alibi(p, gen, batch, device), _sink(p, gen, device)
    if sink is not None:
        sink.requires_grad_(grad)
    kwargs = _score_kwargs(p, alibi, sink) | dict(return_attn_probs=p["lse"], deterministic=p["deterministic"])
    if fn == "varlen_qkvpacked":
        args = (packed, cu_q, max_q)
    elif fn == "varlen_kvpacked":
        args = (q, packed, cu_q, cu_k, max_q, max_k)
    elif paged:
        table, num_blocks = _page_table(gen.initial_seed(), lk, p["page"], 1, canaries=bad is not None)
        k_pages = _pages(gen, k, lk, p["page"], table, num_blocks, lay["k"])
        v_pages = _pages(gen, v, lk, p["page"], table, num_blocks, lay["v"])
        kwargs["block_table"] = table.to(torch.int32).to(device)
        args = (q, k_pages, v_pages, cu_q, cu_k, max_q, max_k)
    else:
        args = (q, k, v, cu_q, cu_k, max_q, max_k)
    good = list(range(batch))
    if bad is not None:
        args, kwargs, good = bad(args, kwargs, cu_q, cu_k, tq, tk)
        if good is None:
            return
    with _modes(p), torch.set_grad_enabled(grad):
        result = getattr(flashattn2, API[fn])(*args, dropout_p=p["dropout"], **kwargs)
    out, lse, s_dmask = result if p["lse"] else (result, None, None)
    assert out.shape == (tq, h, dv) and out.dtype == dtype, (out.shape, out.dtype)
    dout = _rand(gen, out.shape, device, dtype)
    dlse = _rand(gen, lse.shape, device) if p["dlse"] else None
    ours = {"out": out} | ({"lse": lse} if lse is not None else {})
    if grad:
        ours.update(_gradients(fn, (out, lse), (dout, dlse), (*leaves, sink), p["repeat"], 1))
    qr, kr, vr = (_leaf(t, grad) for t in (q, k, v))
    sr = _leaf(sink, grad) if sink is not None else None
    ref, low = {}, {}
    starts_q, starts_k = cu_of(lq, "cpu").tolist(), cu_of(lk, "cpu").tolist()
    for upcast, into in ((True, ref), (False, low)):
        outs, lses = [], []
        for b in range(batch):
            rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            keep = s_dmask[b : b + 1, :, : lq[b], : lk[b]] >= 0 if p["dropout"] else None
            slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
            opts = _score_kwargs(p, slopes, sr, int(max_k)) | dict(dropout_mask=keep, dropout_p=p["dropout"])
            o, s = attention_ref(qr[None, rq], kr[None, rk], vr[None, rk], upcast=upcast, **opts)
            outs.append(o[0])
            lses.append(s[0])
        compute = outs[0].dtype if outs else dtype
        outs.append(torch.zeros(p["tail_q"], h, dv, dtype=compute, device=device))
        lses.append(
            torch.full((h, p["tail_q"]), math.inf, dtype=lses[0].dtype if lses else torch.float32, device=device)
        )
        into["out"], into["lse"] = torch.cat(outs), torch.cat(lses, 1)
        if grad:
            outputs, grad_outputs = [into["out"]], [dout.to(into["out"].dtype)]
            if dlse is not None:
                outputs.append(into["lse"].masked_fill(~torch.isfinite(into["lse"]), 0))
                grad_outputs.append(dlse.to(into["lse"].dtype))
            into.update(
                zip(("dq", "dk", "dv"), torch.autograd.grad(outputs, (qr, kr, vr), grad_outputs, allow_unused=True))
            )
            for key in ("dq", "dk", "dv"):
                if into[key] is None:
                    into[key] = torch.zeros_like((qr, kr, vr)[("dq", "dk", "dv").index(key)])
    if bad is not None:  # the good sequences' rows only
        rows = torch.cat(
            [torch.arange(starts_q[b], starts_q[b + 1]) for b in good] + [torch.zeros(0, dtype=torch.long)]
        )
        rows = rows.to(device)
        for into in (ours, ref, low):
            into["out"] = into["out"][rows]
            if "lse" in into:
                into["lse"] = into["lse"][:, rows]
        if "lse" not in ours:
            ref.pop("lse")
    allowance = None
    if grad:
        allowance = {"dq": q.new_zeros(q.shape, dtype=torch.float64), "dk": k.new_zeros(k.shape, dtype=torch.float64)}
        for b in range(batch):
            rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            if lq[b] and lk[b]:
                slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
                allowance["dq"][rq], allowance["dk"][rk] = (
                    a[0]
                    for a in _delta_allowance(
                        p, qr[None, rq], kr[None, rk], _score_kwargs(p, slopes, sr, int(max_k)), dout[None, rq], out[None, rq],
                        ref["out"][None, rq],
                    )
                )  # fmt: skip
    _compare(fn, ours, ref, low, allowance)
    if sink is not None and grad:
        _check_dsink(fn, ours["dsink"], sink, out, lse, ref["out"], ref["lse"], dout, dlse)


def _like(t, layout):
    """A copy of t laid out in memory as layout says (clone() would make a padded or permuted view contiguous)."""
    copy = _tensor(None, t.shape, t.dtype, t.device, layout)
    with torch.no_grad():
        copy.copy_(t)
    return copy


def _kvcache_inputs(p, gen, device, canaries):
    """(q, k_cache, v_cache, kwargs of flash_attn_with_kvcache but the caches) of a KV-cache case."""
    dtype = DTYPES[p["dtype"]]
    b, sq, h, hk, d, dv = (p[x] for x in ("batch", "seqlen_q", "nheads", "nheads_k", "d", "dv"))
    cap, page, new, lay = p["capacity"], p["page"], p["seqlen_new"], p["layouts"]
    seed = gen.initial_seed()
    q = _tensor(gen, (b, sq, h, d), dtype, device, lay["q"])
    kwargs = {}
    if page:
        table, num_blocks = _page_table(seed, [cap] * b, page, p["extra"], canaries)
        shape = (num_blocks, page, hk)
        kwargs["block_table"] = table.to(torch.int32).to(device)
    else:
        rows = b + p["extra"] + (2 if canaries else 0)
        shape = (rows, cap, hk)
        if p["batch_idx"]:
            first = 1 if canaries else 0
            order = torch.randperm(rows - 2 * first, generator=torch.Generator().manual_seed(seed))[:b] + first
            kwargs["cache_batch_idx"] = order.to(torch.int32).to(device)
    k_cache = _tensor(gen, (*shape, d), dtype, device, lay["k_cache"])
    latent = p.get("latent", False)
    v_cache = k_cache[..., :dv] if latent else _tensor(gen, (*shape, dv), dtype, device, lay["v_cache"])
    kind = p["seqlens_kind"]
    if kind == "tensor":
        kwargs["cache_seqlens"] = torch.tensor(p["cache_seqlens"], dtype=torch.int32).to(device)
    elif kind == "int":
        kwargs["cache_seqlens"] = p["cache_seqlens"]
    if p["leftpad"]:
        kwargs["cache_leftpad"] = torch.tensor(p["leftpads"], dtype=torch.int32).to(device)
    if new:
        kwargs["k"] = _tensor(gen, (b, new, hk, d), dtype, device, lay["k"])
        kwargs["v"] = kwargs["k"][..., :dv] if latent else _tensor(gen, (b, new, hk, dv), dtype, device, lay["v"])
    if p["rotary"]:
        angle = torch.rand(cap + sq + 1, p["rotary_dim"] // 2, generator=gen, device=device) * 6.28
        kwargs.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype))
        kwargs["rotary_interleaved"] = p["rotary"] == "gptj"
    alibi, sink = _alibi(p, gen, b, device), _sink(p, gen, device)
    kwargs.update(_score_kwargs(p, alibi, sink))
    return q, k_cache, v_cache, kwargs


def _our_kvcache(p, q, k_cache, v_cache, kwargs):
    """Our call on copies of the caches (laid out as the originals): (out, lse or None, k_cache, v_cache after)."""
    lay = p["layouts"]
    kc = _like(k_cache, lay["k_cache"])
    vc = kc[..., : v_cache.shape[-1]] if p.get("latent") else _like(v_cache, lay["v_cache"])
    with _modes(p):
        result = flashattn2.flash_attn_with_kvcache(
            q, kc, vc, **kwargs, num_splits=p["num_splits"], return_softmax_lse=p["lse"]
        )
    out, lse = result if p["lse"] else (result, None)
    return out, lse, kc, vc


def _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=True, rows=None):
    """kvcache_ref, of the sequences `rows` only (None: all)."""
    kw = {key: value for key, value in kwargs.items()}
    kw["window_size"] = tuple(kw["window_size"])
    if rows is not None:
        q = q[rows]
        for key in ("k", "v", "cache_batch_idx", "cache_leftpad", "block_table"):
            if kw.get(key) is not None:
                kw[key] = kw[key][rows]
        if isinstance(kw.get("cache_seqlens"), torch.Tensor):
            kw["cache_seqlens"] = kw["cache_seqlens"][rows]
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kw["alibi_slopes"] = kw["alibi_slopes"][rows]
    return kvcache_ref(q, k_cache, v_cache, upcast=upcast, **kw)


def _check_kvcache_out(name, out, lse, ref, low, alibi):
    """out by flash_attn's rule against the oracle (factor 3, 5 with ALiBi, as tests/test_kvcache.py), lse +inf
    exactly where the oracle's is and within 1e-3 elsewhere."""
    assert_close(f"{name} out", out, ref[0], low[0], 5.0 if alibi else 3.0)
    if lse is not None:
        finite = torch.isfinite(ref[1])
        assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == math.inf).all(), (
            f"{name} lse: rows without keys must have lse=+inf, only they"
        )
        torch.testing.assert_close(
            lse[finite], ref[1][finite].float(), rtol=1e-3, atol=1e-3, msg=lambda m: f"{name} lse: {m}"
        )


def _run_kvcache(p, gen, device):
    q, k_cache, v_cache, kwargs = _kvcache_inputs(p, gen, device, canaries=False)
    out, lse, k_after, v_after = _our_kvcache(p, q, k_cache, v_cache, kwargs)
    assert out.shape == (*q.shape[:3], v_cache.shape[-1]) and out.dtype == q.dtype, (out.shape, out.dtype)
    ref = _kvcache_ref(q, k_cache, v_cache, kwargs)
    low = _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=False)
    _check_kvcache_out("kvcache", out, lse, ref, low, p["alibi"])
    if p["rotary"]:  # rotated in fp32 by both, rounded once: equal up to an ulp
        torch.testing.assert_close(
            k_after, ref[2], rtol=1e-2, atol=1e-2, msg=lambda m: f"kvcache k_cache after the append: {m}"
        )
    else:
        assert torch.equal(k_after, ref[2]), "kvcache: k_cache after the append differs from the reference's"
    if not p.get("latent"):
        assert torch.equal(v_after, ref[3]), "kvcache: v_cache after the append differs from the reference's"


def _raises(p, call, match):
    """With the value checks on (or an int cache_seqlens, checked always): the call raises ArgumentError naming the
    argument."""
    try:
        with _modes(p):
            call()
    except flashattn2.ArgumentError as e:
        assert re.search(match, str(e)), f"the error does not name {match!r}: {e}"
    else:
        raise AssertionError(f"a bad {match} did not raise (value checks {'on' if p.get('checks') else 'off'})")


BAD_KVCACHE_MATCH = {
    "cache_seqlens": "cache_seqlens",
    "cache_seqlens_int": "cache_seqlens",
    "cache_leftpad": "cache_leftpad",
    "cache_batch_idx": "cache_batch_idx",
    "block_table": "block_table",
}


def _run_bad_kvcache(p, gen, device):
    canaries = "clamped-writes" in KNOWN_DEFECTS
    q, k_cache, v_cache, kwargs = _kvcache_inputs(p, gen, device, canaries)
    which, b, value = p["bad"]
    if which == "cache_seqlens_int":
        kwargs["cache_seqlens"] = value
    elif which == "block_table":
        kwargs["block_table"] = kwargs["block_table"].clone()
        kwargs["block_table"][b, value[0]] = value[1]
    else:
        name = {"cache_seqlens": "cache_seqlens", "cache_leftpad": "cache_leftpad"}.get(which, which)
        kwargs[name] = kwargs[name].clone()
        kwargs[name][b] = value
    # a paged call past its pages: flash_attn's own check (one read of max(cache_seqlens)) raises, value checks or not
    past_pages = p["page"] and which == "cache_seqlens" and value + p["seqlen_new"] > p["capacity"]
    if p["checks"] or which == "cache_seqlens_int" or past_pages:
        lay = p["layouts"]
        kc, vc = _like(k_cache, lay["k_cache"]), _like(v_cache, lay["v_cache"])
        call = lambda: flashattn2.flash_attn_with_kvcache(q, kc, vc, **kwargs, num_splits=p["num_splits"])  # noqa: E731
        _raises(p, call, "block_table" if past_pages and not p["checks"] else BAD_KVCACHE_MATCH[which])
        assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache), "a cache was written before the error"
        return
    out, lse, _, _ = _our_kvcache(p, q, k_cache, v_cache, kwargs)  # no error, whatever the bad sequence gets
    good = [i for i in range(q.shape[0]) if i != b]
    if not good:
        return
    ref = _kvcache_ref(q, k_cache, v_cache, kwargs, rows=good)
    low = _kvcache_ref(q, k_cache, v_cache, kwargs, upcast=False, rows=good)
    _check_kvcache_out(f"the good sequences {good} beside a bad {which}", out[good], None if lse is None else lse[good],
                       ref, low, p["alibi"])  # fmt: skip


BAD_VARLEN_MATCH = {
    "start": "start at 0 and be non-decreasing",
    "decrease": "start at 0 and be non-decreasing",
    "past": "past the",
    "longest": "exceeds max_seqlen",
    "block_table": "block_table entries",
}


def _run_bad_varlen(p, gen, device):
    fn = "varlen_paged" if p["paged"] else "varlen"
    lq, lk = p["lengths_q"], p["lengths_k"]
    n = len(lq)

    def corrupt(args, kwargs, cu_q, cu_k, tq, tk):
        args = list(args)
        which = p["bad"][0]
        if which == "block_table":
            _, b, (j, value) = p["bad"]
            table = kwargs["block_table"].clone()
            table[b, j] = args[1].shape[0] if value is None else value
            kwargs = kwargs | {"block_table": table}
            bad, kind, ranges = {b}, "block_table", []
        else:
            _, kind, i, amount = p["bad"]
            side = 0 if which == "cu_seqlens_q" else 1
            cu = (cu_q, cu_k)[side].clone()
            rows = tq if side == 0 else tk
            if p["paged"] and side == 1:  # a paged call's keys: each sequence's block-table capacity
                rows = n * kwargs["block_table"].shape[1] * args[1].shape[1]
            if kind == "start":
                cu[0] = amount
            elif kind == "decrease":
                cu[i] = cu[i - 1] - amount
            elif kind == "past":
                cu[-1] = rows + amount
            else:
                args[5 + side] = max((lq, lk)[side]) - 1
            args[3 + side] = cu
            bad = {x for x in (i - 1, i) if 0 <= x < n} if kind != "longest" else set()
            values = cu.clamp(0, rows).tolist()
            ranges = [(min(values[x], values[x + 1]), max(values[x], values[x + 1])) for x in bad] if side == 0 else []
            ranges += [(values[-1], tq)] if side == 0 else []
        if p["checks"]:
            call = lambda: flashattn2.flash_attn_varlen_func(*args, **kwargs)  # noqa: E731
            _raises(p, call, BAD_VARLEN_MATCH[kind])
            return args, kwargs, None
        starts = cu_of(lq, "cpu").tolist()
        overlaps = lambda x: any(s < starts[x + 1] and starts[x] < e for s, e in ranges)  # noqa: E731
        return args, kwargs, [x for x in range(n) if x not in bad and not overlaps(x)]

    _run_varlen(fn, p, gen, device, bad=corrupt)


RUN = {
    "func": _run_dense,
    "qkvpacked": _run_dense,
    "kvpacked": _run_dense,
    "varlen": _run_varlen,
    "varlen_qkvpacked": _run_varlen,
    "varlen_kvpacked": _run_varlen,
    "varlen_paged": _run_varlen,
    "kvcache": lambda fn, p, gen, device: _run_kvcache(p, gen, device),
    "bad_kvcache": lambda fn, p, gen, device: _run_bad_kvcache(p, gen, device),
    "bad_varlen": lambda fn, p, gen, device: _run_bad_varlen(p, gen, device),
}


def run(case: Case, device) -> None:
    """Run one case: its call(s) and the checks against the reference; AssertionError (or the call's own error) on a
    failure. Unwritten outputs read NaN (_runtime.POISON), as in the tests."""
    torch.manual_seed(case.seed)  # dropout's Philox seed
    gen = torch.Generator(device=device).manual_seed(case.seed)
    poison, _runtime.POISON = _runtime.POISON, True
    try:
        RUN[case.fn](case.fn, case.p, gen, device)
    finally:
        _runtime.POISON = poison


def fuzz(seed: int, seconds: float, sizes: Sizes, device, log=print, functions=None, first: int = 0):
    """Cases seed:first, seed:first+1, ... until `seconds` of wall time have passed, each run whatever the others did:
    (the number run, [(index, case, error)] of those that failed, each logged as it fails)."""
    failures, start, index = [], time.monotonic(), first
    while time.monotonic() - start < seconds:
        case = draw(seed, index, sizes, functions)
        try:
            run(case, device)
        except Exception as e:  # a failure of any kind is the case's: report it and go on
            failures.append((index, case, e))
            log(f"FAILED case {seed}:{index} ({type(e).__name__}: {e})\n  {case}")
        index += 1
    return index - first, failures
