"""The design's structural rules, enforced on the source tree.

- Layering (DESIGN.md, "Architecture"), on the whole import graph (deferred and
  ``import_module`` imports count): ``core/`` imports nothing above it; ``plugins/`` only
  ``core/``; backends and policies only ``core/`` and the hook markers; ``cache/`` nothing
  from ``integrations/``, ``bench/``, ``cli/`` or ``testing/``; ``integrations/`` nothing
  from ``bench/``, ``cli/`` or ``testing/``; ``testing/`` nothing from ``bench/`` or
  ``cli/``. Nothing imports the package's face (``kvtier/__init__.py``) from inside the
  package; the import graph has no cycle, and only the command itself and ``__main__``
  entry scripts import ``kvtier.cli``.
- One construction path: only :mod:`kvtier.core.capabilities` calls a plugin's factory.
- Privacy: no private module (``_name``) is imported from outside its package.
- One home per concept: every public error class lives in ``core/errors.py``; every
  built-in backend is arranged alike; the public face lists no internals.
- No pickle and no ``torch.load`` anywhere.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

import kvtier
from kvtier.plugins.manager import BUILTIN_PLUGINS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"
SOURCES = sorted(PACKAGE.rglob("*.py"))
#: Code outside the package that imports kvtier the way users do.
OUTSIDE = sorted(
    path for top in ("tests", "benchmarks", "examples") for path in (ROOT / top).rglob("*.py")
)
#: The lower layers: each imports, inside kvtier, only itself and these.
ONLY = {
    "kvtier.core": (),
    "kvtier.plugins": ("kvtier.core", "kvtier._version"),
    "kvtier.backends": ("kvtier.core", "kvtier.plugins.hookspecs"),
    "kvtier.policies": ("kvtier.core", "kvtier.plugins.hookspecs"),
    "kvtier.storage": ("kvtier.core",),
}
#: The layers on top: each imports none of these (the layers beside or above it).
NEVER = {
    "kvtier.cache": ("kvtier.integrations", "kvtier.bench", "kvtier.cli", "kvtier.testing"),
    "kvtier.integrations": ("kvtier.bench", "kvtier.cli", "kvtier.testing"),
    "kvtier.testing": ("kvtier.bench", "kvtier.cli"),
}


def _module_name(path: Path) -> str:
    """``kvtier/core/io.py`` -> ``kvtier.core.io``; a package's __init__ is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path) -> str:
    """The package a file belongs to (for __init__.py: the package itself)."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved, ``from a import b`` as a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _package_of(path) if path.is_relative_to(PACKAGE) else ""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def _in_package(name: str) -> bool:
    return name == "kvtier" or name.startswith("kvtier.")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_inside_imports_the_package_face(path: Path) -> None:
    # the faces: kvtier (embedders), kvtier.adapters, kvtier.errors, kvtier.plugins' names
    if path in (PACKAGE / "__init__.py", PACKAGE / "adapters.py", PACKAGE / "errors.py"):
        return
    import kvtier.adapters
    import kvtier.errors
    import kvtier.plugins

    faces = {"kvtier", "kvtier.adapters", "kvtier.errors"}
    for face in (kvtier, kvtier.adapters, kvtier.errors, kvtier.plugins):
        faces.update(f"{face.__name__}.{name}" for name in face.__all__)
    bad = [name for name in _imports(path) if name in faces]
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {bad} from a face of the package; import from "
        "the module that defines it (a face only re-exports)"
    )


def test_the_faces_are_small_and_each_name_is_defined_below_them() -> None:
    import kvtier.adapters
    import kvtier.errors
    import kvtier.plugins

    assert len(kvtier.__all__) <= 25, "the embedders' face holds about 25 names at most"
    for face in (kvtier, kvtier.adapters, kvtier.errors, kvtier.plugins):
        for name in face.__all__:
            value = getattr(face, name)
            home = getattr(value, "__module__", None)
            assert home is None or home != face.__name__ or name == "__version__", (face, name)


#: Every module of the package by dotted name (a package by its ``__init__.py``).
MODULES = {_module_name(path): path for path in SOURCES}


def _dynamic_imports(path: Path) -> list[str]:
    """Modules ``path`` imports by a literal name at run time: ``import_module("kvtier.x")``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        if (
            called == "import_module"
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
        ):
            names.append(first.value)
    return names


def _module_of(name: str) -> str | None:
    """The package module an imported name loads: ``kvtier.core.config.AUTO`` -> its module."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports: at the top, inside a function, or by name
    (read once per run; callers do not change it)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = {_module_of(n) for n in (*_imports(path), *_dynamic_imports(path))}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as ``[a, b, ..., a]``, or ``[]`` when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def _within(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def _upward_imports(graph: dict[str, set[str]], layer: str | None = None) -> list[str]:
    """Every import that breaks :data:`ONLY` or :data:`NEVER`, as ``module -> target``
    (of ``layer``'s modules only, when given)."""
    bad = []
    for module, targets in sorted(graph.items()):
        home = next((name for name in (*ONLY, *NEVER) if _within(module, (name,))), None)
        if home is None or (layer is not None and home != layer):
            continue
        for target in sorted(targets):
            if _within(target, (home,)):
                continue
            if (home in ONLY and not _within(target, ONLY[home])) or (
                home in NEVER and _within(target, NEVER[home])
            ):
                bad.append(f"{module} -> {target}")
    return bad


def test_the_layer_rule_catches_an_upward_import() -> None:
    graph = {
        "kvtier.core.io": {"kvtier.core.errors", "kvtier.plugins.registry"},
        "kvtier.plugins.manager": {"kvtier.core.specs", "kvtier._version"},
        "kvtier.backends.file.backend": {"kvtier.plugins.hookspecs", "kvtier.storage.chain"},
        "kvtier.policies.slru": {"kvtier.plugins.manager"},
        "kvtier.cache.tiered": {"kvtier.plugins.registry", "kvtier.integrations.section"},
        "kvtier.integrations.vllm.worker": {"kvtier.cache", "kvtier.testing.faults"},
        "kvtier.testing.kit": {"kvtier.cache", "kvtier.bench.single"},
        "kvtier.bench.single": {"kvtier.testing.content", "kvtier.integrations"},
        "kvtier.corex": {"kvtier.cli"},  # not kvtier.core: no rule
    }
    assert _upward_imports(graph) == [
        "kvtier.backends.file.backend -> kvtier.storage.chain",
        "kvtier.cache.tiered -> kvtier.integrations.section",
        "kvtier.core.io -> kvtier.plugins.registry",
        "kvtier.integrations.vllm.worker -> kvtier.testing.faults",
        "kvtier.policies.slru -> kvtier.plugins.manager",
        "kvtier.testing.kit -> kvtier.bench.single",
    ]


@pytest.mark.parametrize("layer", [*ONLY, *NEVER])
def test_no_layer_imports_one_above_it(layer: str) -> None:
    assert any(_within(module, (layer,)) for module in MODULES), f"no modules in {layer}"
    bad = _upward_imports(_import_graph(), layer)
    allowed = (
        f"only {', '.join(ONLY[layer]) or 'itself'}"
        if layer in ONLY
        else f"nothing from {', '.join(NEVER[layer])}"
    )
    assert not bad, f"{layer} imports upward: {bad}; it may import {allowed} (DESIGN.md)"


def test_the_import_graph_has_no_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    cycle = _find_cycle(_import_graph())
    assert not cycle, (
        f"import cycle: {' -> '.join(cycle)} (deferred and import_module() imports count); "
        "make the dependency run one way, from the layer above to the one below"
    )


def test_only_entry_points_import_the_command() -> None:
    def is_cli(name: str) -> bool:
        return name == "kvtier.cli" or name.startswith("kvtier.cli.")

    bad = sorted(
        name
        for name, targets in _import_graph().items()
        if any(is_cli(t) for t in targets) and not is_cli(name) and not name.endswith(".__main__")
    )
    assert not bad, (
        f"{bad} import kvtier.cli; the command sits on top of everything, so only it and "
        "`python -m` entry scripts (__main__.py) may import it"
    )


def _factory_calls(path: Path) -> list[int]:
    """Lines where ``path`` calls ``<something>.load_factory(...)`` or ``<spec>.factory(...)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Call):  # spec.load_factory()(...)
                func = func.func
            if isinstance(func, ast.Attribute) and func.attr in ("load_factory", "factory"):
                lines.append(node.lineno)
    return lines


def test_only_the_construction_path_calls_a_factory() -> None:
    home = PACKAGE / "core" / "capabilities.py"
    callers = {
        str(path.relative_to(ROOT)): lines
        for path in SOURCES
        if path != home and (lines := _factory_calls(path))
    }
    assert not callers, (
        f"plugin factories are called outside kvtier/core/capabilities.py: {callers}; "
        "build through resolve() and build_backend() / build_io_backend() / open_page_store()"
    )
    assert len(set(_factory_calls(home))) == 1, "capabilities.py calls factories in one place"


def _private_part(name: str) -> str | None:
    """The package that owns the first private component of ``name``, or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


@pytest.mark.parametrize("path", SOURCES + OUTSIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_module_is_imported_from_outside_its_package(path: Path) -> None:
    inside = _module_name(path) if path.is_relative_to(PACKAGE) else ""
    bad = []
    for name in _imports(path):
        if not _in_package(name):
            continue
        owner = _private_part(name)
        if owner is not None and not (inside == owner or inside.startswith(owner + ".")):
            bad.append(name)
    assert not bad, f"{path.relative_to(ROOT)} imports private {bad} from outside its package"


def test_every_public_error_class_lives_in_errors_py() -> None:
    errors = importlib.import_module("kvtier.core.errors")
    names = {n for n, v in vars(errors).items() if isinstance(v, type)}
    elsewhere = []
    for path in SOURCES:
        if path == PACKAGE / "core" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            }
            if bases & (names | {"Exception", "BaseException", "ValueError", "RuntimeError"}):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not elsewhere, f"error classes outside kvtier/core/errors.py: {elsewhere}"
    assert issubclass(errors.CacheClosedError, errors.KvtierError)
    assert issubclass(errors.PrometheusMissingError, errors.KvtierError)
    assert issubclass(errors.ExtentError, errors.KvtierError)


BACKEND_PACKAGES = sorted(p.parent.name for p in (PACKAGE / "backends").glob("*/backend.py"))


def test_every_builtin_backend_is_arranged_alike() -> None:
    assert BACKEND_PACKAGES == ["file", "memory", "mooncake", "segment", "uring"]
    loose = sorted(p.name for p in (PACKAGE / "backends").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"loose modules in kvtier/backends: {loose}"
    for name in BACKEND_PACKAGES:
        home = PACKAGE / "backends" / name
        assert (home / "__init__.py").is_file() and (home / "config.py").is_file()
        declaration = _imports(home / "__init__.py")
        assert f"kvtier.backends.{name}.backend" not in declaration, (
            f"kvtier/backends/{name}/__init__.py imports its backend module; the declaration "
            "names it lazily so that listing backends imports nothing optional"
        )
        assert f"kvtier.backends.{name}" in BUILTIN_PLUGINS
        module = importlib.import_module(f"kvtier.backends.{name}")
        assert hasattr(module, "kvtier_register_backends")
        classes = [
            node.name
            for node in ast.walk(ast.parse((home / "backend.py").read_text(encoding="utf-8")))
            if isinstance(node, ast.ClassDef)
            and node.name.endswith("Backend")
            and not node.name.startswith("_")
        ]
        assert classes == [f"{name.capitalize()}Backend"], (name, classes)


def test_the_face_is_grouped_by_audience_and_lists_no_internals() -> None:
    for name in kvtier.__all__:
        assert hasattr(kvtier, name), name
    internals = {
        "Namespace",
        "PageKeyer",
        "ENVELOPE_BYTES",
        "Rejection",
        "external_key",
        "validate_key",
        "parse_extra_config",
        "validate_model",
        "hookspec",
        "DEFAULT_BACKEND",
    }
    assert not internals & set(kvtier.__all__)
    doc = kvtier.__doc__ or ""
    for audience in (
        "embedding kvtier in an engine",
        "writing a storage backend",
        "writing an IO backend",
        "errors",
    ):
        assert audience in doc
    assert kvtier.__version__ == importlib.import_module("kvtier._version").__version__


def test_no_pickle_or_torch_load_anywhere() -> None:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import pickle" not in text and "torch.load(" not in text, path
