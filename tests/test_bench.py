"""The benches' result files (no GPU): CSVs written by an older bench gain the new columns,
and the report separates GQA from MHA and tabulates peak memory."""

import csv
import itertools

import pytest

from flashattn2.bench import kernels, report, results

OLD_FIELDS = [f for f in kernels.FIELDS if f not in ("nheads_k", "peak_mib")]


def _row(**kw):
    row = dict(
        provider="flashattn2",
        dtype="fp16",
        headdim=128,
        causal=1,
        seqlen=2048,
        batch=8,
        nheads=16,
        nheads_k=16,
        mode="fwd_bwd",
        ms="1.0",
        tflops="300",
        peak_mib="",
        note="",
        gpu="GPU",
        torch="2",
        triton="3",
        date="2026-11-29",
        git_sha="abc",
    )
    row.update(kw)
    return row


def test_old_csv_gains_new_columns(tmp_path):
    path = tmp_path / "k.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=OLD_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerow(_row(tflops="111"))
    with results.appending(str(path), kernels.FIELDS, lambda r: {"nheads_k": r["nheads"]}) as (writer, _):
        writer.writerow(_row(nheads=32, nheads_k=8, peak_mib="1234"))
    rows = list(csv.DictReader(open(path, newline="")))
    assert list(rows[0]) == kernels.FIELDS
    assert (rows[0]["tflops"], rows[0]["nheads_k"], rows[0]["peak_mib"]) == ("111", "16", "")
    assert (rows[1]["nheads_k"], rows[1]["peak_mib"]) == ("8", "1234")
    # a file with the current header is appended to as it is
    with results.appending(str(path), kernels.FIELDS) as (writer, _):
        writer.writerow(_row(seqlen=4096))
    assert len(list(csv.DictReader(open(path, newline="")))) == 3


def test_unknown_columns_are_not_dropped(tmp_path):
    path = tmp_path / "k.csv"
    path.write_text("provider,mystery\nflashattn2,1\n")
    with pytest.raises(ValueError, match="mystery"):
        with results.appending(str(path), kernels.FIELDS):
            pass
    assert path.read_text() == "provider,mystery\nflashattn2,1\n"


def test_new_file_gets_the_header(tmp_path):
    path = tmp_path / "sub" / "k.csv"
    with results.appending(str(path), kernels.FIELDS) as (writer, _):
        writer.writerow(_row())
    assert open(path).readline().strip() == ",".join(kernels.FIELDS)


def test_report_separates_gqa_and_tabulates_peak_memory(tmp_path):
    path = tmp_path / "k.csv"
    with results.appending(str(path), kernels.FIELDS) as (writer, _):
        writer.writerow(_row(tflops="300", peak_mib="1000"))
        writer.writerow(_row(provider="sdpa_flash", tflops="200", peak_mib="800"))
        writer.writerow(_row(nheads=32, nheads_k=8, tflops="280", peak_mib="2100"))
        writer.writerow(_row(provider="sdpa_flash", nheads=32, nheads_k=8, tflops="140", peak_mib="2000"))
    md = report.markdown(report.load(str(path)))
    mha = md.index("### fp16, headdim 128, causal, fwd_bwd")
    gqa = md.index("### fp16, GQA 32/8, headdim 128, causal, fwd_bwd")
    assert "| 2048 | 300 | 200 | 1.50 |" in md[mha:gqa]
    assert "| 2048 | 280 | 140 | 2.00 |" in md[gqa:]
    peak = md[md.index("### Peak memory") :]
    assert "| fp16, headdim 128, causal | 2048 | 1000 | 800 | 1.25 |" in peak
    assert "| fp16, GQA 32/8, headdim 128, causal | 2048 | 2100 | 2000 | 1.05 |" in peak
    assert "sdpa_cudnn" not in peak  # a peer never measured has no column


def test_report_names_the_run_of_a_table_measured_later(tmp_path):
    path = tmp_path / "k.csv"
    with results.appending(str(path), kernels.FIELDS) as (writer, _):
        writer.writerow(_row(mode="fwd"))
        writer.writerow(_row(mode="bwd"))
        writer.writerow(_row(mode="bwd", git_sha="def"))  # the bwd table re-measured, in one other run
    md = report.markdown(report.load(str(path)))
    assert md.startswith("GPU, torch 2, triton 3, 2026-11-29, git abc.")
    assert "### fp16, headdim 128, causal, bwd (runs: git def)" in md
    assert "### fp16, headdim 128, causal, fwd\n" in md


def test_rows_longer_than_the_header_are_refused(tmp_path):
    path = tmp_path / "k.csv"
    text = ",".join(OLD_FIELDS) + "\n" + ",".join(["x"] * (len(OLD_FIELDS) + 1)) + "\n"
    path.write_text(text)
    with pytest.raises(ValueError, match="more fields"):
        with results.appending(str(path), kernels.FIELDS):
            pass
    assert path.read_text() == text and not (tmp_path / "k.csv.tmp").exists()


def test_gpt_bench_rows_and_table(tmp_path):
    """bench gpt's plumbing on a tiny model (the CPU interpreter, or the GPU): one row per
    attention with a first loss that matches flashattn2's, FLOPs by the paper's formula, a table."""
    from conftest import DEVICE
    from flashattn2.bench import gpt

    path = str(tmp_path / "gpt.csv")
    gpt.run(
        path,
        gpt.Grid(models=["gpt3-1.3b"], contexts=[32], attentions=["naive", "sdpa_flash", "flashattn2"]),
        tokens=64,
        steps=1,
        warmup=0,
        device=DEVICE,
        dims=(2, 64, 2),
        progress=lambda _: None,
    )
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["attention"] for r in rows] == ["flashattn2", "naive", "sdpa_flash"]
    assert all(r["note"] == "" and float(r["tflops"]) > 0 for r in rows), rows
    assert int(rows[0]["batch"]) == 2
    assert gpt.step_flops(10, 2, 64, 32, 2) == 2 * (6 * 32 * 10 + 12 * 2 * 64 * 32**2)
    table = gpt.markdown(path)
    assert "| gpt3-1.3b | 32 |" in table and "x sdpa_flash" in table


def test_ab_settings_and_table():
    """bench ab's settings parse into planning.force arguments (a typo is refused, naming the
    keys), the defaults enter no force(), and the table gives each setting's ratio to the first
    and to cuDNN."""
    from flashattn2.bench import ab
    from flashattn2.ops import planning

    default, split = ab.Setting("default"), ab.Setting("bwd_order=head-major, hopper=0")
    assert default.overrides == {} and ab.Setting("").label == "default"
    assert split.overrides == {"bwd_order": "head-major", "hopper": False}
    with split.context():
        assert planning.forced().hopper is False and planning.forced().bwd_order == "head-major"
    assert planning.forced() == planning.Forced()
    assert ab.Setting("arch=sm80").overrides == {"arch": "sm80"}
    tile = ab.Setting("fwd_hopper_persist=64x64w8s2").overrides
    assert tile == {"fwd_hopper_persist": planning.TileConfig(64, 64, 8, 2)}
    tile = ab.Setting("fwd_hopper_persist=64x64w12s3q1").overrides
    assert tile == {"fwd_hopper_persist": planning.TileConfig(64, 64, 12, 3, qbuf=1)}
    for bad in ("hoper=1", "hopper", "fwd_hopper_persist=64x64", "fwd_hoper=64x64w4s2"):
        with pytest.raises(ValueError, match="bwd_order"):
            ab.Setting(bad)
    point = dict(dtype="fp16", headdim=256, causal=1, seqlen=2048, mode="bwd", ms=1.0, note="")
    rows = [
        dict(point, setting="default", tflops=300.0),
        dict(point, setting=split.label, tflops=330.0),
        dict(point, setting="sdpa_cudnn", tflops=360.0),
    ]
    table = ab.markdown(rows)
    header, _, line = table.splitlines()[:3]
    assert f"{split.label} / default" in header and "cuDNN" in header
    assert line.split(" | ")[5:] == ["300", "330", "1.100", "360", "0.833", "0.917 |"]


def test_ab_runs_forward_and_backward_under_the_setting(monkeypatch):
    """bench ab's checks and timings run inside the setting's overrides (the backward reads its
    switches after the forward call has returned), the defaults outside any; each setting once per
    round, in turn, odd rounds in reverse order. (The timing itself is replaced here: it needs CUDA.)"""
    from flashattn2.bench import ab
    from flashattn2.ops import planning

    seen = []

    def fake_check(fn, *args):
        seen.append(("check", planning.forced().hopper))
        return ""

    def fake_time(call, inputs, modes):
        seen.append(("time", planning.forced().hopper))
        return {mode: 1.0 for mode in modes}

    monkeypatch.setattr(ab, "check_provider", fake_check)
    monkeypatch.setattr(ab, "time_modes", fake_time)
    grid = kernels.Grid(
        dtypes=["fp16"], headdims=[64], seqlens=[128], causals=[True], modes=["bwd"], tokens=128, hidden=128, rounds=3
    )
    rows = ab.run(["default", "hopper=0"], grid, cudnn=False, progress=False, device="cpu")
    assert seen == [("check", None), ("check", False)] + [
        ("time", None),
        ("time", False),
        ("time", False),
        ("time", None),
        ("time", None),
        ("time", False),
    ]
    assert [r["setting"] for r in rows] == ["default", "hopper=0"]
    assert planning.forced() == planning.Forced()


def test_grid_rounds_alternate_the_providers(tmp_path, monkeypatch):
    """run_grid with rounds > 1: each point timed that many times, the providers in order then reversed, each
    mode's median reported (note 'median of N rounds'), peak memory from the first round only."""
    from flashattn2.bench import kernels

    calls, values = [], {"a": iter([1.0, 5.0, 3.0]), "b": iter([2.0, 2.0, 8.0])}

    def time_point(fn, layout, point, modes, peak):
        calls.append((fn, peak is not None))
        if peak is not None:
            peak["fwd"] = 1.0
        return {"fwd": next(values[fn])}

    monkeypatch.setattr(kernels, "providers", lambda: {"a": ("bshd", "a"), "b": ("bshd", "b")})
    monkeypatch.setattr(kernels, "check_provider", lambda *args: "")
    monkeypatch.setattr(kernels, "time_point", time_point)
    monkeypatch.setattr(kernels, "run_metadata", lambda: {})
    grid = kernels.Grid(dtypes=["fp16"], headdims=[64], seqlens=[512], causals=[False], modes=["fwd"], rounds=3)
    rows = kernels.run_grid(tmp_path / "k.csv", grid, ["a", "b"], progress=False)
    assert calls == [("a", True), ("b", True), ("b", False), ("a", False), ("a", False), ("b", False)]
    assert [(r["provider"], r["ms"], r["note"], r["peak_mib"]) for r in rows] == [
        ("a", "3.0000", "median of 3 rounds", "1"),
        ("b", "2.0000", "median of 3 rounds", "1"),
    ]


def test_grid_points():
    """A grid's points in product order (dtype, headdim, causal, seqlen), each `tokens` tokens (batch at least 1) and
    hidden // headdim query heads unless nheads is given, as many K/V heads unless nheads_k is."""
    grid = kernels.Grid(
        dtypes=["fp16", "bf16"], headdims=[64, 128], seqlens=[512, 32768], causals=[False, True], modes=["fwd"]
    )
    points = grid.points()
    assert [p[:4] for p in points] == list(itertools.product(["fp16", "bf16"], [64, 128], [False, True], [512, 32768]))
    assert points[1] == kernels.Point(
        dtype="fp16", headdim=64, causal=False, seqlen=32768, batch=1, nheads=32, nheads_k=32
    )
    assert (points[4].batch, points[4].nheads, points[4].label) == (32, 16, "fp16 d128 full 512")
    gqa = kernels.Grid(
        dtypes=["fp16"], headdims=[64, 128], seqlens=[512], causals=[True], modes=["fwd"], nheads=32, nheads_k=8
    )
    assert [(p.nheads, p.nheads_k, p.group) for p in gqa.points()] == [(32, 8, 4)] * 2


def test_rounds_below_one_are_refused(capsys):
    from flashattn2.__main__ import main

    assert main(["bench", "--rounds", "0"]) == 2
    assert "--rounds must be 1 or more, got 0" in capsys.readouterr().out


def test_headdims_tables_by_length(tmp_path):
    """The head-dim cases (bench/headdims.py) get a table per case with one row per length, flashattn2 first, a
    refused peer said so, and the MLA rows beside the copy; the features table of the other cases stays."""
    from flashattn2.bench import features

    path = tmp_path / "f.csv"
    meta = dict(dtype="bf16", nheads=16, gpu="GPU", torch="2", triton="3", date="d", git_sha="abc")
    rows = []
    for shape, ours, cudnn in (("2x8192", "458.1", "602.0"), ("8x2048", "403.0", "595.0")):
        for variant, f in (("flashattn2 192/128", ours), ("sdpa_cudnn 192/128", cudnn), ("sdpa_flash 192/128", "nan")):
            for mode in ("fwd", "bwd") if f != "nan" else ("fwd",):
                rows.append(dict(case="dv-full", variant=variant, headdim="192/128", shape=shape, mode=mode, ms="1",
                                 tflops=f if mode == "fwd" else "300.0", note="", **meta))  # fmt: skip
    rows.append(dict(case="mla-decode", variant="flashattn2", headdim="576/512", shape="64x16384", mode="fwd", ms="1",
                     tflops="171.0", note="GB/s; 0.063x the copy's", **meta))  # fmt: skip
    rows.append(dict(case="mla-decode", variant="device copy", headdim="576/512", shape="64x16384", mode="fwd", ms="1",
                     tflops="2705.0", note="GB/s read + written", **meta))  # fmt: skip
    rows.append(dict(case="window", variant="causal 8x2k", headdim="128", shape="8x2048", mode="fwd", ms="2",
                     tflops="400", note="", **meta))  # fmt: skip
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=features.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    text = features.markdown(path)
    assert "### window, bf16, headdim 128" in text
    table = text[text.index("### dv-full") :]
    assert "| shape | flashattn2 192/128 | sdpa_cudnn 192/128 | sdpa_flash 192/128 |" in table
    assert table.index("| 8x2048 | 403 / 300 | 595 / 300 | not accepted |") < table.index("| 2x8192 | 458 / 300 |")
    assert "| 64x16384 | 171 | 2705 | GB/s; 0.063x the copy's |" in text


def test_alternated_reverses_odd_rounds_and_takes_the_median():
    seen = []
    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def time_one(name):
        seen.append(name)
        return {"fwd": next(times[name])}

    med = kernels.alternated({"a": "a", "b": "b"}, time_one, 3)
    assert seen == ["a", "b", "b", "a", "a", "b"]
    assert med == {"a": {"fwd": 3.0}, "b": {"fwd": 4.0}}


def test_generate_bench_rows(tmp_path):
    """bench generate's plumbing on a tiny Llama (the CPU interpreter, without compiling; compiled on the GPU): a
    row per attention, tokens per second, flashattn2's logits as the reference (no mismatch note)."""
    pytest.importorskip("transformers")
    from conftest import DEVICE, ON_GPU
    from flashattn2.bench import generate

    dims = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = str(tmp_path / "generate.csv")
    ways = (False, True) if ON_GPU else (False,)
    grid = generate.Grid(batches=[2], new_tokens=(3, 3), compiled=ways)
    generate.run(path, grid, prompt=32, device=DEVICE, dims=dims, repeats=1, progress=lambda _: None)
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["attention"] for r in rows] == ["flashattn2", "sdpa"] * len(ways)
    assert [r["left_pad"] for r in rows][:2] == ["2", "2"]  # the eager prompts are left-padded (32 // 16)
    assert generate.left_pads(5, 512) == [32, 16, 8, 4, 32]
    assert all(float(r["tokens_per_s"]) > 0 and r["note"] == "" for r in rows), rows
