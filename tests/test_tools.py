"""The maintained tools (tools/README.md) on the CPU: each one listed, and each that has no test of its own run
for real where that is cheap (bars, baseline_pkg, ptx_hash, plan_hash, host_ab, ncu_profile --summarize, gpu_session.sh), else
started with --help (the GPU tools). Others: test_compile_targets.py (compile_check), test_sass_loops.py,
test_ncu_sass.py, test_protocol_model.py (fwd_ring_model, bwd_ring_model)."""

import csv
import ctypes.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, skip_without_interpreter

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))


def _env(**extra):
    """The environment of a tool run in a subprocess: the source tree first, no interpreter flag (ptx_hash
    compiles for sm_90, which TRITON_INTERPRET forbids; the --help runs do not care)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_readme_lists_every_tool():
    """tools/README.md has a row for each file in tools/ and no row for a file that is gone."""
    listed = set(re.findall(r"^\| `([\w.]+)` \|", (TOOLS / "README.md").read_text(), re.M))
    present = {p.name for p in TOOLS.iterdir() if p.is_file() and p.name != "README.md"}
    assert listed == present


def test_bars_counts_points_and_misses(tmp_path, capsys):
    import bars

    fields = [
        "provider",
        "dtype",
        "headdim",
        "causal",
        "seqlen",
        "batch",
        "nheads",
        "nheads_k",
        "mode",
        "ms",
        "tflops",
        "peak_mib",
        "note",
        "gpu",
        "torch",
        "triton",
        "date",
        "git_sha",
    ]
    rows = [
        ("flashattn2", 128, 300.0),
        ("sdpa_cudnn", 128, 400.0),
        ("sdpa_flash", 128, 200.0),
        ("flashattn2", 64, 420.0),
        ("sdpa_cudnn", 64, 400.0),
        ("sdpa_flash", 64, 400.0),
    ]
    path = tmp_path / "kernels.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fields)
        w.writeheader()
        for provider, d, tflops in rows:
            w.writerow(
                dict(
                    provider=provider,
                    dtype="fp16",
                    headdim=d,
                    causal=0,
                    seqlen=2048,
                    batch=8,
                    nheads=2048 // d,
                    nheads_k=2048 // d,
                    mode="fwd",
                    ms=1.0,
                    tflops=tflops,
                )
            )
    bars.main(str(path))
    out = capsys.readouterr().out
    assert "d64/d128 forward >= 0.9x cuDNN: 1/2" in out
    assert "fp16 d128 full fwd 2048: 0.750" in out  # the miss, listed
    assert ">= 1.2x SDPA flash: 1/2" in out  # d64 at 1.05x misses
    assert "(not a bar) >= 1.0x cuDNN: 1/2" in out and "fp16 d64 full fwd 2048: 1.050" in out


def test_baseline_pkg_builds_a_renamed_package(tmp_path, monkeypatch):
    """The committed package under another name: its custom ops in their own namespace, its imports of the
    package renamed, so both load in one process."""
    import baseline_pkg

    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (git archive)")
    monkeypatch.chdir(ROOT)
    root = pathlib.Path(baseline_pkg.main("HEAD", str(tmp_path), name="fa2_old"))
    assert (root / "__init__.py").is_file() and (root / "ops").is_dir()
    text = "\n".join(p.read_text() for p in root.rglob("*.py"))
    assert '"fa2_old::' in text and '"flashattn2::' not in text
    assert "torch.ops.flashattn2." not in text


def test_ptx_hash_compares_against_an_earlier_run(tmp_path):
    """A small kernel's configuration(s) hashed, against a file that has none of them: reported as changed, exit 1."""
    before = tmp_path / "before.jsonl"
    before.write_text(json.dumps({"id": "no such configuration", "sha": "0" * 16}) + "\n")
    run = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "ptx_hash.py"),
            "--arch",
            "sm90",
            "--match",
            "fill-tail",
            "--against",
            str(before),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert rows and run.returncode == 1, run.stderr[-2000:]
    assert all("fill-tail" in r["id"] and r["same"] is False for r in rows), rows
    assert all(re.fullmatch(r"[0-9a-f]{16}", r["sha"]) for r in rows), rows
    assert f"{len(rows)} configuration(s) differ" in run.stderr
    # against its own rows, an id written twice with two shas (compile_check can build two configurations under one
    # id): the n-th of an id is held to the n-th of the file's
    before.write_text("".join(json.dumps(dict(r, sha=sha)) + "\n" for r in rows for sha in (r["sha"], "0" * 16)))
    again = subprocess.run(run.args, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "0 configuration(s) differ" in again.stderr, again.stderr[-2000:]


def test_plan_hash_compares_against_an_earlier_run(tmp_path, capsys):
    """The plans of a slice of the grid written, then compared with themselves (the same: exit 0) and with a file in
    which one plan differs (reported with both plans: exit 1)."""
    import plan_hash

    picked = ["--arch", "sm90,interp", "--match", "d128/128"]  # attention calls and KV caches
    assert plan_hash.main(picked) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) > 20 and all("d128/128" in r["id"] for r in rows)
    assert {plan.split("(")[0] for r in rows for plan in r["plan"]} == {"Plan", "DecodePlan"}
    # the same call on two archs: another table's rows (sm90's tiles, or its Gluon kernels where this Triton runs
    # them, against the interpreter's one tile)
    plans = {r["id"]: r["plan"] for r in rows}
    assert any(
        plan != plans[case.replace("sm90", "interp", 1)] for case, plan in plans.items() if case.startswith("sm90")
    )
    before = tmp_path / "before.jsonl"
    before.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan_hash.main([*picked, "--against", str(before)]) == 0
    assert f"{len(rows)} calls with the same plan, 0 changed" in capsys.readouterr().out
    rows[3]["plan"] = ["Plan('fwd', 'another tile')"]
    before.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan_hash.main([*picked, "--against", str(before)]) == 1
    out = capsys.readouterr().out
    assert f"changed: {rows[3]['id']}" in out and "another tile" in out and "1 changed" in out


def test_host_ab_times_two_trees_on_one_core(capsys):
    """The same tree on both sides, two rounds of a few calls of the cases asked for: a row per case, medians and the
    rounds' B/A ratio with its spread."""
    import host_ab

    src = str(ROOT / "src")
    assert host_ab.main([src, src, "--rounds", "2", "--calls", "3", "--cases", "func forward,with_kvcache"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("case") and "2 rounds, core 0" in lines[0]
    rows = {line[:32].strip(): line[32:].split() for line in lines[1:]}
    assert set(rows) == {"func forward", "func forward + backward", "with_kvcache", "with_kvcache, append"}, rows
    for a, b, ratio, spread in rows.values():
        assert float(a) > 0 and float(b) > 0 and float(ratio) > 0 and re.fullmatch(r"\([0-9.]+-[0-9.]+\)", spread)


def test_ncu_profile_summarizes_a_report(tmp_path, capsys):
    import ncu_profile

    report = tmp_path / "ncu.txt"
    report.write_text(
        "==PROF== Connected\nPROFILED flashattn2:fp16:64:1:512\n"
        "  attn_fwd_persist_kernel (132, 1, 1)x(416, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n"
        "    Section: GPU Speed Of Light Throughput\n"
        "    Duration                         us       114.90\n"
        "    SM: Pipe Tensor Cycles Active     %        37.30\n"
        "    Registers Per Thread   register/thread          168\n"
        "    Stall Long Scoreboard      inst     3.14\n"
        "    Stall Barrier      inst     3.06\n"
    )
    ncu_profile.summarize(str(report))
    out = capsys.readouterr().out
    assert out.startswith("attn_fwd_persist_kernel")
    assert "Duration=114.90" in out and "Pipe Tensor Cycles Active=37.30" in out and "Registers Per Thread=168" in out
    assert "Issue Active=?" in out  # a metric the report lacks
    assert "stalls (cycles per issued instruction): Long Scoreboard 3.14, Barrier 3.06" in out


# Where a driver is installed the process can load the real libcuda.so.1 before the stub (torch's CUDA probe), and
# Triton's C launcher then binds the real driver, which sees no device here: the stub stands in where none is.
REAL_DRIVER = pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a real libcuda.so.1 is installed: the stub cannot displace it"
)


@pytest.mark.parametrize("c_launcher", [False, pytest.param(True, marks=REAL_DRIVER)])
def test_launch_host_times_each_path(c_launcher):
    """launch_host on one small kernel (compiled for sm_90, under the fake driver, with Triton's C launcher built
    against a stub libcuda or not): a time for Triton's own path, the Launch's direct call and the compiled kernel's
    run, on every release. No GPU visible to it (on a GPU machine torch would bring up the real driver beside the
    stub)."""
    run = subprocess.run(
        [sys.executable, str(TOOLS / "launch_host.py"), "--rounds", "1", "--n", "2", "--batches", "2"]
        + ["--cases", "fill-tail", "--json", "/dev/stdout"]
        + ["--c-launcher"] * c_launcher,
        capture_output=True,
        text=True,
        env=_env(CUDA_VISIBLE_DEVICES=""),
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert row["case"] == "fill_tail_kernel" and row["where"].startswith("CPU, fake driver")
    for path in ("triton", "launch", "run"):
        assert row[path]["median"] > 0, row
    assert isinstance(row["run-encoded"], str)  # no descriptors to encode


@pytest.mark.parametrize(
    "tool", ["overhead.py", "host_profile.py", "graph_fwd_bwd.py", "generate_profile.py", "fp8_lse_probe.py"]
)
def test_gpu_tools_start(tool):
    """The GPU-only tools import and parse their arguments on a machine without one."""
    run = subprocess.run(
        [sys.executable, str(TOOLS / tool), "--help"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:")


def test_gpu_session_rejects_an_unknown_stage(tmp_path):
    script = TOOLS / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(
        ["bash", str(script), "no-such-stage"],
        capture_output=True,
        text=True,
        env=_env(OUT=str(tmp_path), FLASHATTN2_GIT_SHA="abc"),
        timeout=60,
    )
    assert run.returncode == 2 and "unknown stage no-such-stage" in run.stdout
    assert "results recorded as git abc" in run.stdout


def _smoke_selection():
    """gpu_session.sh's smoke stage: its -k expression (SMOKE_TESTS, as bash builds it) and its test files."""
    script = TOOLS / "gpu_session.sh"
    text = script.read_text()
    lines = "\n".join(line for line in text.splitlines() if line.startswith("SMOKE_TESTS="))
    run = subprocess.run(
        ["bash", "-c", lines + '\nprintf %s "$SMOKE_TESTS"'], capture_output=True, text=True, timeout=60
    )
    files = re.search(r"^SMOKE_FILES=\((.*?)\)", text, re.S | re.M).group(1)
    assert '"${SMOKE_FILES[@]}"' in re.search(r"^\s*smoke\)(.*?);;", text, re.S | re.M).group(1)
    return run.stdout, re.findall(r"tests/\w+\.py", files)


def test_gpu_smoke_selects_every_family():
    """The smoke stage's selection collects (a renamed test would drop its family from every GPU session's first
    check unseen): each of its -k terms selects at least one test of its files."""
    from _pytest.mark.expression import Expression

    expression, files = _smoke_selection()
    assert expression and len(files) >= 6
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    run = subprocess.run(collect, capture_output=True, text=True, env=_env(**_interpreter()), cwd=ROOT, timeout=300)
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    assert run.returncode == 0 and ids, run.stdout[-3000:] + run.stderr[-3000:]

    def selects(term, node):  # pytest's -k: a name matches a substring of the node's names, case-insensitively
        names = [pathlib.Path(node.split("::")[0]).stem, *node.split("::")[1:]]
        return Expression.compile(term).evaluate(lambda name: any(name.lower() in n.lower() for n in names))

    terms = [t.strip() for t in re.split(r"\s+or\s+(?![^(]*\))", expression)]
    assert len(terms) >= 10
    for term in terms:
        assert any(selects(term, node) for node in ids), f"smoke's -k term {term!r} selects no test"
    chosen = [node for node in ids if selects(expression, node)]
    assert len(chosen) >= 80, len(chosen)  # (140 on the CPU; a GPU's parameters make it 634, 127 s on a fresh H100)


def _interpreter():
    """TRITON_INTERPRET as this process has it (collection imports the kernels' modules either way)."""
    return {"TRITON_INTERPRET": os.environ["TRITON_INTERPRET"]} if "TRITON_INTERPRET" in os.environ else {}


def test_fuzz_runs_for_its_time_and_replays_a_case():
    """tools/fuzz.py on the CPU (a process of its own with the interpreter on and no GPU visible, so that it runs
    alike on a GPU machine, where this process imported triton without the interpreter): a run of under a second
    prints its seed and count, and --case replays one case alone, printing it."""
    skip_without_interpreter()
    env = _env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    fuzz = [sys.executable, str(TOOLS / "fuzz.py"), "--device", "cpu", "--seed", "5", "--functions", "kvcache"]
    run = subprocess.run(fuzz + ["--seconds", "0.2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    out = run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fuzz seed=5 on cpu" in out and re.search(r"fuzz seed=5: [1-9]\d* cases in \d+ s, 0 failed", out), out
    run = subprocess.run(fuzz + ["--case", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("Case(fn='kvcache'") and "case 5:1 passed" in run.stdout, run.stdout


def test_generate_profile_decodes_both_attentions():
    """generate_profile's decoder on a tiny model: a left-padded prefill, then steps over the growing dynamic cache,
    on flashattn2 and on sdpa, greedy tokens of the right shape; a new prefill starts over."""
    pytest.importorskip("transformers")
    import generate_profile

    dims = dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    for attention in ("flashattn2", "sdpa"):
        prefill, step = generate_profile.decoder(attention, batch=2, prompt=16, dims=dims, device=DEVICE)
        prefill()
        tokens = [step() for _ in range(2)]
        assert all(t.shape == (2, 1) and t.dtype == torch.long for t in tokens)
        prefill()
        assert torch.equal(step(), tokens[0])  # the same prompt and weights: the same first token


def test_fp8_lse_probe_reports_each_headdim(capsys, monkeypatch):
    """fp8_lse_probe on a small shape: a line per head dim and mask, and a seed's row each, with the interpreter's
    exact dots an lse error at fp32's level (the bf16 yardstick too)."""
    import fp8_lse_probe

    monkeypatch.setattr(sys, "argv", ["fp8_lse_probe", "--seeds", "1", "--shape", "1,5,9,2,1", "--headdims", "32"])
    fp8_lse_probe.main()
    out = capsys.readouterr().out
    assert re.findall(r"^d32 (full|causal) 1x5x9 h2/1:$", out, re.M) == ["full", "causal"]
    errors = [float(e) for e in re.findall(r"err ([0-9.e+-]+) \(", out)]
    bf16 = [float(e) for e in re.findall(r"bf16 path err ([0-9.e+-]+)", out)]
    assert len(errors) == len(bf16) == 2 and max(errors) < 1e-4 and max(bf16) < 1e-4, out
