"""flashattn2.explain and `python -m flashattn2 explain`: the plan a call runs (kernel, tile, load path, why) and the
rows passed over with why, for every kind of call, on the device's own arch or, with meta tensors, another's."""

import importlib

import pytest
import torch

import flashattn2
from cases import cu_seqlens, randn
from flashattn2.errors import ArgumentError
from flashattn2.ops import _runtime


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_dense_forward_and_backward_on_this_device(capsys):
    q, k, v = (randn(2, 40, 4, 64, dtype=torch.float16) for _ in range(3))
    text = flashattn2.explain(q, k, v, causal=True)
    assert capsys.readouterr().out.strip() == text.strip()
    lines = text.splitlines()
    assert lines[0].startswith("AttentionSpec on ") and "fwd" in lines[0]
    assert any(line.startswith("BackwardSpec on ") for line in lines)
    assert sum(line.strip().startswith("why:") for line in lines) == 2


@pytest.mark.parametrize("arch", ["sm90", "sm80", "sm86"])
def test_meta_tensors_take_the_arch_named(arch):
    q = meta(2, 4096, 32, 128)
    text = flashattn2.explain(q, q, q, causal=True, arch=arch)
    assert f"AttentionSpec on {arch}" in text and f"BackwardSpec on {arch}" in text
    gluon = _runtime.hopper_kernels() is not None  # this Triton release runs the Gluon kernels (README: compatibility)
    if arch == "sm90" and gluon:  # the Hopper rows run here, the Triton rows are passed over with why
        assert "hopper" in text.splitlines()[0]
    elif arch == "sm90":  # the Triton rows run, the Hopper rows are passed over with why
        assert "hopper" not in text.splitlines()[0] and "do not run on this Triton release" in text
    windowed = flashattn2.explain(q, q, q, causal=True, window_size=(128, 0), arch=arch)
    if arch == "sm90":
        assert "passed over: fwd_hopper" in windowed and "a window, softcap, ALiBi or dropout" in windowed


def test_varlen_kvcache_and_paged():
    q, k = meta(64, 8, 128), meta(64, 2, 128)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    varlen = flashattn2.explain(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40, max_seqlen_k=40)
    assert "varlen" in varlen and "BackwardSpec" in varlen
    q1, cache = meta(4, 1, 32, 128), meta(4, 1024, 8, 128)
    seqlens = torch.empty(4, dtype=torch.int32, device="meta")
    decode = flashattn2.explain(q1, cache, meta(4, 1024, 8, 128), kvcache=True, cache_seqlens=seqlens,
                                k=meta(4, 1, 8, 128), v=meta(4, 1, 8, 128))  # fmt: skip
    assert decode.startswith("KVCacheSpec on sm90") and "BackwardSpec" not in decode
    assert "KV cache (append)" in decode and "v_from_k False" in decode  # meta tensors: all at address 0
    latent = meta(4, 1024, 1, 576)
    mla = flashattn2.explain(meta(4, 1, 16, 576), latent, latent[..., :512], kvcache=True, cache_seqlens=seqlens)
    assert "v_from_k True" in mla and "latent=True" in mla
    pages, table = meta(64, 16, 2, 128), torch.empty(2, 32, dtype=torch.int32, device="meta")
    paged = flashattn2.explain(
        q, pages, pages, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40, max_seqlen_k=40, block_table=table
    )
    assert paged.startswith("PagedSpec on sm90")


def test_explain_runs_nothing_and_names_bad_arguments():
    q = randn(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ArgumentError, match="arch is for meta tensors"):
        flashattn2.explain(q, q, q, arch="sm90")
    with pytest.raises(ArgumentError, match="unknown arguments"):
        flashattn2.explain(q, q, q, casual=True)
    with pytest.raises(ArgumentError, match="arch must be one of"):
        flashattn2.explain(meta(1, 8, 2, 16), meta(1, 8, 2, 16), meta(1, 8, 2, 16), arch="sm70")
    cu = cu_seqlens([8])
    assert "varlen" in flashattn2.explain(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8,
                                          max_seqlen_k=8)  # fmt: skip


@pytest.mark.parametrize(
    "argv, first",
    [
        ([], "AttentionSpec on sm90"),
        (["--causal", "--window", "128,0", "--arch", "sm80"], "AttentionSpec on sm80"),
        (["--varlen", "--nheads-k", "8"], "AttentionSpec on sm90"),
        (["--kvcache", "--seqlen-q", "1", "--seqlen-k", "8192", "--nheads-k", "8", "--page-size", "16"], "KVCacheSpec"),
        (["--headdim", "192", "--headdim-v", "128", "--sink", "--alibi", "--dtype", "fp16"], "AttentionSpec"),
        (["--dtype", "fp8", "--causal"], "AttentionSpec on sm90"),
        (["--dtype", "fp8", "--kvcache", "--seqlen-q", "1", "--seqlen-k", "4096"], "KVCacheSpec on sm90"),
    ],
)
def test_command_line(argv, first, capsys):
    assert importlib.import_module("flashattn2.explain").main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(first) and "why:" in out
    if "fp8" in argv:  # e4m3 inputs (the forward only), or an e4m3 cache read by 16-bit queries
        assert (
            ("fp8: e4m3" in out and "BackwardSpec" not in out)
            if "--kvcache" not in argv
            else ("fp8=True" in out and "float8_e4m3fn k" in out)
        )


@pytest.mark.parametrize("gpu, rows, dots", [("sm89", "sm86", True), ("sm120", "sm86", True)])
def test_a_gpus_name_plans_with_its_rows_and_fp8_path(gpu, rows, dots):
    """--arch takes a GPU's name (the README discusses sm89 and sm120): its table rows (native_arch's rule) and, for
    FP8, its path (e4m3 dots from sm_89 on; sm86 itself decodes to bf16)."""
    from flashattn2.ops.request import modes

    assert modes.table_arch(*modes.GPU_ARCHS[gpu]) == rows
    e4m3 = meta(1, 64, 2, 64, dtype=torch.float8_e4m3fn)
    text = flashattn2.explain(e4m3, e4m3, e4m3, arch=gpu)
    assert text.startswith(f"{gpu}: the {rows} rows\nAttentionSpec on {rows}")
    assert ("e4m3 tiles into the dots" in text) == dots
    native = flashattn2.explain(e4m3, e4m3, e4m3, arch="sm86")
    assert "decoded to bf16" in native and "e4m3 tiles into the dots" not in native
    # an FP8 KV cache: the decode kernel converts its codes by cvt where the GPU has e4m3, else by integer arithmetic
    q = meta(1, 1, 4, 64, dtype=torch.bfloat16)
    cache = meta(1, 64, 2, 64, dtype=torch.float8_e4m3fn)
    for arch, how in ((gpu, "by cvt"), ("sm90", "by cvt"), ("sm86", "by integer arithmetic"), ("sm80", "by integer")):
        text = flashattn2.explain(q, cache, cache, kvcache=True, arch=arch, cache_seqlens=5)
        assert f"fp8: e4m3 codes converted {how}" in text and "float8_e4m3fn k" in text
    assert "fp8:" not in flashattn2.explain(q, q, q, kvcache=True, arch="sm90", cache_seqlens=5)


def test_load_paths_are_rows_with_why():
    """The load path is the first row of its table whose facts the call has (one walker for every table): explain
    names it with its why and the rows passed over with the facts they miss."""
    q = meta(2, 512, 8, 64)
    hopper = flashattn2.explain(q, q, q, arch="sm90", softcap=5.0)  # the Triton forward: descriptors on the host
    assert "load path: host_desc: descriptors over (batch, seqlen, heads * headdim)" in hopper
    wide = meta(2, 512, 8, 96)  # not a power of two: each program makes its descriptors
    text = flashattn2.explain(wide, wide, wide, arch="sm90")
    assert "load path: tma: " in text and "passed over: host_desc: pow2_heads_adjacent is False, not True" in text
    ampere = flashattn2.explain(q, q, q, arch="sm80")
    assert "load path: pointers" in ampere and "load path passed over: tma: tma is False, not True" in ampere
    seqlens = torch.empty(4, dtype=torch.int32, device="meta")
    latent, table = meta(256, 64, 1, 576), torch.empty(4, 64, dtype=torch.int32, device="meta")
    mla = flashattn2.explain(meta(4, 1, 16, 576), latent, latent[..., :512], kvcache=True, cache_seqlens=seqlens,
                             block_table=table)  # fmt: skip
    assert "kv_tma True" in mla and "load path: kv_tma: MLA's latent cache, paged" in mla
    rows = meta(4, 4096, 1, 576)
    contiguous = flashattn2.explain(meta(4, 1, 16, 576), rows, rows[..., :512], kvcache=True, cache_seqlens=seqlens)
    assert "kv_tma False" in contiguous and "passed over: kv_tma: paged is False, not True;" in contiguous


def test_one_walker_names_each_unmet_condition():
    from flashattn2.ops import planning
    from flashattn2.ops.planning import common, tables

    rows = (
        tables.LoadRow("a", (("n", tables.AtMost(64)), ("paged", True)), why="first"),
        tables.LoadRow("b", (), why="the rest"),
    )
    walked = list(common.walk(rows, {"n": 65, "paged": False}))
    assert walked == [(rows[0], "n is 65, not at most 64; paged is False, not True"), (rows[1], None)]
    assert common.first(rows, {"n": 64, "paged": True}).path == "a"
    assert list(common.walk(rows[1:], {}, requires=lambda row: "its kernel cannot")) == [(rows[1], "its kernel cannot")]
    with pytest.raises(AssertionError, match="no row for"):
        common.first(rows[:1], {"n": 65, "paged": True})
    # a fact whose name does not say it all carries its note (tables.FACT_NOTES)
    q = meta(2, 4096, 8, 128)
    with planning.force(hopper=False):
        off = flashattn2.explain(q, q, q, arch="sm90")
    assert "hopper is False, not True (the Gluon kernels on: FLASHATTN2_HOPPER=0 or force(hopper=False)" in off
