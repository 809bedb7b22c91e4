"""The package reads top-down (docs/design.md, Layers): every import points to a lower layer or
its own, no import cycle, no dptrain import deferred into a function outside the CLI, and only
`tagi/ddp.py` of the TAGI engine touches the process-group code.

The imports are read from the sources with `ast`, so the test sees what a reader sees: an
import hidden in a function to dodge a cycle counts as the arrow it is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import dptrain

LAYERS = ("runtime", "launcher", "data", "tagi", "pytagi", "models", "learners", "train", "generation",
          "inference", "export", "tune",
          "cli")
"""Bottom to top; a module may import its own layer and those listed before it."""
FOUNDATION = ("dptrain._version", "dptrain.errors", "dptrain.fingerprint", "dptrain.options",
              "dptrain.user_code")
"""Leaf modules every layer may import; they import nothing of dptrain above them."""
FACE = ("dptrain", "dptrain.__main__", "dptrain.dist")
"""The package's own re-exports, `python -m dptrain` and the deprecated alias of `dptrain.runtime`:
above everything."""


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    in_function: bool
    type_only: bool


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(module: str, imported: str | None, level: int, importer: str,
             is_package: bool) -> str:
    if level == 0:
        return module
    base = importer.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


def imports(names: dict[str, Path], package: str) -> list[Import]:
    """Every import of a `package` module by a `package` module, with where it sits."""
    found = []
    for importer, path in names.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        found += _imports_of(tree, importer, is_package, names, package)
    return found


def _imports_of(tree: ast.Module, importer: str, is_package: bool, names: dict[str, Path],
                package: str) -> list[Import]:
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module or "", None, node.level, importer, is_package)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.append(sub if sub in names else module)
        for target in targets:
            if target == package or target.startswith(package + "."):
                out.append(Import(importer, target, node.lineno, in_function, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_only)

    visit(tree, False, False)
    return out


def layer(module: str) -> int:
    if module in FOUNDATION:
        return -1
    if module in FACE:
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def upward_arrows(found: list[Import]) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.target}" for i in found
            if layer(i.target) > layer(i.importer)]


def deferred_imports(found: list[Import]) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.target} inside a function" for i in found
            if i.in_function and layer(i.importer) != LAYERS.index("cli")]


def cycles(found: list[Import]) -> list[list[str]]:
    """Strongly connected groups of modules (size > 1, or a module importing itself) in the
    graph of imports that run when a module is imported."""
    graph: dict[str, set[str]] = {}
    for i in found:
        if not i.in_function and not i.type_only:
            graph.setdefault(i.importer, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


ROOT = Path(dptrain.__file__).parent
FOUND = imports(module_names(ROOT, "dptrain"), "dptrain")


def test_every_import_points_down():
    assert FOUND, "the scan found no imports at all: the test would pass on anything"
    assert upward_arrows(FOUND) == []


def test_no_import_cycle():
    assert cycles(FOUND) == []


def test_no_dptrain_import_is_deferred_into_a_function_outside_the_cli():
    assert deferred_imports(FOUND) == []


def test_only_the_ddp_wrapper_of_the_tagi_engine_touches_the_process_group():
    reaching = sorted({i.importer for i in FOUND
                       if i.importer.startswith("dptrain.tagi")
                       and i.target.startswith("dptrain.runtime")})
    assert reaching == ["dptrain.tagi.ddp"]


@pytest.fixture
def bad_package(tmp_path: Path) -> Path:
    """A package with one of each defect: an upward arrow, a cycle, a deferred import."""
    root = tmp_path / "dptrain"
    for sub in ("runtime", "data", "train", "cli"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "runtime" / "a.py").write_text("from dptrain.train import b\n")
    (root / "train" / "b.py").write_text("from dptrain.runtime import a\n")
    (root / "data" / "c.py").write_text("def f():\n    from dptrain.runtime import a\n")
    (root / "cli" / "d.py").write_text("def f():\n    from dptrain.train import b\n")
    return root


def test_the_checks_catch_each_defect(bad_package):
    """The checks above are only as good as their scanner: it must see each kind of defect."""
    found = imports(module_names(bad_package, "dptrain"), "dptrain")
    assert upward_arrows(found) == ["dptrain.runtime.a:1 imports dptrain.train.b"]
    assert cycles(found) == [["dptrain.runtime.a", "dptrain.train.b"]]
    assert deferred_imports(found) == [
        "dptrain.data.c:2 imports dptrain.runtime.a inside a function"]
