"""Build an older commit's package under another name, so a bench can load both in one process:

    python tools/baseline_pkg.py 5391211 .devout/base     # writes .devout/base/flashattn2_base
    PYTHONPATH=src:.devout/base python -m flashattn2 bench features --baseline flashattn2_base

The package's imports are relative; only its custom-op namespace (flashattn2::) is renamed."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile


def main(sha: str, dest: str, name: str = "flashattn2_base") -> str:
    blob = subprocess.run(["git", "archive", sha, "src/flashattn2"], capture_output=True, check=True).stdout
    root = os.path.join(dest, name)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = os.path.relpath(member.name, "src/flashattn2")
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = tar.extractfile(member).read()
            if rel.endswith(".py"):
                text = data.decode()
                text = text.replace('"flashattn2::', f'"{name}::').replace(
                    "torch.ops.flashattn2.", f"torch.ops.{name}."
                )
                text = text.replace("import flashattn2\n", f"import {name} as flashattn2\n")
                data = text.encode()
            with open(path, "wb") as fh:
                fh.write(data)
    return root


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print("wrote", main(*sys.argv[1:]))
