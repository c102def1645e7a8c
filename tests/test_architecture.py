"""The design's dependency rules, enforced: core/ imports nothing from backends/ or plugins/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"
FORBIDDEN_IN_CORE = (
    "kvtier.backends",
    "kvtier.plugins",
    "kvtier.cache",
    "kvtier.cli",
    "kvtier.integrations",
    "kvtier.testing",
)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_depends_on_nothing_above_it(path: Path) -> None:
    bad = [name for name in _imports(path) if name.startswith(FORBIDDEN_IN_CORE)]
    assert not bad, f"kvtier/core/{path.name} imports {bad}; core must stay at the bottom"


@pytest.mark.parametrize("path", sorted((PACKAGE / "backends").glob("*.py")), ids=lambda p: p.name)
def test_backends_use_only_core_and_the_hook_markers(path: Path) -> None:
    allowed_plugins = {"kvtier.plugins.hookspecs"}
    bad = [
        name
        for name in _imports(path)
        if name.startswith(("kvtier.plugins", "kvtier.cache", "kvtier.cli"))
        and name not in allowed_plugins
    ]
    assert not bad, f"kvtier/backends/{path.name} imports {bad}"


def test_no_pickle_or_torch_load_anywhere() -> None:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import pickle" not in text and "torch.load(" not in text, path
