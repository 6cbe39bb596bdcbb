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


# ops/ in the order a call goes through it; _runtime.py lies beneath every step
STEPS = ("request", "planning", "launch", "run")


def absolute_imports(path: pathlib.Path) -> set[str]:
    """The modules a file imports, relative imports resolved (`from .. import planning` in ops/run/call.py:
    flashattn2.ops.planning), and each name a from-import takes as if it were a module (it may be one)."""
    package = path.parent.relative_to(PKG.parent).parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def step(module: str) -> int | None:
    """A module's step in ops/ (-1: _runtime.py, beneath them all), None outside ops/ or for ops/ itself."""
    parts = module.split(".")
    if parts[:2] != ["flashattn2", "ops"] or len(parts) < 3:
        return None
    return STEPS.index(parts[2]) if parts[2] in STEPS else -1


def test_ops_steps_run_one_way():
    """Each step of ops/ imports only the steps before it (a later one never, so no circle between them) and never
    the API or the layers above ops/."""
    paths = sorted((PKG / "ops").rglob("*.py"))
    assert {p.parent.name for p in paths} == {"ops", *STEPS}, "a new folder in ops/: give it a place in STEPS"
    for path in paths:
        module = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        own = step(module.removesuffix(".__init__"))
        names = absolute_imports(path)
        above = {n for n in names if n.startswith(("flashattn2.api", "flashattn2.modules"))}
        assert not above, f"{module} imports {sorted(above)}"
        if own is not None:
            later = {n for n in names if (step(n) is not None and step(n) > own)}
            assert not later, f"{module} (step {own}) imports later steps: {sorted(later)}"


def test_no_file_over_600_lines():
    """Every Python file of the package and of the tests fits one reading: at most 600 lines (split by step or by
    subject past that, as ops/ and the fuzzer are)."""
    root = PKG.parents[1]
    files = [*PKG.rglob("*.py"), *(root / "tests").rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > 600}
    assert len(files) > 100 and not long, long


def test_kvcache_sizes_at_a_call_are_replace():
    """kvcache._AtCall (a call's int cache_seqlens and limit into the decode and append kernels' sizes, built as one
    tuple) makes what NamedTuple._replace makes, whatever fields stand around those two."""
    from flashattn2.kernels.append import AppendShape
    from flashattn2.kernels.decode import DecodeShape
    from flashattn2.ops.launch.kvcache import _AtCall

    for cls in (DecodeShape, AppendShape):
        sizes = cls(*range(100, 100 + len(cls._fields)))
        got = _AtCall(sizes)(7, 9)
        assert type(got) is cls and got == sizes._replace(cache_seqlen=7, seqlen_limit=9)
