"""examples/gpt/train.py runs end to end (--smoke: a tiny model, a few steps): corpus, training,
the loss curve, sampling through the KV cache."""

import importlib.util
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE, skip_without_interpreter

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpt_example_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "gpt" / "train.py"),
            "--smoke",
            "--device",
            DEVICE,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram entropy" in proc.stdout, proc.stdout[-2000:]
    assert "sample (a few steps teach the model nothing: unreadable bytes are expected):\ndef " in proc.stdout
    assert "train.py: on the CPU" not in proc.stderr  # --smoke: no warning
    result = _result(tmp_path)
    assert float(result["val_loss"]) > 0 and float(result["steps"]) == 3
    if importlib.util.find_spec("matplotlib") is not None:  # the loss curve needs it
        assert (tmp_path / "loss.png").stat().st_size > 1000


def _train_module():
    spec = importlib.util.spec_from_file_location("gpt_train", ROOT / "examples" / "gpt" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt_example_warns_of_the_full_model_on_the_cpu():
    """Without --smoke on the CPU the default model takes minutes a step through the interpreter: the script says so
    (and how to get the smoke run) before it starts; --smoke and a GPU start without a word."""
    train = _train_module()
    warning = train.cpu_warning(train.parse_args([]), torch.device("cpu"))
    assert warning and "--smoke" in warning and "interpreter" in warning
    assert train.cpu_warning(train.parse_args(["--smoke"]), torch.device("cpu")) is None
    assert train.cpu_warning(train.parse_args([]), torch.device("cuda")) is None


def test_gpt_example_output_is_ignored_by_git():
    """The run's default --out, examples/gpt/out/ (result.txt, loss.png), stays out of `git status`."""
    out = pathlib.Path(_train_module().parse_args([]).out)
    assert out == ROOT / "examples" / "gpt" / "out"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for name in ("result.txt", "loss.png"):
        rel = (out / name).relative_to(ROOT)
        assert subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=ROOT).returncode == 0, rel


def _result(out_dir) -> dict:
    return dict(line.split(" ", 1) for line in (out_dir / "result.txt").read_text().splitlines())


def test_gpt_example_context_parallel_loss_matches_one_process(tmp_path):
    """--context-parallel 2 under torchrun (gloo, the CPU interpreter): every step's loss is the single process's."""
    skip_without_interpreter()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    script = str(ROOT / "examples" / "gpt" / "train.py")
    common = ["--smoke", "--device", "cpu", "--sample-tokens", "1"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = {
        "one": [sys.executable, script, *common],
        "two": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
        + [script, *common, "--context-parallel", "2"],
    }
    losses = {}
    for name, cmd in runs.items():
        out = tmp_path / name
        proc = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        losses[name] = [float(x) for x in _result(out)["losses"].split()]
    assert len(losses["one"]) == 3
    for step, (a, b) in enumerate(zip(losses["one"], losses["two"])):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: loss {b} with two ranks, {a} in one process"


def test_gpt_example_help_gives_every_option_a_help_and_default(capsys):
    """train.py --help: each option with a line of help and its default (and what --smoke sets it to)."""
    train = _train_module()
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    options = [o for o in re.findall(r"\[(--[\w-]+)", text.split("\n\n")[0])]
    assert len(options) >= 17, options
    blocks = re.split(r"\n  (?=--)", text.split("options:", 1)[1])
    described = {b.split()[0]: b for b in blocks if b.startswith("--")}
    for option in options:
        block = described[option]
        assert "(default:" in block and len(block.split("(default:")[0].split()) >= 3, block
