"""The fuzzer's cases (tests/fuzz_cases.py runs them): a case is drawn from (seed, index) alone (`draw`), so any one
replays without the others, and is plain data (`Case`: the function, a data seed, the parameters). What is drawn is
listed in fuzz_cases.py's docstring; KNOWN_DEFECTS lists what the fuzzer does not draw until it is fixed.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from flashattn2.ops import planning
from flashattn2.ops.planning import decoding

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
                    sizes.add(planning.decode_tile(row, 16, d, d, elem_bytes, arch).block_n)
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
