"""Kernels under Nsight Compute, one call per case, and a summary of what ncu printed.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \\
        --section InstructionStats --section LaunchStats --section Occupancy --print-details all \\
        python tools/ncu_profile.py CASE [CASE ...] > ncu.txt
    python tools/ncu_profile.py --summarize ncu.txt

A case is provider:dtype:headdim:causal:seqlen[:bwd][:override=value ...] (16k tokens, hidden 2048,
as the kernel grid; headdim may be q/k's and v's, 192/128, with 2048 / v's heads): e.g. flashattn2:fp16:64:1:512,
sdpa_cudnn:fp16:256:0:4096:bwd, flashattn2:bf16:192/128:1:8192:bwd,
flashattn2:fp16:64:0:16384:fwd_hopper_persist=64x128w12s3. Each case runs three warm-up calls,
then one call between cudaProfilerStart and cudaProfilerStop (so ncu --profile-from-start off sees
that call's kernels only): the forward without autograd, or with `bwd` the backward alone
(autograd.grad of a kept graph). --summarize prints, per kernel, its duration, the pipes' activity
(tensor, MUFU, ALU, FMA), issue activity, instructions, registers and the five largest stall reasons.
"""

from __future__ import annotations

import re
import sys

_METRICS = [
    "Duration",
    "SM Frequency",
    "SM: Pipe Tensor Cycles Active",
    "SM: Inst Executed Pipe Xu",
    "SM: Pipe Alu Cycles Active",
    "SM: Pipe Fma Cycles Active",
    "SM: Issue Active",
    "Executed Instructions",
    "Registers Per Thread",
    "DRAM Throughput",
    "L2 Cache Throughput",
]


def _overrides(items):
    """planning.force's arguments from key=value items: a tile for a kernel, a name for arch / bwd_order, else a
    switch (0/false: off)."""
    from flashattn2.ops import planning

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        tile = planning.parse_tile(value)
        out[key] = tile if tile else value if key in ("arch", "bwd_order") else value.lower() not in ("0", "false")
    return out


def run(cases) -> None:
    import torch

    from flashattn2.bench.providers import providers
    from flashattn2.ops import planning

    table = providers()
    for case in cases:
        provider, dtype_name, d, causal, n, *rest = case.split(":")
        d, _, dv = d.partition("/")
        d, dv, causal, n = int(d), int(dv or d), causal == "1", int(n)
        bwd = "bwd" in rest
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        layout, fn = table[provider]
        b, h = 16384 // n, 2048 // dv
        shapes = [(b, n, h, x) if layout == "bshd" else (b, h, n, x) for x in (d, d, dv)]
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=bwd) for shape in shapes)
        with planning.force(**_overrides([r for r in rest if r != "bwd"])):
            if bwd:
                out = fn(q, k, v, causal)
                do = torch.randn_like(out)
                call = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            else:
                call = lambda: fn(q, k, v, causal)  # noqa: E731
            with torch.no_grad() if not bwd else torch.enable_grad():
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                call()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
        print("PROFILED", case, flush=True)


def summarize(path: str) -> None:
    text = open(path).read()
    for block in re.split(r"\n  (?=\S.*\(\d+, \d+, \d+\)x\()", text)[1:]:
        values = []
        for name in _METRICS:
            m = re.search(re.escape(name) + r"\s+(\S+)?\s+([\d,.]+)\n", block)
            values.append(f"{name.replace('SM: ', '')}={m.group(2) if m else '?'}")
        stalls = sorted(
            ((float(v), k) for k, v in re.findall(r"Stall (\w[\w ]*?)\s+inst\s+([\d.]+)", block)), reverse=True
        )[:5]
        print(block.split("(")[0].strip()[:70])
        print("    " + " | ".join(values))
        print("    stalls (cycles per issued instruction): " + ", ".join(f"{k} {v}" for v, k in stalls))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
    else:
        run(sys.argv[1:])
