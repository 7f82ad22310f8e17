"""Nothing outside ``engine/llm.py`` touches a private member of ``engine.llm.LLM``.

The serving runtime, the server, the CLI, the benchmarks and the tests reach the engine's
request steps through its public API (``LLM.lifecycle``, :mod:`engine.request_lifecycle`), not
through ``llm._something``. This test reads the code, it does not run it:

* **Which names.** The private members of ``LLM`` are collected from its class body in
  ``engine/llm.py`` with :mod:`ast`: every method, property or class attribute whose name has one
  leading underscore (dunders such as ``__init__`` are public protocol), and every
  ``self._name = ...`` (plain, annotated, augmented or unpacked) in its methods.
* **Which accesses.** Every ``X._name`` attribute access (read, write or delete) in every ``.py``
  file under the scanned folders except ``engine/llm.py``, and every
  ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` / ``monkeypatch.setattr`` whose second
  argument is the string ``"_name"``.
* **False positives.** Types are not known statically, so only names that are private members
  of ``LLM`` are flagged (another class's ``_run`` through some other receiver is flagged only if
  ``LLM`` also has a ``_run``; then rename one of them). ``self._name`` / ``cls._name`` inside a
  class that is not ``LLM`` and does not derive from it is that class's own member and is not
  flagged; in a subclass of ``LLM`` it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("engine", "kernels", "agent", "alerts", "dashboard", "kvscope", "benchmarks", "tests")
LLM_FILE = Path("engine") / "llm.py"
LLM_CLASS = "LLM"
ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _stored_names(target: ast.expr) -> list[ast.expr]:
    """The single targets inside an assignment target (``a, (b, c) = ...`` → a, b, c)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [n for t in target.elts for n in _stored_names(t)]
    if isinstance(target, ast.Starred):
        return _stored_names(target.value)
    return [target]


def llm_private_members(source: str, class_name: str = LLM_CLASS) -> frozenset[str]:
    """Private member names of class ``class_name`` in ``source``: its methods, properties and
    class attributes with one leading underscore, and the ``self._x`` its methods assign.

    Raises:
        LookupError: ``source`` defines no class ``class_name`` at module level.
    """
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"no class {class_name} at module level")
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for target in stmt.targets for t in _stored_names(target) if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _stored_names(target)]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return frozenset(n for n in names if _is_private(n))


def _derives_from(cls: ast.ClassDef, class_name: str) -> bool:
    return cls.name == class_name or any(
        (isinstance(b, ast.Name) and b.id == class_name) or (isinstance(b, ast.Attribute) and b.attr == class_name)
        for b in cls.bases
    )


class _Finder(ast.NodeVisitor):
    """Collects ``(line, text)`` of every access to one of ``private`` (module docstring)."""

    def __init__(self, private: frozenset[str], class_name: str) -> None:
        self.private = private
        self.class_name = class_name
        self.classes: list[ast.ClassDef] = []
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)
        self.classes.pop()

    def _own_member(self, receiver: ast.expr) -> bool:
        """``self.x`` / ``cls.x`` inside a class unrelated to ``LLM``: that class's own member."""
        return (
            isinstance(receiver, ast.Name)
            and receiver.id in ("self", "cls")
            and bool(self.classes)
            and not _derives_from(self.classes[-1], self.class_name)
        )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.private and not self._own_member(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        by_name = (isinstance(f, ast.Name) and f.id in ATTR_FUNCTIONS) or (isinstance(f, ast.Attribute) and f.attr == "setattr")
        if by_name and len(node.args) >= 2:
            receiver, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and name.value in self.private and not self._own_member(receiver):
                self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def private_accesses(root: Path, private: frozenset[str], folders: tuple[str, ...] = SCANNED, exempt: Path = LLM_FILE) -> list[str]:
    """``path:line: code`` for every access to one of ``private`` in the ``.py`` files under
    ``root / folder`` for each of ``folders``, except ``root / exempt``; sorted by path and line.

    Raises:
        SyntaxError: a file that does not parse (named in the error).
    """
    out: list[str] = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == exempt:
                continue
            finder = _Finder(private, LLM_CLASS)
            finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(rel)))
            out += [f"{rel}:{line}: {text}" for line, text in sorted(finder.found)]
    return out


def test_nothing_outside_llm_py_touches_llm_privates() -> None:
    private = llm_private_members((ROOT / LLM_FILE).read_text(encoding="utf-8"))
    found = private_accesses(ROOT, private)
    assert not found, "private members of LLM used outside engine/llm.py (use its public API):\n" + "\n".join(found)


PLANTED_LLM = '''
class Helper:
    def _helper_only(self): ...

class LLM:
    _table = {}
    def __init__(self):
        self._state = 0
        self.public = 1
        self._a, (self._b, self.c) = 1, (2, 3)
        self._count: int = 0
    def _step(self): ...
    @property
    def _view(self): ...
    def __len__(self): return 0
'''

PLANTED_USER = """\
import engine.llm

def use(llm, engine):
    llm.public
    llm._step()
    engine.llm_holder._state = 3
    llm.__len__()
    llm._helper_only()
    getattr(llm, "_view")
    monkeypatch.setattr(llm, "_a", None)
    hasattr(llm, "public")

class Runtime:
    def run(self):
        self._step()
        self.llm._count += 1

class Traced(engine.llm.LLM):
    def go(self):
        self._table
"""


def test_the_checker_flags_a_planted_violation(tmp_path: Path) -> None:
    """A fake ``engine/llm.py`` and a user of it in a temporary tree: exactly the accesses to
    the fake ``LLM``'s private members are reported, with their file and line."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "llm.py").write_text(PLANTED_LLM + "\nllm = LLM()\nllm._state\n")  # exempt file
    (tmp_path / "engine" / "user.py").write_text(PLANTED_USER)
    private = llm_private_members(PLANTED_LLM)
    assert private == {"_table", "_state", "_a", "_b", "_count", "_step", "_view"}
    assert private_accesses(tmp_path, private, folders=("engine",)) == [
        "engine/user.py:5: llm._step",
        "engine/user.py:6: engine.llm_holder._state",
        "engine/user.py:9: getattr(llm, '_view')",
        "engine/user.py:10: monkeypatch.setattr(llm, '_a', None)",
        "engine/user.py:16: self.llm._count",
        "engine/user.py:20: self._table",
    ]
