"""The plugin system: built-ins through the hook, entry points, blocking, conflicts."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import kvtier.errors
import kvtier.plugins
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.errors import DuplicatePluginError, PluginError, UnknownNameError
from kvtier.plugins import hookspecs, manager
from kvtier.plugins.manager import load_registry
from kvtier.testing import require

ROOT = Path(__file__).resolve().parents[1]


def _plugin_declaring(*names: str) -> types.SimpleNamespace:
    @kvtier.hookimpl
    def kvtier_register_backends(register: Callable[[kvtier.plugins.BackendSpec], None]) -> None:
        for name in names:
            register(kvtier.plugins.BackendSpec(name=name, factory=MemoryBackend))

    return types.SimpleNamespace(kvtier_register_backends=kvtier_register_backends)


def test_builtins_arrive_through_the_hook_with_their_origin() -> None:
    registry = load_registry()
    assert "memory" in registry.backends
    origin = registry.origin("backend", "memory")
    assert origin.plugin == "kvtier.backends.memory"
    assert origin.distribution == "kvtier"


def test_a_plugin_object_registers_a_backend() -> None:
    registry = load_registry(plugins=[("mine", _plugin_declaring("mine_backend"))])
    assert registry.backend("mine_backend").name == "mine_backend"
    assert registry.origin("backend", "mine_backend").plugin == "mine"


def test_duplicate_backend_name_names_both_plugins() -> None:
    with pytest.raises(DuplicatePluginError) as info:
        load_registry(
            plugins=[("first", _plugin_declaring("same")), ("second", _plugin_declaring("same"))]
        )
    message = str(info.value)
    assert "'first'" in message and "'second'" in message and "'same'" in message
    assert info.value.plugins == ("first", "second")
    assert "KVTIER_DISABLE_PLUGINS=second" in message


def test_duplicate_of_a_builtin_name_is_refused() -> None:
    with pytest.raises(DuplicatePluginError, match=r"kvtier\.backends\.memory"):
        load_registry(plugins=[("clash", _plugin_declaring("memory"))])


def test_unknown_hook_name_fails_loudly() -> None:
    @kvtier.hookimpl
    def kvtier_register_storages(register: object) -> None:  # a typo of a real hook
        raise AssertionError("never called")

    plugin = types.SimpleNamespace(kvtier_register_storages=kvtier_register_storages)
    with pytest.raises(PluginError, match="kvtier_register_storages"):
        load_registry(plugins=[("typo", plugin)])


def test_register_rejects_what_is_not_a_spec() -> None:
    @kvtier.hookimpl
    def kvtier_register_backends(register: Callable[[object], None]) -> None:
        register({"name": "dict_backend"})

    plugin = types.SimpleNamespace(kvtier_register_backends=kvtier_register_backends)
    with pytest.raises(PluginError, match=r"'bad'.*takes a kvtier.plugins.BackendSpec"):
        load_registry(plugins=[("bad", plugin)])


def test_a_plugin_raising_in_its_hook_is_named() -> None:
    @kvtier.hookimpl
    def kvtier_register_backends(register: object) -> None:
        raise RuntimeError("boom")

    plugin = types.SimpleNamespace(kvtier_register_backends=kvtier_register_backends)
    with pytest.raises(PluginError, match=r"plugin 'raiser' raised in kvtier_register_backends"):
        load_registry(plugins=[("raiser", plugin)])


def test_disable_plugins_env_blocks_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DISABLE_PLUGINS", "kvtier.backends.memory, other")
    registry = load_registry()
    assert "memory" not in registry.backends
    pm = manager.make_plugin_manager()
    assert pm.is_blocked("kvtier.backends.memory")


def test_registry_is_read_only_and_suggests_names() -> None:
    registry = load_registry()
    with pytest.raises(TypeError):
        registry.backends["x"] = registry.backend("memory")  # type: ignore[index]
    with pytest.raises(UnknownNameError, match=r"did you mean 'memory'\?") as info:
        registry.backend("memroy")
    assert "memory" in info.value.available


def _fake_entry_points(*points: EntryPoint) -> Callable[[], list[EntryPoint]]:
    return lambda: list(points)


def test_entry_point_that_fails_to_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="kvtier_no_such_module_xyz", group="kvtier")
    monkeypatch.setattr(manager, "_entry_points", _fake_entry_points(broken))
    with pytest.raises(PluginError, match=r"'broken'.*KVTIER_DISABLE_PLUGINS=broken"):
        load_registry(autoload=True)


def test_autoload_off_skips_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="kvtier_no_such_module_xyz", group="kvtier")
    monkeypatch.setattr(manager, "_entry_points", _fake_entry_points(broken))
    assert "memory" in load_registry().backends  # env from conftest: autoload off


def test_blocked_entry_point_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="broken", value="kvtier_no_such_module_xyz", group="kvtier")
    monkeypatch.setattr(manager, "_entry_points", _fake_entry_points(broken))
    monkeypatch.setenv("KVTIER_DISABLE_PLUGINS", "broken")
    assert "memory" in load_registry(autoload=True).backends


# --- the real third-party distribution in examples/, installed like any other ------


def _example_installed() -> bool:
    return any(ep.name == "example-sqlite" for ep in manager._entry_points())


_EXAMPLE_MISSING = (
    None
    if _example_installed()
    else "examples/kvtier-example-backend is not installed "
    "(pip install -e examples/kvtier-example-backend)"
)


@pytest.fixture
def _example() -> None:
    """Skip where the example plugin is not installed; fail under KVTIER_REQUIRE_EXAMPLE=1."""
    require("example", _EXAMPLE_MISSING)


needs_example = pytest.mark.usefixtures("_example")


@needs_example
def test_example_plugin_is_found_through_its_entry_point() -> None:
    registry = load_registry(autoload=True)
    spec = registry.backend("example_sqlite")
    origin = registry.origin("backend", "example_sqlite")
    assert origin.plugin == "example-sqlite"
    assert origin.distribution == "kvtier-example-backend"
    assert isinstance(spec.factory, str)  # declared lazily


@needs_example
def test_example_plugin_can_be_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_DISABLE_PLUGINS", "example-sqlite")
    assert "example_sqlite" not in load_registry(autoload=True).backends


@needs_example
def test_cli_lists_the_example_plugin_and_honours_blocking() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"KVTIER_DISABLE_PLUGIN_AUTOLOAD", "KVTIER_DISABLE_PLUGINS"}
    }
    cmd = [sys.executable, "-m", "kvtier.cli", "backends"]
    listed = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert "example_sqlite" in listed and "kvtier-example-backend" in listed
    env["KVTIER_DISABLE_PLUGINS"] = "example-sqlite"
    blocked = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert "example_sqlite" not in blocked and "memory" in blocked


def test_importing_kvtier_loads_no_plugin() -> None:
    code = (
        "import sys, kvtier; "
        "print(sorted(m for m in sys.modules if m.startswith(('kvtier.backends', "
        "'kvtier.plugins.manager', 'kvtier_example'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_every_hook_is_documented_and_tested() -> None:
    hooks = [name for name in dir(hookspecs) if name.startswith("kvtier_")]
    assert hooks, "no hooks found"
    docs = (ROOT / "docs" / "writing-a-backend.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for hook in hooks:
        assert hook in docs, f"{hook} is not documented in docs/writing-a-backend.md"
        assert f"def {hook}(" in tests, f"no test implements {hook}"


def test_a_plugin_registers_an_io_backend_with_its_capabilities() -> None:
    capability = kvtier.plugins.Capability(
        kvtier.Layout.PAGE_FIRST, kvtier.AttentionKind.MHA, kvtier.Operation.LOAD_ALL
    )

    @kvtier.hookimpl
    def kvtier_register_io_backends(
        register: Callable[[kvtier.plugins.IOBackendSpec], None],
    ) -> None:
        register(
            kvtier.plugins.IOBackendSpec(
                name="vendor_kernel",
                factory="vendor.mod:Kernel",
                capabilities=frozenset({capability}),
            )
        )

    plugin = types.SimpleNamespace(kvtier_register_io_backends=kvtier_register_io_backends)
    registry = load_registry(plugins=[("vendor", plugin)])
    spec = registry.io_backend("vendor_kernel")
    assert spec.supports(
        kvtier.Layout.PAGE_FIRST, kvtier.AttentionKind.MHA, kvtier.Operation.LOAD_ALL
    )
    assert not spec.supports(
        kvtier.Layout.PAGE_FIRST, kvtier.AttentionKind.MHA, kvtier.Operation.LOAD_LAYER
    )
    assert registry.origin("io_backend", "vendor_kernel").plugin == "vendor"


def test_duplicate_io_backend_name_names_both_plugins() -> None:
    def plugin() -> types.SimpleNamespace:
        @kvtier.hookimpl
        def kvtier_register_io_backends(
            register: Callable[[kvtier.plugins.IOBackendSpec], None],
        ) -> None:
            register(kvtier.plugins.IOBackendSpec(name="twin", factory="a:b"))

        return types.SimpleNamespace(kvtier_register_io_backends=kvtier_register_io_backends)

    with pytest.raises(DuplicatePluginError, match=r"IO backend 'twin'.*'one' and 'two'"):
        load_registry(plugins=[("one", plugin()), ("two", plugin())])


def test_lazy_factory_of_a_missing_module_is_unavailable_with_its_hint() -> None:
    spec = kvtier.plugins.BackendSpec(
        name="needs_dep",
        factory="kvtier_absent_dep_xyz:Backend",
        requires=("kvtier_absent_dep_xyz",),
        install_hint="pip install 'kvtier[absent]'",
    )
    assert spec.unavailable_reason() == "missing Python module(s) kvtier_absent_dep_xyz"
    with pytest.raises(
        kvtier.errors.BackendUnavailableError, match=r"pip install 'kvtier\[absent\]'"
    ):
        spec.load_factory()
