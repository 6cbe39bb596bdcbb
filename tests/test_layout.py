"""The dependency direction of STYLE.md: modules -> api -> ops -> kernels; the reference stands
alone; kernels import no torch."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "src" / "flashattn2"


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = "." * node.level
            names.add(prefix + (node.module or ""))
    return names


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("kernels", ("torch", "..ops", "..api", "..reference", "flashattn2")),
        ("reference", ("..kernels", "..ops", "triton", "flashattn2.kernels", "flashattn2.ops")),
        ("ops", ("..api", "flashattn2.api", "..modules", "flashattn2.modules")),
        # the layers use the public API, never the launchers or kernels behind it
        ("modules", ("..ops", "..kernels", "flashattn2.ops", "flashattn2.kernels")),
        # context parallelism runs blocks through the ops (no autograd per block), never the kernels themselves
        ("parallel", ("..kernels", "flashattn2.kernels", "..modules", "flashattn2.modules")),
    ],
)
def test_dependency_direction(folder, forbidden):
    for path in (PKG / folder).glob("*.py"):
        bad = {n for n in imports(path) if any(n == f or n.startswith(f + ".") for f in forbidden)}
        assert not bad, f"{path.name} imports {sorted(bad)}"
