"""No import cycles in ``vllm_hybrid``, and the layers' dependencies point one way.

The graph is built from the AST of every module of the package: an edge ``a -> b`` for each
``import b`` / ``from b import x`` in ``a`` (``from p import m`` is an edge to ``p.m`` when
``p.m`` is a module of the package, else to ``p``; relative imports resolved). Imports inside
functions count like module-level ones: a deferred import only hides a cycle until the
function runs, and a module that needs its importer back has two jobs tangled. Imports under
``if TYPE_CHECKING:`` are left out (they never run). An import of ``p.m`` is an edge to
``p.m`` only, not to the packages ``p`` it passes through: a package's ``__init__`` that
re-exports its submodules would otherwise be in a cycle with every one of them.

Layering (DESIGN.md section 3): ``core`` and ``sim`` import nothing above them (``core``
nothing outside ``core``, ``sim`` only ``core``), and ``adapters`` never import
``serving`` (the serving layer sits above the adapter; its registration point is ``cli.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_hybrid"


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)  # the else branch runs
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def import_graph(package: Path = PACKAGE, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    paths = {module_of(p, root): p for p in sorted(package.rglob("*.py"))}
    top = package.name
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text())):
            for target in _targets(node, module, is_package, paths):
                if target.split(".")[0] == top and target in paths and target != module:
                    graph[module].add(target)
    return graph


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in known else base)
    return out


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each one has cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component."""
    return [_path_in(graph, set(c)) for c in components(graph)]


def _path_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the component's first module, by breadth-first search."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {component}")


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [
        f"{' -> '.join(cycle)}  (modules in a cycle together: {', '.join(component)})"
        for cycle, component in zip(cycles(graph), components(graph), strict=True)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_layers_depend_one_way() -> None:
    graph = import_graph()
    allowed = {
        "vllm_hybrid.core": ("vllm_hybrid.core",),
        "vllm_hybrid.sim": ("vllm_hybrid.core", "vllm_hybrid.sim"),
        "vllm_hybrid.adapters": ("vllm_hybrid.core", "vllm_hybrid.adapters", "vllm_hybrid.ops"),
    }
    bad = []
    for module, targets in sorted(graph.items()):
        for layer, ok in allowed.items():
            if module == layer or module.startswith(layer + "."):
                bad += [
                    f"{module} -> {t}"
                    for t in sorted(targets)
                    if not any(t == o or t.startswith(o + ".") for o in ok) and t != "vllm_hybrid"
                ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_graph_sees_cycles_through_function_imports(tmp_path: Path) -> None:
    """A probe package: a cycle closed by an import inside a function is found; one closed only
    under ``if TYPE_CHECKING:`` is not; relative imports resolve."""
    pkg = tmp_path / "probe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("from probe.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nimport probe.d\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import probe.c\n"
    )
    graph = import_graph(pkg, tmp_path)
    assert graph["probe.sub"] == {"probe.sub.b"} and graph["probe.c"] == {"probe.d"}
    assert graph["probe.d"] == set()
    assert cycles(graph) == [["probe.a", "probe.sub.b", "probe.a"]]
