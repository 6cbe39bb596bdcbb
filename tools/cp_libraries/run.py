"""ring-flash-attention and yunchang (USP) on flashattn2: each public function on 2 gloo ranks (the CPU
interpreter), through flashattn2.install_as_flash_attn(), against single-process flashattn2 on the gathered sequence.

    python -m venv /tmp/cpl && . /tmp/cpl/bin/activate
    pip install torch==2.13.0 triton==3.6.0 "numpy<2.4" "transformers<5" && pip install -e . --no-deps
    pip install --no-deps ring-flash-attn==0.1.8 yunchang==0.6.4
    RFA_DTYPE=bf16 python tools/cp_libraries/run.py all      # rfa | yc | all [name filter]

(ring_flash_attn imports transformers' flash-attention helpers, which 5.x moved: hence transformers < 5.) One line per
(function, causal): ok with the max errors, or where it failed. Results: bench/results/cp-libraries-cpu.md.
"""

import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = os.environ.get("CP_PYTHON", sys.executable)  # a Python with the libraries installed (module docstring)

RFA = []
for base in [
    "ring_flash_attn",
    "zigzag_ring_flash_attn",
    "stripe_flash_attn",
    "ring_flash_attn_varlen",
    "zigzag_ring_flash_attn_varlen",
    "llama3_flash_attn_varlen",
]:
    for form in ["", "_kvpacked", "_qkvpacked"]:
        RFA.append(f"rfa:{base}{form}_func")
RFA.append("rfa:llama3_flash_attn_varlen_func_hs2")  # heads_k_stride=2 (= nheads_k)

YC = ["yc:UlyssesAttention"]
for cls in ["LongContextAttention", "LongContextAttentionQKVPacked"]:
    for impl in ["basic", "zigzag", "strip"]:
        for cfg in ["u2r1", "u1r2"]:
            YC.append(f"yc:{cls}.{impl}.{cfg}")
YC += ["yc:LongContextAttentionPackQKV.basic.u2r1", "yc:AsyncLongContextAttention.basic.u1r2"]
YC += [
    f"yc:ring.{f}"
    for f in [
        "ring_flash_attn_func",
        "zigzag_ring_flash_attn_func",
        "stripe_flash_attn_func",
        "ring_flash_attn_varlen_func",
        "zigzag_ring_flash_attn_varlen_func",
    ]
]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return str(p)


def main():
    group = sys.argv[1]
    filt = sys.argv[2] if len(sys.argv) > 2 else ""
    cases = {"rfa": RFA, "yc": YC, "all": RFA + YC}[group]
    cases = [c for c in cases if filt in c]
    outdir = os.path.join(os.environ.get("CP_OUT", "/tmp/cp_libraries"), os.environ.get("RFA_DTYPE", "fp32"), group)
    os.makedirs(outdir, exist_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    t_all = time.time()
    for case in cases:
        for causal in ("1", "0"):
            t0 = time.time()
            port = free_port()
            logs = [open(os.path.join(outdir, f"{case}.{causal}.r{r}.log"), "w") for r in range(2)]
            procs = [
                subprocess.Popen(
                    [PY, os.path.join(HERE, "worker.py"), case, causal, str(r), "2", port, outdir],
                    env=env,
                    stdout=logs[r],
                    stderr=subprocess.STDOUT,
                )
                for r in range(2)
            ]
            rcs = []
            for p in procs:
                try:
                    rcs.append(p.wait(timeout=300))
                except subprocess.TimeoutExpired:
                    p.kill()  # only the workers this driver started, by their own handle
                    rcs.append("timeout")
            res = []
            for r in range(2):
                fn = os.path.join(outdir, f"{case}.{causal}.r{r}.json")
                res.append(json.load(open(fn)) if os.path.exists(fn) else {"status": f"no result (rc {rcs[r]})"})
            r0 = res[0]
            line = f"{case:55s} causal={causal} {r0['status']:18s}"
            if r0.get("errors"):
                line += " " + " ".join(f"{k}={v:.2e}" for k, v in r0["errors"].items())
                if r0.get("ref_dt_vs_fp32"):
                    line += " | 1-proc vs fp32: " + " ".join(f"{k}={v:.1e}" for k, v in r0["ref_dt_vs_fp32"].items())
                    line += " | dist vs fp32: " + " ".join(f"{k}={v:.1e}" for k, v in r0["dist_vs_fp32"].items())
            if r0.get("exc"):
                line += f"\n    {r0['exc'][:400]}\n    " + "\n    ".join(r0.get("frames", [])[-4:])
            if res[1].get("status") != r0.get("status"):
                line += f"\n    rank1: {res[1].get('status')} {res[1].get('exc', '')[:300]}"
            print(line + f"  [{time.time() - t0:.1f}s]", flush=True)
    print(f"total wall {time.time() - t_all:.1f}s")


if __name__ == "__main__":
    main()
