"""No import cycles among the modules of ``engine/`` and ``kernels/``.

Every import statement counts, at module level or inside a function or method (a deferred
import hides a cycle from Python, not from the layering), except those under an
``if TYPE_CHECKING:`` block (they never run). ``import a.b`` is an edge to ``a.b``;
``from a import b`` is an edge to ``a.b`` when that is a module and to ``a`` otherwise;
relative imports are resolved against the importing module. A package's ``__init__.py`` is the
module named after the package. Edges to modules outside the scanned packages are dropped.

The cycles are the strongly connected components of that graph with more than one module (or
one module importing itself), found with Tarjan's algorithm.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file under ``root / package``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (their
    ``else`` branches do run, and are kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    yield stmt
                yield from _imports(stmt)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports(child)


def _imported_names(module: str, is_package: bool, stmt: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    """The dotted names one import statement in ``module`` imports."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            yield alias.name
        return
    if stmt.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        target = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        target = stmt.module or ""
    for alias in stmt.names:
        submodule = f"{target}.{alias.name}"
        yield submodule if submodule in known else target


def _resolve(name: str, known: set[str]) -> str | None:
    """``name`` if it is a scanned module, else its nearest scanned enclosing package (``import
    a.b.c`` where only ``a.b`` is a module), else None (outside the scanned packages)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module → the scanned modules it imports (module docstring for what counts)."""
    files = module_files(root, packages)
    known = set(files)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for stmt in _imports(tree):
            for name in _imported_names(module, is_package, stmt, known):
                target = _resolve(name, known)
                if target is not None:
                    graph[module].add(target)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative). Each component sorted, components sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle inside a strongly connected component, starting and ending at its
    first module (a breadth-first shortest path back to it)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def import_cycles(root: Path, packages: Iterable[str]) -> list[list[str]]:
    """Each import cycle among the scanned modules as a path ``[a, b, …, a]``, one per
    strongly connected component (a self-import is ``[a, a]``)."""
    graph = import_graph(root, packages)
    cycles = []
    for component in strongly_connected_components(graph):
        if len(component) > 1 or component[0] in graph[component[0]]:
            cycles.append(_cycle_through(component, graph))
    return cycles


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_engine_and_kernels_have_no_import_cycles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert "engine.config" in graph and "kernels.gated_delta_rule" in graph  # the scan found the tree
    cycles = import_cycles(ROOT, PACKAGES)
    components = [c for c in strongly_connected_components(graph) if len(c) > 1 or c[0] in graph[c[0]]]
    assert not cycles, (
        "import cycles (one per strongly connected component):\n"
        + format_cycles(cycles)
        + "\ncomponents:\n"
        + "\n".join(", ".join(c) for c in components)
    )


def test_checker_reports_exactly_the_real_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "alpha.py").write_text("from fake import beta\n")
    (pkg / "beta.py").write_text("def late():\n    from .alpha import thing\n    return thing\n")
    (pkg / "gamma.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import fake.alpha\n"
        "if TYPE_CHECKING:\n"
        "    from fake.gamma_user import User\n"
    )
    (pkg / "gamma_user.py").write_text("import fake.gamma\n")

    graph = import_graph(tmp_path, ["fake"])
    assert graph == {
        "fake": set(),
        "fake.alpha": {"fake.beta"},
        "fake.beta": {"fake.alpha"},
        "fake.gamma": {"fake.alpha"},
        "fake.gamma_user": {"fake.gamma"},
    }
    assert import_cycles(tmp_path, ["fake"]) == [["fake.alpha", "fake.beta", "fake.alpha"]]
    assert format_cycles(import_cycles(tmp_path, ["fake"])) == "fake.alpha -> fake.beta -> fake.alpha"


def test_from_package_import_name_is_an_edge_to_the_package(tmp_path: Path) -> None:
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from fake.sub.leaf import VALUE\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import VALUE\nfrom . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("VALUE = 1\nimport os\n")

    graph = import_graph(tmp_path, ["fake"])
    assert graph == {"fake": {"fake.sub.leaf"}, "fake.sub": {"fake", "fake.sub.leaf"}, "fake.sub.leaf": set()}
    assert import_cycles(tmp_path, ["fake"]) == []
