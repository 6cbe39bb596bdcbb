"""Compile every kernel configuration the config table can select for sm_90 / sm_80, no GPU needed,
and check shared memory against the target's limit. Prints one JSON line per configuration.

Run in a process without TRITON_INTERPRET (the interpreter's kernels cannot be compiled):
    python tools/compile_check.py --arch sm90
"""
import argparse
import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET first")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashattn2.kernels import bwd, dmask, fill, fwd  # noqa: E402
from flashattn2.ops import config  # noqa: E402

SHARED_LIMIT = {"sm90": 232448, "sm80": 166912, "sm86": 101376}  # bytes per block, opt-in maximum
CAPABILITY = {"sm90": 90, "sm80": 80, "sm86": 86}
FP32_POINTERS = {"Lse", "Delta", "DLse", "Alibi"}
TYPE = {2: "fp16", 4: "fp32"}
KERNELS = {"fwd": fwd.attn_fwd_kernel, "bwd_dkdv": bwd.attn_bwd_dkdv_kernel, "bwd_dq": bwd.attn_bwd_dq_kernel}


def compile_kernel(fn, arch, elem_bytes, constexprs, cfg):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():  # tensors are the capitalised arguments
            if name.startswith("CuSeqlens"):
                sig[name] = "*i32"
            elif name == "Seed":
                sig[name] = "*i64"
            else:
                sig[name] = "*fp32" if name in FP32_POINTERS else "*" + TYPE[elem_bytes]
        elif name in ("sm_scale", "softcap", "value", "dropout_p"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return triton.compile(ASTSource(fn, sig, constexprs), target=target, options=options)


# the plain causal path, and every option at once (LOCAL excludes CAUSAL)
VARIANTS = {
    "causal": dict(CAUSAL=True, LOCAL=False, SOFTCAP=False, ALIBI=False, DROPOUT=False, IS_VARLEN=False),
    "varlen-local-softcap-alibi-dropout": dict(CAUSAL=False, LOCAL=True, SOFTCAP=True, ALIBI=True, DROPOUT=True,
                                               IS_VARLEN=True),
}


def cases(arch):
    for (entry_arch, bucket, elem_bytes, kernel), cfg in config.table_entries():
        if entry_arch != arch:
            continue
        fp32 = elem_bytes == 4
        for use_tma in ((True, False) if arch == "sm90" else (False,)):
            for variant, flags in VARIANTS.items():
                # bf16 needs the same shared memory as fp16
                constexprs = dict(**flags, USE_TMA=use_tma, UPCAST=fp32, DOT_PRECISION="ieee" if fp32 else "tf32",
                                  HEAD_DIM=bucket, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bucket)
                name = f"{arch}-d{bucket}-{TYPE[elem_bytes]}-{kernel}-{'tma' if use_tma else 'ptr'}-{variant}"
                yield name, KERNELS[kernel], elem_bytes, constexprs, cfg
    pre = dict(HAS_DLSE=True, IS_VARLEN=True, HEAD_DIM=256, BLOCK_M=32, BLOCK_D=256)
    yield f"{arch}-preprocess", bwd.attn_bwd_preprocess_kernel, 2, pre, config.TileConfig(32, 32, 4, 1)
    yield f"{arch}-fill-tail", fill.fill_tail_kernel, 2, dict(BLOCK_R=64, BLOCK_C=128), config.TileConfig(64, 64, 4, 1)
    dmask_flags = dict(CAUSAL=False, LOCAL=True, ALIBI=True, IS_VARLEN=True, UPCAST=False, DOT_PRECISION="tf32",
                       HEAD_DIM=256, BLOCK_M=64, BLOCK_N=64, BLOCK_D=256)
    yield f"{arch}-dropout-mask", dmask.attn_dropout_mask_kernel, 2, dmask_flags, config.TileConfig(64, 64, 4, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(SHARED_LIMIT), required=True)
    args = ap.parse_args()
    failures = 0
    for name, fn, elem_bytes, constexprs, cfg in cases(args.arch):
        row = dict(id=name, tile=f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}")
        try:
            shared = compile_kernel(fn, args.arch, elem_bytes, constexprs, cfg).metadata.shared
            row.update(shared=shared, limit=SHARED_LIMIT[args.arch], ok=shared <= SHARED_LIMIT[args.arch])
        except Exception as exc:  # a ptxas or lowering error is a failed entry, reported with the rest
            row.update(ok=False, error=" | ".join(str(exc).strip().splitlines()[-4:])[:500])
        failures += not row["ok"]
        print(json.dumps(row), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
