"""No module of kvtier reads another object's private attributes.

An attribute access ``X._name`` (one leading underscore, not a dunder) is allowed only
where ``X`` is ``self``, ``cls`` or ``super()``: an object's private state is its own, and
what another part needs from it is a public (or package-internal, plainly named) method
or attribute. Enforced on the AST of every module under ``kvtier/``, as
``tests/test_architecture.py`` enforces the import rules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"
SOURCES = sorted(PACKAGE.rglob("*.py"))
OWN = frozenset({"self", "cls"})

#: ``module path: dotted access`` -> why it cannot be public. Only a third-party library's
#: private module where it offers no public path to what is needed.
ALLOWED: dict[str, str] = {
    "kvtier/backends/filestore/extension.py: xxhash._xxhash": (
        "the compiled loop binds XXH3 from the shared library the xxhash package ships; "
        "xxhash has no public name for that extension module or its file"
    ),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object whose private attributes these are."""
    if isinstance(node, ast.Name):
        return node.id in OWN
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
        and not node.args
    )


def _private_accesses(source: str) -> list[tuple[int, str]]:
    """(line, ``X._name``) for every private attribute read or written on another object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_own(node.value):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_rule_itself() -> None:
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x = other._y\n"
        "        super()._z()\n"
        "        cls._w\n"
        "        other.__class__\n"
        "        other.public._hidden\n"
        "        mod._private_mod.attr\n"
    )
    assert _private_accesses(source) == [
        (3, "other._y"),
        (7, "other.public._hidden"),
        (8, "mod._private_mod"),
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_reads_another_objects_private_attributes(path: Path) -> None:
    where = str(path.relative_to(ROOT))
    bad = [
        f"{where}:{line}: {access}"
        for line, access in _private_accesses(path.read_text(encoding="utf-8"))
        if f"{where}: {access}" not in ALLOWED
    ]
    assert not bad, (
        f"private attributes of another object read in {where}: {bad}; give the owner a "
        "public (or plainly named package-internal) method or attribute, or pass what is "
        "needed in (a callback, a narrow object)"
    )


def test_every_allowance_is_still_needed() -> None:
    used = set()
    for path in SOURCES:
        where = str(path.relative_to(ROOT))
        used |= {f"{where}: {access}" for _, access in _private_accesses(path.read_text())}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowances no longer needed (remove them from ALLOWED): {stale}"
