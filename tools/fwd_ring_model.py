"""A model of the persistent Gluon forward's barrier protocol (kernels/fwd_hopper_persist.py,
attn_fwd_persist_kernel: one producer warp, CONSUMERS consumer warpgroups, the K/V ring of units and
the Q buffers), run under random interleavings with TMA loads landing at random times. It mirrors
the kernel's tile order, block counts, ring-unit indices and wait parities, and checks that no run
deadlocks, that every part of every tile is computed once (and, on a grid of one CTA, every query
row once: causal tiles are aligned to the last row, leaving empty parts before row 0), that every
step reads the K and V blocks meant for it and no stage is refilled while a consumer still reads it,
that every expect-tx is met by the bytes loaded, and that a Q buffer is
not reloaded before the O stored through it has left. A model, not the kernel: change it with the
kernel's protocol. No GPU needed:  python tools/fwd_ring_model.py [--seeds 20]
(mbarrier semantics: a phase completes when the expected arrivals and bytes are in; a wait on
parity p passes while the completed-phase count c has c % 2 != p, so a fresh barrier passes a wait
on parity 1.)
"""

import argparse
import random


def skip_from(n_blocks):
    """Where a consumer starts arriving on the ring units its part does not use (after its
    epilogue): the kernel's _skip_units(..., n_blocks + (n_blocks > 0), n_max + 1). (Tests break it
    on purpose.)"""
    return n_blocks + (n_blocks > 0)


def part(me):
    """The part (BLOCK_M-row slice) of each tile that consumer `me` computes: its own index, as in
    the kernel's _persist_consumer. (Tests break it on purpose.)"""
    return me


class Bar:
    def __init__(self, name, count):
        self.name, self.count, self.arrived, self.tx, self.c = name, count, 0, 0, 0

    def passes(self, parity):
        return self.c % 2 != parity

    def _maybe_complete(self):
        if self.arrived == self.count and self.tx == 0:
            self.c, self.arrived = self.c + 1, 0

    def arrive(self):
        self.arrived += 1
        assert self.arrived <= self.count, f"{self.name}: more arrivals than its count in one phase"
        self._maybe_complete()

    def expect(self, nbytes):  # mbarrier.expect: an arrival that also expects nbytes
        self.tx += nbytes
        self.arrive()

    def land(self, nbytes):  # a TMA load's bytes
        self.tx -= nbytes
        assert self.tx >= 0, f"{self.name}: more bytes than expected"
        self._maybe_complete()


def cdiv(a, b):
    return -(-a // b)


def tile_blocks(start_m, seqlen_q, seqlen_k, causal, block_m, block_n):  # _tile_blocks
    diag = seqlen_k - seqlen_q
    n_end = seqlen_k
    if causal:
        n_end = max(min(seqlen_k, start_m + block_m + diag), 1)
    return 0 if start_m >= seqlen_q or start_m < 0 else cdiv(n_end, block_n)


def num_my_tiles(num_tiles, pid, nprog, snake):  # PersistSchedule.my_tiles
    full = num_tiles // nprog
    idx = pid + (full % 2) * (nprog - 1 - 2 * pid) if snake else pid
    return full + int(idx < num_tiles - full * nprog)


def causal_shift(num_m, seqlen_q, cta_m, block_m):
    """PersistSchedule.tile_coords' causal tiles aligned to the last row: shifted up by the whole parts left over.
    (Tests break it on purpose.)"""
    return (num_m * cta_m - seqlen_q) // block_m * block_m


# PersistSchedule.tile_coords
def tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, causal, snake, cta_m, block_m):
    idx = pid + (it % 2) * (nprog - 1 - 2 * pid) if snake else pid
    t = it * nprog + idx
    if causal:
        pid_m, off_bh = num_m - 1 - t // (batch * nheads), t % (batch * nheads)
        shift = causal_shift(num_m, seqlen_q, cta_m, block_m)
    else:
        pid_m, off_bh, shift = t % num_m, t // num_m, 0
    return off_bh // nheads, off_bh % nheads, pid_m * cta_m - shift


def run(shape, causal, block_m, block_n, stages, qbuf, consumers, nprog, pid, seed):
    """One CTA (pid of nprog) of the persistent forward on shape (batch, nheads, seqlen_q, seqlen_k)."""
    batch, nheads, seqlen_q, seqlen_k = shape
    rnd = random.Random(seed)
    cta_rows = consumers * block_m
    num_m = cdiv(seqlen_q, cta_rows)
    snake = causal
    nq = qbuf * consumers
    q_ready = [Bar(f"q_ready{i}", 1) for i in range(nq)]
    q_empty = [Bar(f"q_empty{i}", 1) for i in range(nq)]
    ready = [Bar(f"ready{i}", 1) for i in range(stages)]
    empty = [Bar(f"empty{i}", consumers) for i in range(stages)]
    k_buf, v_buf, q_buf = [None] * stages, [None] * stages, [None] * nq
    in_flight = []  # TMA loads issued, not landed: (buffers, index, tag, barrier)
    block_bytes = 1
    parts_done = {}  # it -> (the CTA's it-th tile's first row, the first rows of the parts its consumers computed)
    rows_done = []  # (batch entry, head, row) of every query row a consumer computed
    n_my = num_my_tiles(num_m * batch * nheads, pid, nprog, snake)

    def n_max_of(cta_m):  # PersistSchedule.max_blocks
        return max(
            tile_blocks(cta_m + t * block_m, seqlen_q, seqlen_k, causal, block_m, block_n) for t in range(consumers)
        )

    def producer():  # _persist_producer
        def produce(u, j, n_max, b, h):  # _persist_produce: unit j of the tile = K_j (j < n), V_{j-1} (j > 0)
            st = u % stages
            yield lambda: empty[st].passes(((u // stages) & 1) ^ 1)
            both = 0 < j < n_max
            ready[st].expect((2 if both else 1) * block_bytes)
            if j < n_max:
                in_flight.append((k_buf, st, ("K", b, h, j), ready[st]))
            if j > 0:
                in_flight.append((v_buf, st, ("V", b, h, j - 1), ready[st]))

        g = 0
        for it in range(n_my):
            b, h, cta_m = tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, causal, snake, cta_rows, block_m)
            n_max = n_max_of(cta_m)
            yield from produce(g, 0, n_max, b, h)
            for t in range(consumers):
                qi = (it % qbuf) * consumers + t
                yield lambda qi=qi, it=it: q_empty[qi].passes(((it // qbuf) & 1) ^ 1)
                row = cta_m + t * block_m
                if 0 <= row < seqlen_q:
                    q_ready[qi].expect(block_bytes)
                    in_flight.append((q_buf, qi, ("Q", b, h, row), q_ready[qi]))
                else:
                    q_ready[qi].arrive()
            for j in range(1, n_max + 1):
                yield from produce(g + j, j, n_max, b, h)
            g += n_max + 1

    def consumer(me):  # _persist_consumer, _attn_tile, _attn_step, _PersistLoads, _skip_units
        pending = []  # the O store left in flight: (Q buffer, what it wrote)

        def store_wait():
            for qi, tag in pending:
                assert q_buf[qi] == tag, f"Q buffer {qi} reloaded ({q_buf[qi]}) before the O store {tag} left"
            pending.clear()

        def q_release(qi, pred):  # _q_release
            store_wait()
            if pred:
                q_empty[qi].arrive()

        def use(u, k_tag, v_tag, after_issue=None):  # wait for unit u, read it across scheduling points, release it
            st = u % stages
            yield lambda: ready[st].passes((u // stages) & 1)
            for at_issue in (True, False):  # at the wgmmas' issue, then at their wait: the stage must not change
                assert k_tag is None or k_buf[st] == k_tag, f"stage {st}: read {k_buf[st]} for {k_tag}"
                assert v_tag is None or v_buf[st] == v_tag, f"stage {st}: read {v_buf[st]} for {v_tag}"
                if at_issue and after_issue is not None:
                    after_issue()
                yield lambda: True
            empty[st].arrive()

        g = 0
        for it in range(n_my):
            b, h, cta_m = tile_coords(it, pid, nprog, batch, nheads, num_m, seqlen_q, causal, snake, cta_rows, block_m)
            start_m = cta_m + part(me) * block_m
            parts_done.setdefault(it, (cta_m, []))[1].append(start_m)
            n_blocks = tile_blocks(start_m, seqlen_q, seqlen_k, causal, block_m, block_n)
            n_max = n_max_of(cta_m)
            qi = (it % qbuf) * consumers + me
            prev_qi = ((it + 1) % qbuf) * consumers + me
            yield lambda qi=qi, it=it: q_ready[qi].passes((it // qbuf) & 1)
            if n_blocks > 0:
                rows_done.extend((b, h, r) for r in range(start_m, min(start_m + block_m, seqlen_q)))
                assert q_buf[qi] == ("Q", b, h, start_m), f"Q buffer {qi}: {q_buf[qi]} for rows {start_m}"
                # block 0: S = Q K_0^T issued, then (QBUF 2) the previous tile's Q buffer handed back
                after = (lambda p=prev_qi, it=it: q_release(p, it > 0)) if qbuf == 2 else None
                yield from use(g, ("K", b, h, 0), None, after)
                for j in range(1, n_blocks):
                    yield from use(g + j, ("K", b, h, j), ("V", b, h, j - 1))
                yield from use(g + n_blocks, None, ("V", b, h, n_blocks - 1))
                q_buf[qi] = ("O", b, h, start_m)  # the epilogue's O goes out through the Q buffer
                pending.append((qi, q_buf[qi]))
                if qbuf == 1:
                    q_release(qi, True)
            elif qbuf == 2:
                q_release(prev_qi, it > 0)
            else:
                q_empty[qi].arrive()
            for j in range(skip_from(n_blocks), n_max + 1):
                u = g + j
                yield lambda u=u: ready[u % stages].passes((u // stages) & 1)
                empty[u % stages].arrive()
            g += n_max + 1
        store_wait()

    procs = [producer()] + [consumer(me) for me in range(consumers)]
    waits = [None] * len(procs)
    done = object()

    def advance(i):
        try:
            waits[i] = next(procs[i])
        except StopIteration:
            waits[i] = done

    for i in range(len(procs)):
        advance(i)
    while True:
        runnable = [i for i, w in enumerate(waits) if w is not done and w()]
        choices = runnable + (["tma"] if in_flight else [])
        if not choices:
            assert all(w is done for w in waits), f"deadlock: {shape} causal={causal} seed={seed}"
            for it, (cta_m, starts) in parts_done.items():  # every part of every tile computed, once
                assert sorted(starts) == [cta_m + t * block_m for t in range(consumers)], (it, starts)
            if nprog == 1:  # one CTA runs every tile: each query row of each head computed once
                want = [(b, h, r) for b in range(batch) for h in range(nheads) for r in range(seqlen_q)]
                assert sorted(rows_done) == want, f"rows computed: {shape} causal={causal}"
            return
        pick = rnd.choice(choices)
        if pick == "tma":
            bufs, index, tag, bar = in_flight.pop(rnd.randrange(len(in_flight)))
            bufs[index] = tag
            bar.land(block_bytes)
        else:
            advance(pick)


# shapes (batch, nheads, seqlen_q, seqlen_k): ragged last tiles, parts past seqlen_q (causal: before row 0),
# seqlen_q > seqlen_k
# (causal rows that see no key), one key block, one key, one query row
SHAPES = [
    (1, 2, 300, 461),
    (1, 2, 461, 300),
    (1, 3, 64, 1000),
    (1, 1, 700, 700),
    (2, 2, 200, 40),
    (1, 2, 130, 1),
    (1, 1, 1, 300),
]


def configs() -> dict:
    """name -> (BLOCK_M, BLOCK_N, STAGES, QBUF, CONSUMERS) for every persistent-forward tile the
    table holds, each with QBUF 1 and 2 (whatever the tile says: the kernel takes both)."""
    from flashattn2.ops import planning

    found = {}
    for row in planning.rows():
        if row.kernel == "fwd_hopper_persist":
            cfg, bucket = row.tile, row.head_dim
            consumers = cfg.num_warps // 4  # num_warps counts the consumer warps, 4 per consumer warpgroup
            for qbuf in (1, 2):
                name = f"d{bucket} {cfg.block_m}(x{consumers})x{cfg.block_n} s{cfg.num_stages} qbuf{qbuf}"
                found[name] = (cfg.block_m, cfg.block_n, cfg.num_stages, qbuf, consumers)
    return found


def check(seeds: int) -> dict:
    """{configuration: interleavings run}; raises AssertionError on the first violation."""
    counts = {}
    for name, (block_m, block_n, stages, qbuf, consumers) in configs().items():
        counts[name] = 0
        for shape in SHAPES:
            tiles = cdiv(shape[2], consumers * block_m) * shape[0] * shape[1]
            for causal in (False, True):
                for nprog in sorted({1, min(3, tiles)}):
                    for pid in sorted({0, nprog - 1}):
                        for seed in range(seeds):
                            run(shape, causal, block_m, block_n, stages, qbuf, consumers, nprog, pid, seed)
                            counts[name] += 1
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    for name, runs in check(args.seeds).items():
        print(f"{name}: {runs} interleavings, no deadlock, every read its own block")


if __name__ == "__main__":
    main()
