"""The package's import layers (docs/design.md §1), read from the sources: a module imports only its own layer and
the layers below it, the two backends never import each other, and the one import upward is ``plan`` reaching
the ``cuda`` package inside a function (its compiled host pass)."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedwindow

PACKAGE = Path(pagedwindow.__file__).parent

# The layers of docs/design.md's diagram, bottom first; a unit is a top-level module or subpackage.
LAYERS = (
    {"settings", "errors", "semantics", "tiles", "layout", "gemma_prep", "plan"},
    {"reference", "cuda"},
    {"api"},
    {"kv_state", "testing", "__init__"},  # __init__: the package's public names, which hf imports
    {"hf"},
    {"measure"},
    {"viz"},
    {"report", "bench", "bench_prep", "bench_sweep", "cli", "__main__"},
)
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
UPWARD_INSIDE_FUNCTIONS = {("plan", "cuda")}


def _unit(parts: list[str]) -> str:
    """The unit a dotted name inside the package belongs to (``["cuda", "ops"]`` -> ``cuda``); a name imported
    from the package itself (``from pagedwindow import PagedWindowError``) belongs to ``__init__``."""
    if not parts:
        return "__init__"
    head = parts[0]
    return head if (PACKAGE / head).is_dir() or (PACKAGE / f"{head}.py").is_file() else "__init__"


def _imports(path: Path):
    """``(unit imported, inside a function)`` for every import of the package in ``path``."""
    rel = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(rel[:-1])  # the importing module's package, relative to pagedwindow
    tree = ast.parse(path.read_text())
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
        names: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            dotted = (node.module or "").split(".") if node.module else []
            if node.level:  # from .x import y, from .. import y
                module = package[: len(package) - (node.level - 1)] + dotted
            elif dotted[:1] == ["pagedwindow"]:  # from pagedwindow[.x] import y
                module = dotted[1:]
            else:
                continue
            names = [module] if module else [[a.name] for a in node.names]
            if node.module is None:  # from . import x, y: each name may be a module
                names = [module + [a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "pagedwindow"]
        yield from ((_unit(n), id(node) in inside) for n in names)


def _edges():
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
        for target, in_function in _imports(path):
            if target != unit:
                yield path.relative_to(PACKAGE), unit, target, in_function


def test_every_unit_of_the_package_has_a_layer():
    units = {_unit([p.stem]) for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    units -= {"__pycache__"}
    assert units <= set(LAYER_OF), sorted(units - set(LAYER_OF))


def test_imports_go_down_the_layers_only():
    wrong = [
        f"{path}: {unit} imports {target}"
        for path, unit, target, in_function in _edges()
        if LAYER_OF[target] > LAYER_OF[unit] and not (in_function and (unit, target) in UPWARD_INSIDE_FUNCTIONS)
    ]
    assert not wrong, wrong


def test_the_backends_never_import_each_other():
    pairs = {(unit, target) for _, unit, target, _ in _edges()}
    assert ("reference", "cuda") not in pairs and ("cuda", "reference") not in pairs


def test_the_rule_sees_the_imports_it_allows():
    """The reading of imports is live: the edges the design names are found, the upward one inside a function."""
    edges = {(unit, target, in_function) for _, unit, target, in_function in _edges()}
    assert ("api", "reference", False) in edges and ("cuda", "plan", False) in edges
    assert ("plan", "cuda", True) in edges and ("plan", "cuda", False) not in edges
    assert ("hf", "__init__", False) in edges  # ``from .. import PagedWindowError``-style names
