# One rank of one case: python worker.py CASE CAUSAL RANK WORLD PORT OUTDIR
# TRITON_INTERPRET=1 must be in the environment (run.py sets it) before torch/triton are imported.
import json
import os
import sys
import time
import traceback
from datetime import timedelta

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import alias  # noqa: E402,F401  flashattn2.install_as_flash_attn(), the README's block

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import flashattn2  # noqa: E402

CASE, CAUSAL, RANK, WS, PORT, OUTDIR = (
    sys.argv[1],
    sys.argv[2] == "1",
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
    sys.argv[6],
)
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = PORT
dist.init_process_group("gloo", rank=RANK, world_size=WS, timeout=timedelta(seconds=90))

B, S, H, D = 1, 32, 2, 16
CU = [0, 12, 32]  # varlen: two sequences, each divisible by 2*WS (zigzag)
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("RFA_DTYPE", "fp32")]


# ---- layouts: global token indices held by this rank (same on every rank's copy of the full tensor)
def idx_basic(r, n=S):
    L = n // WS
    return torch.arange(r * L, (r + 1) * L)


def idx_zigzag(r, n=S, off=0):
    c = n // (2 * WS)
    return torch.cat(
        [torch.arange(off + r * c, off + (r + 1) * c), torch.arange(off + (2 * WS - 1 - r) * c, off + (2 * WS - r) * c)]
    )


def idx_stripe(r, n=S):
    return torch.arange(r, n, WS)


def idx_varlen_basic(r):
    return torch.cat([torch.arange(s, e)[(e - s) // WS * r : (e - s) // WS * (r + 1)] for s, e in zip(CU[:-1], CU[1:])])


def idx_varlen_zigzag(r):
    return torch.cat([idx_zigzag(r, e - s, s) for s, e in zip(CU[:-1], CU[1:])])


def idx_llama3(r):
    return idx_basic(r, CU[-1])


def main():
    torch.manual_seed(0)  # same full tensors on every rank
    varlen = "varlen" in CASE
    shape = (CU[-1], H, D) if varlen else (B, S, H, D)
    sdim = 0 if varlen else 1  # sequence dim of q/k/v/out
    q, k, v, dout = (torch.randn(shape).to(DT) for _ in range(4))
    cu = torch.tensor(CU, dtype=torch.int32)
    maxs = max(e - s for s, e in zip(CU[:-1], CU[1:]))

    # reference: single process flashattn2 on the full tensors
    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    if varlen:
        ro, rlse, _ = flashattn2.flash_attn_varlen_func(
            rq, rk, rv, cu, cu, maxs, maxs, causal=CAUSAL, return_attn_probs=True
        )
    else:
        ro, rlse, _ = flashattn2.flash_attn_func(rq, rk, rv, causal=CAUSAL, return_attn_probs=True)
    ro.backward(dout)
    ref = {"out": ro.detach(), "lse": rlse.detach(), "dq": rq.grad, "dk": rk.grad, "dv": rv.grad}
    # scale: how far single-process flashattn2 in DT is from flashattn2 in fp32 on the same (upcast) inputs
    ref_err = {}
    if DT != torch.float32:
        fq, fk, fv = (t.float().requires_grad_() for t in (q, k, v))
        if varlen:
            fo = flashattn2.flash_attn_varlen_func(fq, fk, fv, cu, cu, maxs, maxs, causal=CAUSAL)
        else:
            fo = flashattn2.flash_attn_func(fq, fk, fv, causal=CAUSAL)
        fo.backward(dout.float())
        for n, a, b in (("out", ro, fo), ("dq", rq.grad, fq.grad), ("dk", rk.grad, fk.grad), ("dv", rv.grad, fv.grad)):
            ref_err[n] = (a.float() - b.float()).abs().max().item()
    ref = {n: t.float() for n, t in ref.items()}
    ref32 = {}
    if DT != torch.float32:
        ref32 = {"out": fo.detach(), "dq": fq.grad, "dk": fk.grad, "dv": fv.grad}

    fn, idxf, lse_sdim = build(CASE, cu, maxs)
    idx = idxf(RANK)
    take = lambda t, d=sdim: t.index_select(d, idx)  # noqa: E731
    lq, lk, lv = (take(t).clone().requires_grad_() for t in (q, k, v))
    ldout = take(dout).clone()

    import ring_flash_attn

    res = {"rfa_file": ring_flash_attn.__file__, "case": CASE, "causal": CAUSAL, "rank": RANK, "dtype": str(DT)}
    t0 = time.time()
    stage = "forward"
    try:
        o = fn(lq, lk, lv)
        lo, llse = (o[0], o[1]) if isinstance(o, tuple) else (o, None)
        stage = "backward"
        lo.backward(ldout)
        stage = "compare"
        got = {"out": lo.detach(), "dq": lq.grad, "dk": lk.grad, "dv": lv.grad}
        if llse is not None:
            got["lse"] = llse.detach()
        # gather every rank's shard and put it back at its global positions, compare on the full sequence
        all_idx = [torch.empty_like(idx) for _ in range(WS)]
        dist.all_gather(all_idx, idx)
        gidx = torch.cat(all_idx)
        errs, dtypes, errs32 = {}, {}, {}
        for name, t in got.items():
            d = lse_sdim if name == "lse" else sdim
            dtypes[name] = str(t.dtype)
            t = t.float().contiguous()
            parts = [torch.empty_like(t) for _ in range(WS)]
            dist.all_gather(parts, t)
            full = torch.zeros_like(ref[name])
            full.index_copy_(d, gidx, torch.cat(parts, d))
            errs[name] = (full - ref[name]).abs().max().item()
            if name in ref32:
                errs32[name] = (full - ref32[name]).abs().max().item()
        res.update(status="ok", errors=errs, grad_dtypes=dtypes, ref_dt_vs_fp32=ref_err, dist_vs_fp32=errs32)
    except Exception as e:  # record the exact exception and the frames inside the libraries
        tb = traceback.extract_tb(e.__traceback__)
        frames = [
            f"{f.filename.split('site-packages/')[-1].split('/work/main/src/')[-1]}:{f.lineno} in {f.name}: {f.line}"
            for f in tb
            if "site-packages" in f.filename or "flashattn2" in f.filename
        ]
        res.update(status=f"FAIL in {stage}", exc=f"{type(e).__name__}: {e}", frames=frames[-8:])
    res["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(OUTDIR, f"{CASE}.{int(CAUSAL)}.r{RANK}.json"), "w") as f:
        json.dump(res, f, indent=1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def stack_kv(k, v, dim):
    return torch.stack([k, v], dim=dim)


def build(case, cu, maxs):
    """Returns (fn(local q, k, v) -> out or (out, lse, ...), layout index function, lse seq dim)."""
    lib, name = case.split(":", 1)
    C = CAUSAL
    if lib == "rfa":
        import ring_flash_attn as R

        base = name.replace("_kvpacked", "").replace("_qkvpacked", "").replace("_func", "")
        kw = dict(causal=C, return_attn_probs=True)
        if base in ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn"):
            idxf = {
                "ring_flash_attn": idx_basic,
                "zigzag_ring_flash_attn": idx_zigzag,
                "stripe_flash_attn": idx_stripe,
            }[base]
            f = getattr(R, name)
            if "qkvpacked" in name:
                return (lambda q, k, v: f(torch.stack([q, k, v], 2), **kw)), idxf, 2
            if "kvpacked" in name:
                return (lambda q, k, v: f(q, stack_kv(k, v, 2), **kw)), idxf, 2
            return (lambda q, k, v: f(q, k, v, **kw)), idxf, 2
        if base in ("ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen"):
            idxf = idx_varlen_basic if base.startswith("ring") else idx_varlen_zigzag
            lcu, lmax = cu // WS, maxs // WS
            f = getattr(R, name)
            if "qkvpacked" in name:
                return (lambda q, k, v: f(torch.stack([q, k, v], 1), lcu, lmax, **kw)), idxf, 1
            if "kvpacked" in name:
                return (lambda q, k, v: f(q, stack_kv(k, v, 1), lcu, lmax, **kw)), idxf, 1
            return (lambda q, k, v: f(q, k, v, lcu, lmax, **kw)), idxf, 1
        if base.startswith("llama3_flash_attn_varlen"):
            stride = 2 if base.endswith("_hs2") else 1
            name = name.replace("_hs2", "")
            cq, ck, mq, mk, ksl = R.llama3_flash_attn_prepare_cu_seqlens(cu, causal=C, rank=RANK, world_size=WS)
            f = getattr(R, name)
            a = (cq, ck, mq, mk)
            kw2 = dict(heads_k_stride=stride, local_k_slice=ksl, **kw)
            if "qkvpacked" in name:
                return (lambda q, k, v: f(torch.stack([q, k, v], 1), *a, **kw2)), idx_llama3, 1
            if "kvpacked" in name:
                return (lambda q, k, v: f(q, stack_kv(k, v, 1), *a, **kw2)), idx_llama3, 1
            return (lambda q, k, v: f(q, k, v, *a, **kw2)), idx_llama3, 1
    if lib == "yc":
        import yunchang as Y

        if name == "UlyssesAttention":
            m = Y.UlyssesAttention(sequence_process_group=dist.group.WORLD)
            return (lambda q, k, v: m(q, k, v, causal=C)), idx_basic, None
        if name.startswith(("LongContextAttention", "AsyncLongContextAttention")):
            cls, impl, cfg = name.split(".")  # e.g. LongContextAttention.zigzag.u1r2
            ud, rd = int(cfg[1]), int(cfg[3])
            Y.set_seq_parallel_pg(ud, rd, RANK, WS)
            ex = Y.EXTRACT_FUNC_DICT[impl]
            # the layout yunchang's own tests use (EXTRACT_FUNC_DICT), read off as global indices
            pos = torch.arange(S, dtype=torch.float32).view(1, S, 1)
            idxf = lambda r: ex(pos, r, world_size=WS, rd=rd, ud=ud).view(-1).long()  # noqa: E731
            if cls == "LongContextAttentionQKVPacked":
                m = Y.LongContextAttentionQKVPacked(ring_impl_type=impl)
                return (lambda q, k, v: m(torch.stack([q, k, v], 2), causal=C)), idxf, None
            if cls == "LongContextAttentionPackQKV":
                m = Y.LongContextAttention(ring_impl_type=impl, use_pack_qkv=True)
                return (lambda q, k, v: m(q, k, v, causal=C)), idxf, None
            m = getattr(Y, cls)(ring_impl_type=impl)
            return (lambda q, k, v: m(q, k, v, causal=C)), idxf, None
        if name.startswith("ring."):  # yunchang.ring functions called directly on the world group
            fname = name.split(".")[1]
            f = getattr(Y, fname)
            kw = dict(causal=C, return_attn_probs=True)
            if "varlen" in fname:
                idxf = idx_varlen_zigzag if fname.startswith("zigzag") else idx_varlen_basic
                return (lambda q, k, v: f(q, k, v, cu // WS, maxs // WS, **kw)), idxf, 1
            idxf = {"ring": idx_basic, "zigzag": idx_zigzag, "stripe": idx_stripe}[fname.split("_")[0]]
            return (lambda q, k, v: f(q, k, v, **kw)), idxf, 2
    raise ValueError(case)


if __name__ == "__main__":
    main()
