"""A model of the Gluon backward's barrier protocol (kernels/bwd_hopper.py: producer, MMA partition
(bwd_hopper_mma.py), dQ writer), run under random interleavings with TMA loads landing at random times. It mirrors
the kernel's ring indices and wait parities for the shipped configurations and the split-ring variant
(SPLIT_RING, DO_STAGES, DQ_SPLIT) and checks that no run deadlocks, that every step reads the Q, dO
and dQ tiles meant for it, that no buffer is refilled while a reader still uses it, and that the
writer reduces every dQ tile once. A model, not the kernel: change it with the kernel's protocol.
No GPU needed:  python tools/bwd_ring_model.py [--seeds 400]
(mbarrier semantics: a wait on parity p passes while the barrier's completed-phase count c has
c % 2 != p, so a fresh barrier passes a wait on parity 1.)
"""

import argparse
import random


class Bar:
    def __init__(self, name):
        self.name, self.c = name, 0

    def passes(self, parity):
        return self.c % 2 != parity


def run(total, STAGES, SPLIT_RING, DO_STAGES, DQ_SPLIT, DQ_STAGES, seed):
    rnd = random.Random(seed)
    do_stages = DO_STAGES if SPLIT_RING else STAGES
    q_ready = [Bar(f"q_ready{i}") for i in range(STAGES)]
    q_empty = [Bar(f"q_empty{i}") for i in range(STAGES)]
    do_ready = [Bar(f"do_ready{i}") for i in range(do_stages)]
    do_empty = [Bar(f"do_empty{i}") for i in range(do_stages)] if SPLIT_RING else q_empty
    dq_full = [Bar(f"dq_full{i}") for i in range(DQ_STAGES)]
    dq_empty = [Bar(f"dq_empty{i}") for i in range(DQ_STAGES)]
    q_buf, do_buf, dq_buf = [None] * STAGES, [None] * do_stages, [None] * DQ_STAGES
    q_user, do_user, dq_user = [None] * STAGES, [None] * do_stages, [None] * DQ_STAGES
    in_flight = []  # TMA loads issued, not landed: (buffers, index, tag, ready barrier)
    reduced = []

    def producer():  # _ws_producer
        for t in range(total):
            stage = t % STAGES
            yield ("wait", q_empty[stage], ((t // STAGES) & 1) ^ 1)
            assert q_user[stage] is None, f"Q stage {stage} refilled while step {q_user[stage]} reads it"
            in_flight.append((q_buf, stage, t, q_ready[stage]))
            if SPLIT_RING:
                stage = t % DO_STAGES
                yield ("wait", do_empty[stage], ((t // DO_STAGES) & 1) ^ 1)
            assert do_user[stage] is None, f"dO stage {stage} refilled while step {do_user[stage]} reads it"
            in_flight.append((do_buf, stage, t, do_ready[stage]))
            yield ("step",)

    def stage_dq(u, tag):  # _stage_dq
        db = u % DQ_STAGES
        yield ("wait", dq_empty[db], ((u // DQ_STAGES) & 1) ^ 1)
        assert dq_user[db] is None, f"dQ tile {db} rewritten while the writer reads {dq_user[db]}"
        dq_buf[db] = tag
        dq_full[db].c += 1

    def mma():  # _ws_step, position by position
        for it in range(total):
            stage, phase = it % STAGES, (it // STAGES) & 1
            do_stage, do_phase = (it % DO_STAGES, (it // DO_STAGES) & 1) if SPLIT_RING else (stage, phase)
            yield ("wait", q_ready[stage], phase)
            assert q_buf[stage] == it, f"step {it} read the Q of step {q_buf[stage]}"
            q_user[stage] = it
            yield ("wait", do_ready[do_stage], do_phase)
            assert do_buf[do_stage] == it, f"step {it} read the dO of step {do_buf[do_stage]}"
            do_user[do_stage] = it
            if DQ_SPLIT == 2 and it > 0:  # S and dP issued: the previous position's second half staged
                yield from stage_dq(it * 2 - 1, (it - 1, 1))
            yield ("step",)  # P, dV, dS, dQ_i (its first half), dK issued; dV and dQ_i waited
            assert (q_buf[stage], do_buf[do_stage]) == (it, it), f"step {it}: an input changed under it"
            if SPLIT_RING:  # dO's last reader (dV) is done
                do_user[do_stage] = None
                do_empty[do_stage].c += 1
            yield from stage_dq(it * DQ_SPLIT, (it, 0))
            if DQ_SPLIT == 2:
                yield ("step",)  # the second half issued after dK; dK waited
            assert q_buf[stage] == it, f"step {it}: Q changed before dK was done"
            q_user[stage] = None
            if not SPLIT_RING:
                do_user[do_stage] = None
            q_empty[stage].c += 1
        if DQ_SPLIT == 2 and total > 0:  # after the loop: the last position's second half
            yield from stage_dq(total * 2 - 1, (total - 1, 1))

    def writer():  # _ws_dq_writer
        for t in range(total):
            for half in range(DQ_SPLIT):
                u = t * DQ_SPLIT + half
                db = u % DQ_STAGES
                yield ("wait", dq_full[db], (u // DQ_STAGES) & 1)
                assert dq_buf[db] == (t, half), f"the writer, at {(t, half)}, read {dq_buf[db]}"
                dq_user[db] = (t, half)
                yield ("step",)  # the reduce reads the tile; store_wait
                reduced.append(dq_buf[db])
                dq_user[db] = None
                dq_empty[db].c += 1

    parts = {"producer": producer(), "mma": mma(), "writer": writer()}
    waiting = dict.fromkeys(parts)
    done = set()
    while len(done) < len(parts) or in_flight:
        ready = [n for n in parts if n not in done and (waiting[n] is None or waiting[n][0].passes(waiting[n][1]))]
        choices = ready + (["tma"] if in_flight else [])
        if not choices:
            stuck = [(n, w[0].name, w[1], w[0].c) for n, w in waiting.items() if w]
            raise AssertionError(f"deadlock (part, barrier, parity, completions): {stuck}")
        pick = rnd.choice(choices)
        if pick == "tma":
            bufs, index, tag, bar = in_flight.pop(rnd.randrange(len(in_flight)))
            bufs[index] = tag
            bar.c += 1
            continue
        waiting[pick] = None
        try:
            op = next(parts[pick])
        except StopIteration:
            done.add(pick)
            continue
        if op[0] == "wait":
            waiting[pick] = op[1:]
    assert sorted(reduced) == [(t, h) for t in range(total) for h in range(DQ_SPLIT)], reduced


def configs() -> dict:
    """name -> (STAGES, SPLIT_RING, DO_STAGES, DQ_SPLIT, DQ_STAGES) for every Gluon backward
    configuration the table holds (its rows' ring constexprs; DO_STAGES None: dO shares Q's ring, as deep)."""
    from flashattn2.ops import planning

    found = {}
    for row in planning.rows():
        if row.kernel == "bwd_hopper":
            r, stages = dict(row.constexprs), row.tile.num_stages
            split = bool(r["SPLIT_RING"])
            do_stages = stages if r["DO_STAGES"] is None else r["DO_STAGES"]
            found[f"d{row.head_dim}" + " split" * split] = (stages, split, do_stages, r["DQ_SPLIT"], r["DQ_STAGES"])
    return found


def check(seeds: int) -> dict:
    """{configuration: interleavings run}; raises AssertionError on the first violation."""
    counts = {}
    for name, cfg in configs().items():
        counts[name] = 0
        for seed in range(seeds):
            for total in (0, 1, 2, 3, 5, 8):
                run(total, *cfg, seed)
                counts[name] += 1
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=400)
    args = ap.parse_args()
    for name, runs in check(args.seeds).items():
        print(f"{name}: {runs} interleavings, no deadlock, every read its own tile")


if __name__ == "__main__":
    main()
