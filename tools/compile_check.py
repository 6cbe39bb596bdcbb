"""Compile every kernel configuration the plan table (ops/planning/) can select for sm_90 / sm_80 / sm_86, no GPU needed,
and check shared memory against the target's limit; sm_89 (Ada, FP8's first 99 KB GPU) compiles the FP8
configurations (fp8_cases: the forward's e4m3 dots; fp8_cache_cases: the KV cache's, at sm_86's rows). Prints one JSON line per configuration,
with the compile time ("seconds": a cold compile when TRITON_CACHE_DIR points at an empty
directory; Triton's cache serves later processes).

Run in a process without TRITON_INTERPRET (the interpreter's kernels cannot be compiled):
    python tools/compile_check.py --arch sm90 [--cases lengths-one] [--shard 0/4] [--full]

Every Gluon configuration, and the first configuration of each Triton kernel, is compiled to a cubin (ptxas);
the other Triton configurations stop once their LLVM IR is made ("stage": "llir"), where the shared memory
they need is known and every Triton pass (the pipeliner included) has run: ptxas and the PTX step are about
60% of a compile. --full takes every configuration to a cubin.
"""

import argparse
import json
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET first")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashattn2.kernels import append, bwd, bwd_preprocess, decode, dmask, fill, fwd, merge, rotary  # noqa: E402
from flashattn2.kernels.constexprs import FP8_BF16, FP8_DOTS, FP8_NONE, Mods, Path, Tile  # noqa: E402
from flashattn2.kernels.constexprs import AttnScore, AttnShape, DkdvShape, DmaskScore, PreprocessShape  # noqa: E402
from flashattn2.ops import _runtime, planning  # noqa: E402
from flashattn2.ops.launch import launch_gluon, launch_triton, launcher  # noqa: E402
from flashattn2.ops.planning.geometry import block_d, column_parts  # noqa: E402
from flashattn2.ops.launch.tma import host_desc  # noqa: E402

# bytes per block, opt-in maximum; sm89 (Ada: the sm86 rows, e4m3 dots) compiles the FP8 configurations only
SHARED_LIMIT = {"sm90": 232448, "sm80": 166912, "sm86": 101376, "sm89": 101376}
CAPABILITY = {"sm90": 90, "sm80": 80, "sm86": 86, "sm89": 89}
TABLE_ARCH = {"sm89": "sm86"}  # the plan table's rows an arch runs (ops.request.modes.native_arch)
FP32_POINTERS = {"Lse", "Delta", "DLse", "Alibi", "DQAcc", "LsePad", "Sinks", "SinkPart", "QDescale", "KDescale",
                 "VDescale"}  # fmt: skip
TYPE = {1: "fp8e4nv", 2: "fp16", 4: "fp32"}
KERNELS = {"fwd": fwd.attn_fwd_kernel, "bwd_dkdv": bwd.attn_bwd_dkdv_kernel, "bwd_dq": bwd.attn_bwd_dq_kernel}
T = planning.TileConfig


# the latent rows' tiles by their packed rows' block
LATENT_TILES = {dict(row.when)["rows"]: row.tile for row in planning.DECODE_ROWS if dict(row.when).get("latent")}
INDEX_POINTERS = {"CacheSeqlens", "CacheBatchIdx", "LeftPad", "BlockTable", "Offsets", "Err", "SeqOrder"}


def compile_kernel(fn, arch, elem_bytes, constexprs, cfg, types=None, last=None):
    """The kernel compiled for arch: Triton's CompiledKernel, or with last="llir" the metadata dict of a
    compile stopped after that stage (see _compile_to)."""
    sig = {}
    for name in fn.arg_names:
        if types and name in types:
            sig[name] = types[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():  # tensors are the capitalised arguments
            if name.startswith("CuSeqlens") or name in INDEX_POINTERS:
                sig[name] = "*i32"
            elif name == "Seed":
                sig[name] = "*i64"
            else:
                sig[name] = "*fp32" if name in FP32_POINTERS else "*" + TYPE[elem_bytes]
        elif name in ("sm_scale", "softcap", "dropout_p") or name.startswith("value"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    # the persistent Gluon forward's num_warps counts its consumer warps; it launches with its default
    # partition's 4 (planning.Plan.num_warps)
    options = dict(num_warps=4 if "CONSUMERS" in constexprs else cfg.num_warps, num_stages=cfg.num_stages)
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return triton.compile(GluonASTSource(fn, sig, constexprs), target=target, options=options)
    src = ASTSource(fn, sig, constexprs, _aligned(fn, sig))
    if last is not None:
        return _compile_to(src, target, options, last)
    return triton.compile(src, target=target, options=options)


def _aligned(fn, sig) -> dict:
    """Triton's specialization of a launch whose pointers and integers (strides, sizes: in tuples too) are multiples
    of 16, as torch's allocations and a head dim of 16k make them: the loads it vectorizes and pipelines through
    shared memory -- without it a kernel's shared memory reads low (a pipelined kernel by its stages: the dropout
    mask kernel at head dim 512 read 131,072 bytes here and needed 270,336 on an H100)."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        kind = sig[name]
        if kind == "i32" or (isinstance(kind, str) and kind.startswith("*")):
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(kind, tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, part in enumerate(kind) if part == "i32"})
    return attrs


def _compile_to(src, target, options, last: str) -> dict:
    """triton.compile's stages up to and including `last` (triton 3.6's compiler.compile, without its cache):
    the metadata so far, "shared" among it."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    options = backend.parse_options(dict(options, **src.parse_options()))
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )
    metadata = {"target": target, **options.__dict__}
    names = list(stages)
    for ext in names[names.index(src.ext) : names.index(last) + 1]:
        module = stages[ext](module, metadata)
    return metadata


def _gluon_descriptor_types(elem_bytes, head_dim, cfg, names=("Q", "K", "V", "Out"), dq_cols=None, head_dim_v=None):
    """Signature types of a Gluon kernel's descriptors (3-D, box [1, rows, head_dim], v's head dim for the value
    side, with the shared-memory layout ops.launch.launch_gluon gives them): query-side tensors BLOCK_M rows, key-side
    BLOCK_N; "DQ" is the backward's fp32 accumulator (box [1, BLOCK_M, dq_cols or head_dim]). A head dim that is
    not a power of two: Q, K, DK and DQ get its first part's box and a "...Lo" descriptor each (added) its second's
    (geometry.column_parts)."""
    import torch
    from triton.runtime.jit import mangle_type

    hi, lo = column_parts(head_dim)
    parted = [n for n in ("Q", "K", "DK", "DQ") if n in names]
    cols = {n: hi for n in parted}
    if dq_cols is not None:
        cols["DQ"] = dq_cols
    if lo:
        names = (*names, *(n + "Lo" for n in parted))
        cols.update({n + "Lo": lo for n in parted})
    types = {}
    fp8 = elem_bytes == 1  # the FP8 forward: e4m3 Q and K, V^T's box [1, v's head dim, BLOCK_N], bf16 Out
    for name in names:
        base = name.removesuffix("Lo")
        width = head_dim_v or head_dim if base in _VALUE_SIDE else head_dim
        dtype = torch.float32 if base == "DQ" else torch.float16
        if fp8:
            dtype = torch.bfloat16 if base == "Out" else torch.float8_e4m3fn
        t = torch.empty(2, 64, 2, width, dtype=dtype)
        rows = cfg.block_n if base in _KEY_SIDE else cfg.block_m
        desc = host_desc(t, rows, gluon=True, cols=cols.get(name))
        if fp8 and base == "V":  # V^T's copy, as the launch makes it
            desc = launch_gluon.vt_desc(torch.empty(2, 2, width, 64, dtype=dtype), cfg.block_n)
        (desc,) = launcher._for_triton((desc,))
        types[name] = mangle_type(desc)
    return types


# the plain causal path, and every option at once (LOCAL excludes CAUSAL); SINK is the forward's alone (the
# backward's launcher takes it out: a sink changes only lse there)
VARIANTS = {
    "causal": dict(
        CAUSAL=True, LOCAL=False, SOFTCAP=False, ALIBI=False, DROPOUT=False, SINK=False, IS_VARLEN=False, SORTED=False
    ),
    "varlen-local-softcap-alibi-dropout-sink": dict(
        CAUSAL=False, LOCAL=True, SOFTCAP=True, ALIBI=True, DROPOUT=True, SINK=True, IS_VARLEN=True, SORTED=True
    ),
}


def _attn_constexprs(
    kernel: str, flags: dict, use_tma: bool, host: bool, upcast: bool, tile: Tile, fp8: str = FP8_NONE
) -> dict:
    """The constexprs of `kernel` (fwd, bwd_dkdv, bwd_dq) for a VARIANTS entry, a load path and a tile (the
    backward's kernels take no sink: a sink changes only lse there; their DSPLIT is added by the caller). The
    forward's descale arguments are None (constexprs) but for FP8 (fp8: one of constexprs.FP8_PATHS)."""
    mods = Mods(**{f: flags[f] and (f != "SINK" or kernel == "fwd") for f in Mods._fields})
    path = Path(USE_TMA=use_tma, HOST_DESC=host, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32", FP8=fp8)
    found = dict(MODS=mods, IS_VARLEN=flags["IS_VARLEN"], SORTED=flags["SORTED"], PATH=path, TILE=tile)
    if kernel == "fwd" and fp8 == FP8_NONE:
        found.update(QDescale=None, KDescale=None, VDescale=None, descale_strides=None)
    return found


_S2, _S3 = ("i32",) * 2, ("i32",) * 3
# the run-time bundles' signature types: the bundle's own NamedTuple of type strings (Triton reads its _fields)
_SHAPE = AttnShape(*("i32",) * 5)
_SCORE = AttnScore(window_left="i32", window_right="i32", sm_scale="fp32", softcap="fp32", dropout_p="fp32")
# the Triton attention kernels' tuple parameters: each tensor's strides, the sizes (`shape`), the score's scalars
TUPLE_TYPES = {
    "attn_fwd_kernel": dict(
        q_strides=_S3, k_strides=_S3, v_strides=_S3, out_strides=_S3, lse_strides=_S2, shape=_SHAPE, score=_SCORE
    ),
    "attn_bwd_dkdv_kernel": dict(
        q_strides=_S3,
        k_strides=_S3,
        v_strides=_S3,
        dout_strides=_S3,
        dk_strides=_S3,
        dv_strides=_S3,
        lse_strides=_S2,
        shape=DkdvShape(*("i32",) * 5),
        score=_SCORE,
    ),
    "attn_bwd_dq_kernel": dict(
        q_strides=_S3,
        k_strides=_S3,
        v_strides=_S3,
        dout_strides=_S3,
        dq_strides=_S3,
        lse_strides=_S2,
        shape=_SHAPE,
        score=_SCORE,
    ),
    "attn_bwd_preprocess_kernel": dict(
        out_strides=_S3,
        dout_strides=_S3,
        lse_strides=_S2,
        delta_strides=_S2,
        dqacc_strides=_S3,
        shape=PreprocessShape(*("i32",) * 3),
    ),
    "attn_dropout_mask_kernel": dict(
        q_strides=_S3,
        k_strides=_S3,
        sdmask_strides=_S3,
        shape=_SHAPE,
        score=DmaskScore(window_left="i32", window_right="i32", sm_scale="fp32", dropout_p="fp32"),
    ),
}


def _tuple_types(fn, ones=()) -> tuple[dict, dict]:
    """(the signature types of fn's tuple parameters (TUPLE_TYPES), the constexprs that pin `shape`'s fields named
    in `ones` to 1): Triton specializes an integer equal to 1 into a constant, a tuple's element too, keyed by its
    path (argument index, element index)."""
    types = dict(TUPLE_TYPES[fn.__name__])
    pinned = {}
    for name in ones:
        arg, element = fn.arg_names.index("shape"), types["shape"]._fields.index(name)
        pinned[(arg, element)] = 1
        types["shape"] = types["shape"]._replace(**{name: "constexpr"})
    return types, pinned


# the rows of each tensor's tile: query-side tensors BLOCK_M, key-side BLOCK_N
_QUERY_SIDE = {"Q", "Out", "DOut", "DQ"}
_KEY_SIDE = {"K", "V", "DK", "DV"}


_VALUE_SIDE = {"V", "Out", "DOut", "DO", "DV"}  # v's head dim


def _descriptor_types(kernel, elem_bytes, head_dim, cfg, head_dim_v=None):
    """Signature types of the host-built descriptors (3-D, box [1, rows, head_dim]; v's head dim for the value
    side)."""
    fn = KERNELS[kernel]
    types = {}
    for name in fn.arg_names:
        if name in _QUERY_SIDE or name in _KEY_SIDE:
            rows = cfg.block_m if name in _QUERY_SIDE else cfg.block_n
            cols = head_dim_v or head_dim if name in _VALUE_SIDE else head_dim
            types[name] = f"tensordesc<{TYPE[elem_bytes]}[1,{rows},{cols}]>"
    return types


def _gluon_cases(arch, row):
    """A Gluon row's compiles: its causal setting(s) (the backward's causal one with GQA), the constexprs its plan
    derives (planning._derive)."""
    elem_bytes = row.elem_bytes
    fp8 = elem_bytes == 1
    # the head-dim pair: the bucket's own, or for a row bounded by v's bucket the Gluon pair that reads it
    ((d, dv),) = [
        pair
        for pair in (planning.GLUON_FP8_HEAD_DIMS if fp8 else planning.GLUON_HEAD_DIMS[row.direction])
        if planning.head_dim_bucket(pair[0]) == row.head_dim and (pair[0] == pair[1]) == (row.head_dim_v is None)
    ]
    causals = (False, True) if row.causal is None else (row.causal,)
    for causal in causals:
        plan = planning._derive(row, planning.Forced(), causal)
        cfg = plan.tile
        constexprs = dict(CAUSAL=causal, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages)
        constexprs["HEAD_DIM_V"] = dv
        sink = False
        constexprs.update(plan.constexprs)
        if row.kernel == "bwd_hopper":
            constexprs["GQA"] = causal
            hi, lo = column_parts(d)
            dq_cols = hi if lo else d // constexprs["DQ_SPLIT"]
            types = _gluon_descriptor_types(
                elem_bytes, d, cfg, ("Q", "K", "V", "DO", "DK", "DV", "DQ"), dq_cols=dq_cols, head_dim_v=dv
            )
            if "QLo" not in types:  # a power of two: one part
                constexprs.update(QLo=None, KLo=None, DKLo=None, DQLo=None)
            fn = _runtime.gluon_modules().bwd.attn_bwd_ws_kernel
            label = "causal-gqa" if causal else "full"
        else:
            hopper = _runtime.gluon_modules().fwd
            fn = {"fwd_hopper_ws": hopper.attn_fwd_ws_kernel, "fwd_hopper_persist": hopper.attn_fwd_persist_kernel}[
                row.kernel
            ]  # a new name must be added here
            types = _gluon_descriptor_types(elem_bytes, d, cfg, head_dim_v=dv)
            if "QLo" not in types:  # a power of two: one part
                constexprs.update(QLo=None, KLo=None)
            # the forward's sink with the causal setting (the finish's other branch; no other shared memory)
            sink = constexprs["SINK"] = causal
            label = "causal" if causal else "full"
            # FP8: the three descales with the causal setting, none without (None constexprs, as a 16-bit call's)
            if fp8 and causal:
                types["descale_strides"] = ("i32",) * 6
            else:
                constexprs.update(QDescale=None, KDescale=None, VDescale=None, descale_strides=None)
        label += "-sink" if sink else ""
        dims = f"d{d}" if d == dv else f"d{d}-dv{dv}"
        yield f"{arch}-{dims}-{TYPE[elem_bytes]}-{row.kernel}-{label}", fn, elem_bytes, constexprs, cfg, types


def fp8_cases(arch):
    """The FP8 forward's rows (sm89: sm86's): e4m3 tiles into the dots on sm_90 and sm_89, uint8 codes decoded to
    bf16 on sm_80/86; every load path the plan can choose, the plain causal case with the three descales and every
    option but dropout without them (None: constexprs, which the launch passes for a descale not given)."""
    native = arch in ("sm90", "sm89")
    fp8, elem = (FP8_DOTS, "fp8e4nv") if native else (FP8_BF16, "u8")
    paths = [(True, False), (False, False)] if arch == "sm90" else [(False, False)]  # (no host descriptors: FP8's V)
    for row in planning.rows("sm86" if arch == "sm89" else arch):
        if row.elem_bytes != 1 or row.kernel != "fwd":  # (the Gluon rows: _gluon_cases)
            continue
        bucket = row.head_dim
        cfg = row.tile
        tile = Tile(bucket, cfg.block_m, cfg.block_n, bucket, bucket, bucket)
        for use_tma, host in paths:
            for variant, flags in VARIANTS.items():
                if flags["DROPOUT"]:
                    flags = dict(flags, DROPOUT=False)
                    variant = variant.replace("-dropout", "")
                if host and flags["IS_VARLEN"]:
                    continue
                types, _ = _tuple_types(KERNELS["fwd"])
                types.update(Q="*" + elem, K="*" + elem, V="*" + elem, Out="*bf16", descale_strides=("i32",) * 6)
                if host:
                    rows = dict(Q=cfg.block_m, K=cfg.block_n, V=cfg.block_n, Out=cfg.block_m)
                    types.update(
                        {n: f"tensordesc<{'bf16' if n == 'Out' else elem}[1,{r},{bucket}]>" for n, r in rows.items()}
                    )
                constexprs = _attn_constexprs("fwd", flags, use_tma, host, False, tile, fp8)
                vt_tma = native and use_tma  # (ops/launch/launch_triton._path)
                constexprs["PATH"] = constexprs["PATH"]._replace(VT_TMA=vt_tma)
                if variant != "causal":
                    constexprs.update(QDescale=None, KDescale=None, VDescale=None)
                name = f"{arch}-d{bucket}-e4m3-fwd-{'host-tma' if host else 'tma' if use_tma else 'ptr'}-{variant}"
                yield name, KERNELS["fwd"], 1, constexprs, cfg, types


def cases(arch):
    if arch == "sm89":  # FP8's own target: its configurations only (the rest is sm86's, whose rows it shares)
        yield from fp8_cases(arch)
        yield from fp8_cache_cases(arch)
        return
    yield from fp8_cases(arch)
    for row in planning.rows(arch):
        if row.elem_bytes == 1 and row.kernel == "fwd":  # fp8_cases
            continue
        if row.kernel not in ("fwd", "bwd_dkdv"):  # the Gluon kernels: sm_90, 16-bit or e4m3, dense, causal or not
            yield from _gluon_cases(arch, row)
            continue
        fp32 = row.elem_bytes == 4
        bucket, elem_bytes = row.head_dim, row.elem_bytes
        tiles = [(row.kernel, row.tile)] + ([("bwd_dq", row.dq_tile)] if row.dq_tile is not None else [])
        for kernel, cfg in tiles:
            # sm90: descriptors made in the kernel (the default) and pointers; for 2-byte types also the
            # host-built descriptors (dense inputs only: the plain variant)
            paths = [(False, False)]
            if arch == "sm90":
                paths = [(True, False), (False, False)] + [(True, True)] * (not fp32)
            for use_tma, host in paths:
                for variant, flags in VARIANTS.items():
                    if host and flags["IS_VARLEN"]:
                        continue
                    # bf16 needs the same shared memory as fp16; v's head dim as wide as the row allows: the
                    # widest pair it holds (its tiles fit any narrower v)
                    dv = row.head_dim_v or bucket
                    tile = Tile(bucket, cfg.block_m, cfg.block_n, bucket, dv, dv)
                    constexprs = _attn_constexprs(kernel, flags, use_tma, host, fp32, tile)
                    if kernel != "fwd":
                        constexprs["DSPLIT"] = dict(row.constexprs).get("DSPLIT", 1)
                        if constexprs["DSPLIT"] > 1 and host:  # its column chunks are pointers (launch_triton)
                            continue
                    types, _ = _tuple_types(KERNELS[kernel])
                    if host:
                        types.update(_descriptor_types(kernel, elem_bytes, bucket, cfg, row.head_dim_v))
                    dims = f"d{bucket}" + (f"-dv{row.head_dim_v}" if row.head_dim_v else "")
                    name = (
                        f"{arch}-{dims}-{TYPE[elem_bytes]}-{kernel}-"
                        f"{'host-tma' if host else 'tma' if use_tma else 'ptr'}-{variant}"
                    )
                    yield name, KERNELS[kernel], elem_bytes, constexprs, cfg, types
    # the Triton backward's preprocess (varlen, an lse gradient) and the Gluon backward's (padded rows, the dQ
    # accumulator zeroed, lse copied)
    pre = dict(
        HAS_DLSE=True, IS_VARLEN=True, PADDED=False, COPY_LSE=False, SINK=True, HEAD_DIM=256, BLOCK_M=32, BLOCK_D=256
    )
    pre.update(ACC_DIM=256, BLOCK_ACC=256)
    pre_fn = bwd_preprocess.attn_bwd_preprocess_kernel
    pre_types, _ = _tuple_types(pre_fn)
    yield f"{arch}-preprocess", pre_fn, 2, pre, T(32, 32, 4, 1), pre_types
    wide = dict(pre, HEAD_DIM=512, BLOCK_M=16, BLOCK_D=512)  # v's head dim 512: the launcher's 16 rows
    yield f"{arch}-preprocess-d512", pre_fn, 2, wide, T(16, 16, 4, 1), pre_types
    pre = dict(pre, IS_VARLEN=False, PADDED=True, COPY_LSE=True)
    yield f"{arch}-preprocess-padded", pre_fn, 2, pre, T(32, 32, 4, 1), pre_types
    # the Gluon backward at 192/128: the accumulator (q's head dim) wider than O
    narrow = dict(pre, HEAD_DIM=128, BLOCK_D=128, ACC_DIM=192, BLOCK_ACC=256)
    yield f"{arch}-preprocess-padded-d192-dv128", pre_fn, 2, narrow, T(32, 32, 4, 1), pre_types
    slot = fill.FillSlot(total_rows="i32", stride_r="i32", stride_c="i32", ncols="i32", value="fp32")
    yield (
        f"{arch}-fill-tail",
        fill.fill_tail_kernel,
        2,
        dict(SLOTS=3, BLOCK_R=64, BLOCK_C=128),
        T(64, 64, 4, 1),
        {"X1": "*fp32", "slot0": slot, "slot1": slot, "slot2": slot},
    )
    dmask_flags = dict(
        CAUSAL=False,
        LOCAL=True,
        ALIBI=True,
        IS_VARLEN=True,
        UPCAST=False,
        DOT_PRECISION="tf32",
        HEAD_DIM=256,
        BLOCK_M=64,
        BLOCK_N=64,
        BLOCK_D=256,
    )
    dmask_types, _ = _tuple_types(dmask.attn_dropout_mask_kernel)
    dmask_tile = launch_triton.DROPOUT_PROBS_TILE
    yield f"{arch}-dropout-mask", dmask.attn_dropout_mask_kernel, 2, dmask_flags, dmask_tile, dmask_types
    wide = dict(dmask_flags, HEAD_DIM=320, BLOCK_D=512)  # the widest head dim's block
    yield f"{arch}-dropout-mask-d512", dmask.attn_dropout_mask_kernel, 2, wide, dmask_tile, dmask_types
    # the KV-cache kernel: its tiles for few (decode) and many (chunked prefill) packed rows, plain
    # and with every option; the split-merging and rotary kernels
    # (path, split) entry of the tile table: the kernel's flags that take that path
    variants = {
        ("contiguous", False): dict(PAGED=False, BATCH_IDX=True, PAGE_SIZE=1, CHECK=True, SINK=True),
        ("contiguous", True): dict(PAGED=False, SPLIT=True, CAUSAL=True, PAGE_SIZE=1, PDL=arch == "sm90"),
        ("contiguous-short", True): dict(
            PAGED=False, SPLIT=True, SEQLENS_TENSOR=True, PAGE_SIZE=1, CHECK=True, PDL=arch == "sm90"
        ),
        ("contiguous-many", False): dict(PAGED=False, SEQLENS_TENSOR=True, PAGE_SIZE=1, CHECK=True),
        ("page-block", False): dict(PAGED=True, PAGE_SIZE=256),
        ("page-block", True): dict(PAGED=True, SPLIT=True, SEQLENS_TENSOR=True, PAGE_SIZE=256, CHECK=True),
        ("page-row", False): dict(PAGED=True, PAGE_SIZE=16, LOCAL=True),
        ("page-row", True): dict(
            PAGED=True,
            PAGE_SIZE=16,
            LEFTPAD=True,
            LOCAL=True,
            SOFTCAP=True,
            ALIBI=True,
            SEQLENS_TENSOR=True,
            SPLIT=True,
            VARLEN_Q=True,
            CHECK=True,
            SINK=True,
        ),
    }
    off = dict(
        CAUSAL=False,
        LOCAL=False,
        SOFTCAP=False,
        ALIBI=False,
        SINK=False,
        PAGED=False,
        BATCH_IDX=False,
        LEFTPAD=False,
        SEQLENS_TENSOR=False,
        SPLIT=False,
        VARLEN_Q=False,
        CHECK=False,
        PDL=False,
        V_FROM_K=False,
        ROW_BLOCKS_ADJACENT=False,
        KV_TMA=False,
        ROW_EXACT=False,
        **FP8_OFF,
    )
    # (q/k's, v's head dim): the buckets, and the MLA decode shape (a 512-wide latent and 64 rotary columns)
    # (and DeepSeek-V3's 192/128: q/k in two column blocks, as 576)
    table_arch = TABLE_ARCH.get(arch, arch)
    for head_dim, head_dim_v in ((64, 64), (128, 128), (256, 256), (512, 512), (576, 512), (192, 128)):
        bd, bdv = block_d(head_dim), block_d(head_dim_v)
        name_d = f"d{head_dim}" if head_dim == head_dim_v else f"d{head_dim}-{head_dim_v}"

        def kvcache_case(label, elem_bytes, chosen, tile):
            """The decode kernel at this head-dim pair with the flags chosen (off: the rest) and tile."""
            flags = dict(
                off,
                **chosen,
                UPCAST=elem_bytes == 4,
                DOT_PRECISION="ieee" if elem_bytes == 4 else "tf32",
                HEAD_DIM=head_dim,
                BLOCK_M=tile.block_m,
                BLOCK_N=tile.block_n,
                BLOCK_D=column_parts(head_dim)[0],
                BLOCK_D_LO=column_parts(head_dim)[1],
                HEAD_DIM_V=head_dim_v,
                BLOCK_DV=bdv,
            )
            split = "-split" if chosen.get("SPLIT") else ""
            name = f"{arch}-kvcache-{name_d}-{TYPE[elem_bytes]}-{label}{split}"
            types = dict(KVCACHE_TYPES, **({"Out": "*fp32"} if split else {}))
            return name, decode.attn_kvcache_kernel, elem_bytes, _grouped(flags, KVCACHE_GROUPS), tile, types

        for elem_bytes in (2, 4):
            if arch == "sm86" and elem_bytes == 4 and sum(column_parts(head_dim)) + bdv > 1024:  # refused there
                continue
            for (path, split), chosen in variants.items():
                for rows in (16, 64) if chosen.get("VARLEN_Q") else (16,):
                    tile = planning.decode_tile(
                        planning.decode_row(path, split), rows, head_dim, head_dim_v, elem_bytes, table_arch
                    )
                    many = dict(chosen, ROW_BLOCKS_ADJACENT=True) if rows > tile.block_m else chosen  # as forward
                    yield kvcache_case(f"m{tile.block_m}-{path}", elem_bytes, many, tile)
            # v read from the keys' tile (v_cache a view of k_cache's first block, or k_cache itself)
            tile = planning.decode_tile(
                planning.decode_row("page-block", True), 16, head_dim, head_dim_v, elem_bytes, table_arch
            )
            chosen = dict(variants[("page-block", True)], V_FROM_K=block_d(head_dim_v) == column_parts(head_dim)[0])
            yield kvcache_case(f"m{tile.block_m}-page-block-vk", elem_bytes, chosen, tile)
        if arch == "sm90" and column_parts(head_dim)[1] and head_dim + head_dim_v > 512:
            # MLA's latent cache (the latent rows of DECODE_ROWS): v read from the key tile by TMA, 128 query heads' rows
            for block_m, tile in LATENT_TILES.items():
                for split in (False, True):
                    chosen = dict(PAGED=True, PAGE_SIZE=64, SEQLENS_TENSOR=True, SPLIT=split, PDL=split, SINK=split)
                    chosen.update(V_FROM_K=True, ROW_BLOCKS_ADJACENT=True, KV_TMA=True)
                    yield kvcache_case(f"latent-m{block_m}-page-block", 2, chosen, tile)
                # without TMA (a contiguous cache, small pages, left padding): the pointer loop at the latent tile
                chosen = dict(PAGED=False, PAGE_SIZE=1, LEFTPAD=True, SPLIT=True, V_FROM_K=True)
                yield kvcache_case(f"latent-m{block_m}-contiguous", 2, dict(chosen, ROW_BLOCKS_ADJACENT=True), tile)
        for paged, rotate in ((False, True), (True, False)):
            append_flags = dict(
                CHECK=True,
                PAGED=paged,
                BATCH_IDX=not paged,
                LEFTPAD=True,
                SEQLENS_TENSOR=True,
                PAGE_SIZE=16 if paged else 1,
                ROTARY=rotate,
                INTERLEAVED=rotate,
                HEAD_DIM=head_dim,
                BLOCK_B=256,
                BLOCK_T=16,
                BLOCK_D=bd,
                HEAD_DIM_V=head_dim_v,
                BLOCK_DV=bdv,
                **APPEND_FP8_OFF,
            )
            yield (
                f"{arch}-append-{name_d}-{'paged' if paged else 'rotary'}",
                append.kvcache_append_kernel,
                2,
                _grouped(append_flags, APPEND_GROUPS),
                T(16, 16, 4, 1),
                APPEND_TYPES,
            )
        combine = dict(HEAD_DIM=head_dim_v, BLOCK_S=128, CHUNK_S=16, BLOCK_D=bdv, PDL=arch == "sm90", SINK=True)
        yield (
            f"{arch}-combine-{name_d}",
            decode.attn_combine_kernel,
            2,
            combine,
            T(16, 16, 2, 1),
            {"OutPart": "*fp32", "LsePart": "*fp32", "lse_strides": _i32(3), "shape": decode.CombineShape(*_i32(3))},
        )
    for interleaved in (False, True):
        flags = dict(IS_VARLEN=True, OFFSETS_TENSOR=True, INTERLEAVED=interleaved, CONJ=True, BLOCK_M=8, BLOCK_H=128)
        yield (
            f"{arch}-rotary-{'gptj' if interleaved else 'neox'}",
            rotary.rotary_kernel,
            2,
            flags,
            T(8, 8, 4, 1),
            {"x_strides": _i32(3), "shape": rotary.RotaryShape(*_i32(5))},
        )
    yield from fp8_cache_cases(arch)
    # the ring's merge of partial results (flashattn2.parallel), first block and later ones, head dims to 512
    for first, head_dim in ((True, 128), (False, 512)):
        yield (
            f"{arch}-merge-{'first' if first else 'next'}-d{head_dim}",
            merge.merge_kernel,
            2,
            dict(FIRST=first, BLOCK_S=max(16, 8192 // head_dim), BLOCK_D=head_dim),
            T(16, 16, 4, 1),
            {
                "Acc": "*fp32",
                "Lse": "*fp32",
                "BLse": "*fp32",
                "acc_strides": _i32(3),
                "lse_strides": _i32(2),
                "out_strides": _i32(3),
                "blse_strides": _i32(2),
            },
        )


FP8_OFF = dict(Q_E4M3=False, KV_E4M3=False, Q_DESCALE=False, K_DESCALE=False, V_DESCALE=False, NATIVE=False)
APPEND_FP8_OFF = dict(ENCODE=False, K_DESCALE=False, V_DESCALE=False)


def fp8_cache_cases(arch):
    """The KV-cache kernels over an FP8 cache (e4m3 codes as uint8, converted by the GPU on sm_89+, by integer arithmetic
    on sm_80/86; the append encodes by integer arithmetic everywhere): the
    decode kernel at the FP8 rows' tiles on each cache path, split or not, q in bf16 (and in e4m3 on the contiguous
    path), descales on; the append quantizing bf16 k/v (rotated) and copying e4m3 ones. Head dims: the buckets and
    MLA's 576/512 (v the keys' first block)."""
    plain = dict(CAUSAL=False, LOCAL=False, SOFTCAP=False, ALIBI=False, SINK=False, BATCH_IDX=False, LEFTPAD=False,
                 SEQLENS_TENSOR=True, VARLEN_Q=False, CHECK=False, PDL=False, V_FROM_K=False,
                 ROW_BLOCKS_ADJACENT=False, KV_TMA=False, ROW_EXACT=False, UPCAST=False, DOT_PRECISION="tf32",
                 KV_E4M3=True, K_DESCALE=True, V_DESCALE=True, NATIVE=arch in ("sm90", "sm89"))  # fmt: skip
    paths = {
        "contiguous": dict(PAGED=False, PAGE_SIZE=1, CAUSAL=True),
        "page-block": dict(PAGED=True, PAGE_SIZE=256),
        "page-row": dict(PAGED=True, PAGE_SIZE=16, LEFTPAD=True, SOFTCAP=True, SINK=True),
    }
    for head_dim, head_dim_v in ((64, 64), (128, 128), (256, 256), (576, 512)):
        name_d = f"d{head_dim}" if head_dim == head_dim_v else f"d{head_dim}-{head_dim_v}"
        latent = head_dim != head_dim_v
        for split in (False, True):
            tile = planning.decode_tile(
                next(r for r in planning.DECODE_ROWS if dict(r.when) == {"fp8": True, "split": split}),
                64 if latent else 16, head_dim, head_dim_v, 2, TABLE_ARCH.get(arch, arch),
            )  # fmt: skip
            for path, chosen in paths.items():
                for q_e4m3 in (False, True) if path == "contiguous" else (False,):
                    flags = dict(
                        plain, **chosen, SPLIT=split, PDL=split and arch == "sm90", Q_E4M3=q_e4m3,
                        Q_DESCALE=q_e4m3, V_FROM_K=latent and path != "page-row", ROW_BLOCKS_ADJACENT=latent, HEAD_DIM=head_dim,
                        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=column_parts(head_dim)[0],
                        BLOCK_D_LO=column_parts(head_dim)[1], HEAD_DIM_V=head_dim_v, BLOCK_DV=block_d(head_dim_v),
                    )  # fmt: skip
                    types = dict(KVCACHE_TYPES, Q="*u8" if q_e4m3 else "*bf16", K="*u8", V="*u8",
                                 Out="*fp32" if split else "*bf16")  # fmt: skip
                    q_name = "e4m3" if q_e4m3 else "bf16"
                    name = f"{arch}-kvcache-{name_d}-fp8-q{q_name}-m{tile.block_m}-{path}{'-split' if split else ''}"
                    yield name, decode.attn_kvcache_kernel, 2, _grouped(flags, KVCACHE_GROUPS), tile, types
        for encode in (True, False):
            flags = dict(
                CHECK=True, PAGED=True, BATCH_IDX=False, LEFTPAD=True, SEQLENS_TENSOR=True, PAGE_SIZE=16,
                ROTARY=encode, INTERLEAVED=False, HEAD_DIM=head_dim, BLOCK_B=256, BLOCK_T=16,
                BLOCK_D=block_d(head_dim), HEAD_DIM_V=head_dim_v, BLOCK_DV=block_d(head_dim_v), ENCODE=encode,
                K_DESCALE=encode, V_DESCALE=encode,
            )  # fmt: skip
            new = "*bf16" if encode else "*u8"
            types = dict(APPEND_TYPES, KNew=new, VNew=new, K="*u8", V="*u8", Cos="*bf16", Sin="*bf16")
            yield (
                f"{arch}-append-{name_d}-fp8-{'quantize-rotary' if encode else 'copy'}",
                append.kvcache_append_kernel,
                2,
                _grouped(flags, APPEND_GROUPS),
                T(16, 16, 4, 1),
                types,
            )


def _i32(n: int) -> tuple:
    """The signature type of a tuple of n int32 (a tensor's strides, a shape)."""
    return ("i32",) * n


def _grouped(flat: dict, groups: dict) -> dict:
    """A kernel's constexprs, given flat, as the kernel takes them: each group's NamedTuple of its fields' values
    under the group's parameter name (groups: name -> NamedTuple class); the names in no group as they are."""
    grouped = {name: cls(**{f: flat[f] for f in cls._fields}) for name, cls in groups.items()}
    fields = {f for cls in groups.values() for f in cls._fields}
    return dict(grouped, **{n: v for n, v in flat.items() if n not in fields})


# attn_kvcache_kernel's and kvcache_append_kernel's constexpr groups and tuple parameters
KVCACHE_GROUPS = dict(
    MODS=decode.DecodeMods,
    CACHE=decode.CacheLayout,
    PATH=decode.DecodePath,
    DOTS=decode.DecodeDots,
    TILE=decode.DecodeTile,
    FP8=decode.DecodeFp8,
)
KVCACHE_TYPES = dict(
    q_strides=_i32(3),
    k_strides=_i32(3),
    v_strides=_i32(3),
    out_strides=_i32(4),
    lse_strides=_i32(3),
    shape=decode.DecodeShape(*_i32(10)),
    score=decode.DecodeScore(window_left="i32", window_right="i32", sm_scale="fp32", softcap="fp32"),
    descale_strides=_i32(6),
)
APPEND_GROUPS = dict(CACHE=decode.CacheLayout, TILE=append.AppendTile, FP8=append.AppendFp8)
APPEND_TYPES = dict(
    knew_strides=_i32(3),
    vnew_strides=_i32(3),
    k_strides=_i32(3),
    v_strides=_i32(3),
    shape=append.AppendShape(*_i32(7)),
    cos_shape=append.CosShape(*_i32(2)),
    descale_strides=_i32(4),
)


# Triton specializes an integer argument equal to 1 into a constant: a one-token query or key sequence, or
# MHA's group size of 1, is its own kernel, with loops folded away that the table's cases keep (a pipeliner
# failure hid there). (max_seqlen_q, max_seqlen_k, group_size); None: an ordinary runtime integer
LENGTHS_ONE = [(1, None, 1), (1, None, None), (None, 1, None), (1, 1, 1)]


def length_one_cases(arch):
    """The Triton forward and backward kernels with lengths of 1, at a padded head dim (96 in the
    128 bucket) with the tile a short key sequence selects, on every load path of the arch."""
    import torch

    head_dim = 96
    paths = [(True, False), (False, False)] if arch == "sm90" else [(False, False)]
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        for seqlen_q, seqlen_k, group in LENGTHS_ONE:
            plan = planning.lookup(
                arch,
                torch.float16,
                head_dim,
                False,
                seqlen_k or 97,
                planning.Features(),
                "fwd" if kernel == "fwd" else "bwd",
            )
            cfg = plan.dq_tile if kernel == "bwd_dq" else plan.tile
            ints = {
                n: v
                for n, v in (("max_seqlen_q", seqlen_q), ("max_seqlen_k", seqlen_k), ("group_size", group))
                if v is not None
            }
            # dense without options (the case that failed: causal masking keeps the loops) for every
            # combination; causal, and all options at once (varlen), for a one-token query with GQA (CI time:
            # the varlen variant compiles 3x slower)
            variants = {"full": dict(VARIANTS["causal"], CAUSAL=False)}
            if (seqlen_q, seqlen_k, group) == (1, None, None):
                variants.update(VARIANTS)
            types, pinned = _tuple_types(KERNELS[kernel], ints)  # (its keys: the lengths equal to 1)
            bucket = planning.head_dim_bucket(head_dim)
            tile = Tile(head_dim, cfg.block_m, cfg.block_n, bucket, head_dim, bucket)
            for use_tma, _ in paths:
                for variant, flags in variants.items():
                    constexprs = {**_attn_constexprs(kernel, flags, use_tma, False, False, tile), **pinned}
                    if kernel != "fwd":
                        constexprs["DSPLIT"] = 1
                    lengths = "-".join(f"{n.removeprefix('max_')}1" for n in ints)
                    yield (
                        f"{arch}-d{head_dim}-fp16-{kernel}-{'tma' if use_tma else 'ptr'}-{variant}-{lengths}",
                        KERNELS[kernel],
                        2,
                        constexprs,
                        cfg,
                        types,
                    )
    pre = dict(
        HAS_DLSE=False,
        IS_VARLEN=False,
        PADDED=False,
        COPY_LSE=False,
        SINK=False,
        HEAD_DIM=head_dim,
        BLOCK_M=32,
        BLOCK_D=planning.head_dim_bucket(head_dim),
        ACC_DIM=head_dim,
        BLOCK_ACC=planning.head_dim_bucket(head_dim),
    )
    pre_fn = bwd_preprocess.attn_bwd_preprocess_kernel
    types, pinned = _tuple_types(pre_fn, ("max_seqlen_q",))
    yield f"{arch}-preprocess-seqlen_q1", pre_fn, 2, {**pre, **pinned}, T(32, 32, 4, 1), types
    if arch == "sm90":
        yield from _gluon_length_one_cases()


# the Gluon kernels' integer arguments that a call can make 1 (Triton then passes a constant, which their aggregates
# must hold: kernels/pipeline.scalars); each kernel's first table configuration with all of them 1 at once
GLUON_ONES = {
    "attn_fwd_persist_kernel": ("batch", "nheads", "seqlen_q", "seqlen_k", "group_size"),
    "attn_fwd_ws_kernel": ("batch", "nheads", "seqlen_q", "seqlen_k", "group_size"),
    "attn_bwd_ws_kernel": ("seqlen_q", "seqlen_k", "nheads", "nheads_k"),
}


def _gluon_length_one_cases():
    seen = set()
    for row in planning.rows("sm90"):
        if row.kernel in ("fwd", "bwd_dkdv") or row.kernel in seen:
            continue
        seen.add(row.kernel)
        name, fn, elem_bytes, constexprs, cfg, types = next(_gluon_cases("sm90", row))
        ones = {n: 1 for n in GLUON_ONES[fn.__name__] if n in fn.arg_names}
        yield f"{name}-ones", fn, elem_bytes, {**constexprs, **ones}, cfg, types


def case_id(name: str, cfg) -> str:
    """A configuration's id with its tile, e.g. 'sm90-d64-fp16-fwd_hopper_persist-causal 64x64w12s4':
    cases() names repeat across a kernel's tiles (the short-sequence tiles, causal-only entries)."""
    return f"{name} {cfg}"


def _key(case):
    name, fn, elem_bytes, constexprs, cfg, *types = case
    # (str: a constexpr's key is its name or, for a tuple's element, its path)
    return (fn.__name__, elem_bytes, tuple(sorted(constexprs.items(), key=str)), cfg, repr(types))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(SHARED_LIMIT), required=True)
    ap.add_argument("--match", default="", help="only the configurations whose id contains this")
    ap.add_argument(
        "--cases",
        choices=("table", "lengths-one"),
        default="table",
        help="the table's entries (default), or the kernels with lengths of 1 (length_one_cases)",
    )
    ap.add_argument("--shard", default="0/1", help="i/n: every n-th configuration from the i-th (CI's parts)")
    ap.add_argument(
        "--full",
        action="store_true",
        help="every configuration to a cubin (ptxas), not only the Gluon ones and each Triton kernel's first",
    )
    args = ap.parse_args()
    index, count = (int(x) for x in args.shard.split("/"))
    failures = 0
    # sm80 and sm86 share most configurations; sm86's lower shared-memory limit is the binding
    # one, so sm80 compiles only those sm86 does not (its own table's larger tiles)
    skip = {_key(case) for case in cases("sm86")} if args.arch == "sm80" else set()
    chosen = [
        case
        for case in (cases if args.cases == "table" else length_one_cases)(args.arch)
        if args.match in case[0] and _key(case) not in skip
    ]
    to_cubin = set()  # (the shard's ids of) each kernel's first configuration, and the Gluon ones
    seen = set()
    for i, (name, fn, *_) in enumerate(chosen):
        if args.full or getattr(fn, "is_gluon", lambda: False)() or fn.__name__ not in seen:
            to_cubin.add(i)
        seen.add(fn.__name__)
    for i, case in enumerate(chosen):
        if i % count != index:
            continue
        name, fn, elem_bytes, constexprs, cfg, *types = case
        last = None if i in to_cubin else "llir"
        row = dict(id=name, tile=str(cfg), stage=last or "cubin")
        start = time.perf_counter()
        try:
            done = compile_kernel(fn, args.arch, elem_bytes, constexprs, cfg, *(types or [None]), last=last)
            shared = done["shared"] if last else done.metadata.shared
            row.update(
                shared=shared,
                limit=SHARED_LIMIT[args.arch],
                ok=shared <= SHARED_LIMIT[args.arch],
                seconds=round(time.perf_counter() - start, 2),
            )
        except Exception as exc:  # a ptxas or lowering error is a failed entry, reported with the rest
            row.update(
                ok=False,
                error=" | ".join(str(exc).strip().splitlines()[-4:])[:500],
                seconds=round(time.perf_counter() - start, 2),
            )
        failures += not row["ok"]
        print(json.dumps(row), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
