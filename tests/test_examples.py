"""examples/gpt/train.py runs end to end (--smoke: a tiny model, a few steps): corpus, training,
the loss curve, sampling through the KV cache."""

import importlib.util
import os
import pathlib
import subprocess
import sys

from conftest import DEVICE

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
    assert "unigram entropy" in proc.stdout and "sample:\ndef " in proc.stdout, proc.stdout[-2000:]
    result = dict(line.split() for line in (tmp_path / "result.txt").read_text().splitlines())
    assert float(result["val_loss"]) > 0 and float(result["steps"]) == 3
    if importlib.util.find_spec("matplotlib") is not None:  # the loss curve needs it
        assert (tmp_path / "loss.png").stat().st_size > 1000
