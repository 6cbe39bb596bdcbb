"""GPU-only tests rot unseen on a CPU: they are collected here (every test module imports on the CPU), but their bodies
never run. So every attribute a test module reads from a flashattn2 module (`launch_gluon.NAME`,
`flashattn2.ops.planning.dense._GRID_YZ`), imports from one (`from flashattn2.x import NAME`, in a test's body too) or
patches by name (`monkeypatch.setattr(module, "NAME", ...)`, `monkeypatch.setattr("flashattn2.x.NAME", ...)`) must
exist: a rename then fails CI here, not the next session that has a GPU. Attributes of other objects (a call's
fields) are not checked: only a run sees them."""

import ast
import importlib
import pathlib
import types

import pytest

TESTS = pathlib.Path(__file__).parent
FILES = sorted(p for p in TESTS.glob("*.py") if p.name != "conftest.py")


def _imported_modules(tree: ast.Module, missing: list[str]) -> dict[str, types.ModuleType]:
    """The names a file binds to flashattn2 modules (`import flashattn2`, `from flashattn2.ops.launch import
    launch_gluon`, `import flashattn2.flash_attn_interface as fai`), at its top level or in a test's body; a name `from
    flashattn2... import NAME` asks of a module that lacks it goes to `missing`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flashattn2":
                    path = alias.name if alias.asname else "flashattn2"
                    names[alias.asname or "flashattn2"] = importlib.import_module(path)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flashattn2":
            for alias in node.names:
                try:  # a submodule (imported by the statement, an attribute of its package only then)
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                except ModuleNotFoundError:
                    value = getattr(importlib.import_module(node.module), alias.name, _MISSING)
                if value is _MISSING:
                    missing.append(f"{node.lineno}: {node.module}.{alias.name}")
                elif isinstance(value, types.ModuleType):
                    names[alias.asname or alias.name] = value
    return names


_MISSING = object()


def _resolve(node: ast.AST, modules: dict[str, types.ModuleType]):
    """The module a Name / dotted Attribute chain of modules names, else None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, modules)
        value = getattr(base, node.attr, None) if base is not None else None
        return value if isinstance(value, types.ModuleType) else None
    return None


def missing_references(source: str) -> list[str]:
    """'line: module.attr' for each attribute the source reads from, or patches by name on, a flashattn2 module that
    the module does not have."""
    tree = ast.parse(source)
    missing = []
    modules = _imported_modules(tree, missing)
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            target = (node.value, node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target = (node.args[0], node.args[1].value)
        elif (  # monkeypatch.setattr("flashattn2.module.NAME", value)
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith("flashattn2.")
        ):
            path, _, name = node.args[0].value.rpartition(".")
            if not hasattr(importlib.import_module(path), name):
                missing.append(f"{node.lineno}: {node.args[0].value}")
        if target is None:
            continue
        module = _resolve(target[0], modules)
        if module is not None and not hasattr(module, target[1]):
            missing.append(f"{node.lineno}: {module.__name__}.{target[1]}")
    return missing


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_flashattn2_attribute_a_test_reads_exists(path):
    assert not missing_references(path.read_text()), missing_references(path.read_text())


def test_the_check_finds_a_renamed_attribute():
    source = (
        "from flashattn2.ops.launch import launch_gluon\n"
        "import flashattn2\n"
        "def test(monkeypatch):\n"
        "    monkeypatch.setattr(launch_gluon, 'BWD_PLANS', {})\n"
        "    flashattn2.ops.planning.dense.NO_SUCH\n"
        "    launch_gluon.ForwardLaunch\n"
        "    from flashattn2.ops.launch.launch_gluon import GONE\n"
        "    monkeypatch.setattr('flashattn2.ops.request.checks.NOT_THERE', 1)\n"
    )
    assert sorted(missing_references(source)) == [
        "4: flashattn2.ops.launch.launch_gluon.BWD_PLANS",
        "5: flashattn2.ops.planning.dense.NO_SUCH",
        "7: flashattn2.ops.launch.launch_gluon.GONE",
        "8: flashattn2.ops.request.checks.NOT_THERE",
    ]
