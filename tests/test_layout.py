"""The package's layout as docs/architecture.md states it: imports run one way (no circle between
modules, nor between the package's folders and top-level modules) and no class outgrows one
sitting. (That the package never imports the repository's benchmarks: test_cli.)"""

import ast
from pathlib import Path

import pytest

import hf_polybasic

PACKAGE = Path(hf_polybasic.__file__).parent
LONGEST_CLASS = 260  # lines: "each class under about 250" (issue 37)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every hf_polybasic module ``path`` imports, at the top or inside a function, resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from package import module`` imports the module; ``from module import name``, the module
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "hf_polybasic")
    return found


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _graph(room) -> dict[str, set[str]]:
    """room(module) -> the rooms it imports (a module imported as ``pkg.name`` counts as ``pkg.name``
    where that is a module, else as ``pkg``)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for imported in _imports(path):
            while imported not in MODULES and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in MODULES and imported != "hf_polybasic":
                targets.add(room(imported))
        graph.setdefault(room(name), set()).update(targets - {room(name)})
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan)."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return circles


def _folder(module: str) -> str:
    """A module's room as docs/architecture.md draws the package: its folder under hf_polybasic, or
    the module itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2])


@pytest.mark.parametrize("room", [lambda module: module, _folder], ids=["modules", "folders"])
def test_imports_run_one_way(room):
    graph = _graph(room)
    assert len(graph) > 10 and sum(map(len, graph.values())) > 20  # it read the package
    assert _circles(graph) == []


def test_a_circle_is_seen():
    """Negative control: the same check finds a circle drawn into the graph."""
    graph = _graph(_folder)
    graph["hf_polybasic.compat"] = graph["hf_polybasic.compat"] | {"hf_polybasic.decoding"}
    assert any({"hf_polybasic.compat", "hf_polybasic.decoding"} <= set(circle) for circle in _circles(graph))


def test_no_class_outgrows_one_sitting():
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LONGEST_CLASS:
                long[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert long == {}
