"""The plugin manager: built-ins first, then entry points of group ``kvtier``, then registries.

Nothing is loaded at import time: :func:`load_registry` does the work when an engine, the
CLI or a test asks for it. Built-in backends and policies are plugin modules registered
through the very hooks third-party plugins implement, so the third-party path runs in
every test.

Environment:

- ``KVTIER_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points (built-ins still load).
- ``KVTIER_DISABLE_PLUGINS=name,...`` blocks plugins by entry-point name or, for
  built-ins, by module name (``kvtier.backends.memory``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from kvtier._version import __version__
from kvtier.core.errors import DuplicatePluginError, PluginError
from kvtier.core.specs import BackendSpec, IOBackendSpec, PolicySpec
from kvtier.plugins import hookspecs
from kvtier.plugins.registry import PluginInfo, Registry

__all__ = [
    "BUILTIN_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "DISABLE_PLUGINS_ENV",
    "ENTRY_POINT_GROUP",
    "default_registry",
    "load_registry",
    "make_plugin_manager",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvtier"
DISABLE_AUTOLOAD_ENV = "KVTIER_DISABLE_PLUGIN_AUTOLOAD"
DISABLE_PLUGINS_ENV = "KVTIER_DISABLE_PLUGINS"

#: Built-in plugin modules, registered in this order before any entry point.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "kvtier.plugins.builtin_io",
    "kvtier.backends.memory",
    "kvtier.backends.file",
    "kvtier.backends.uring",
    "kvtier.backends.segment",
    "kvtier.backends.mooncake",
    "kvtier.policies",
)


@dataclass(frozen=True)
class _Loaded:
    pm: pluggy.PluginManager
    infos: dict[str, PluginInfo]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _env_list(name: str) -> set[str]:
    return {part.strip() for part in os.environ.get(name, "").split(",") if part.strip()}


def _import_builtin(module_name: str) -> Any | None:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:  # that built-in is not part of this build
            return None
        raise


def _entry_points() -> Iterable[EntryPoint]:
    return entry_points(group=ENTRY_POINT_GROUP)


def make_plugin_manager(
    *,
    autoload: bool | None = None,
    disabled: Iterable[str] | None = None,
    plugins: Iterable[tuple[str, object]] = (),
) -> pluggy.PluginManager:
    """A fresh plugin manager with built-ins, entry points and ``plugins`` registered.

    ``autoload`` None reads ``KVTIER_DISABLE_PLUGIN_AUTOLOAD``; ``disabled`` None reads
    ``KVTIER_DISABLE_PLUGINS``. ``plugins`` are extra (name, module-or-object) pairs,
    the way tests and embedding engines add a plugin without an entry point.
    """
    return _make(autoload=autoload, disabled=disabled, plugins=plugins).pm


def _make(
    *,
    autoload: bool | None,
    disabled: Iterable[str] | None,
    plugins: Iterable[tuple[str, object]],
) -> _Loaded:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = set(_env_list(DISABLE_PLUGINS_ENV) if disabled is None else disabled)
    infos: dict[str, PluginInfo] = {}

    def add(name: str, plugin: object, info: PluginInfo) -> None:
        if name in blocked:
            pm.set_blocked(name)
            log.info("kvtier plugin %r blocked by %s", name, DISABLE_PLUGINS_ENV)
            return
        if pm.has_plugin(name):
            raise PluginError(
                f"two kvtier plugins are both named {name!r}; rename one entry point",
                value=name,
            )
        pm.register(plugin, name=name)
        infos[name] = info

    for module_name in BUILTIN_PLUGINS:
        if module_name in blocked:
            pm.set_blocked(module_name)
            continue
        module = _import_builtin(module_name)
        if module is not None:
            add(module_name, module, PluginInfo(module_name, "kvtier", __version__))

    for name, plugin in plugins:
        add(name, plugin, PluginInfo(name))

    if not (_env_flag(DISABLE_AUTOLOAD_ENV) if autoload is None else not autoload):
        for ep in _entry_points():
            if ep.name in blocked:
                pm.set_blocked(ep.name)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                dist = ep.dist.name if ep.dist else "?"
                raise PluginError(
                    f"kvtier plugin {ep.name!r} (entry point {ep.value!r} of distribution "
                    f"{dist!r}) failed to import: {exc!r}; fix or uninstall it, or block it "
                    f"with {DISABLE_PLUGINS_ENV}={ep.name}",
                    value=ep.name,
                ) from exc
            dist_name = ep.dist.name if ep.dist else None
            dist_version = ep.dist.version if ep.dist else None
            add(ep.name, plugin, PluginInfo(ep.name, dist_name, dist_version))

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"kvtier plugin {exc.plugin!r} implements a hook kvtier does not define: {exc}; "
            f"hook names are listed in kvtier.plugins.hookspecs",
            value=exc.plugin,
        ) from exc
    return _Loaded(pm, infos)


def _collect(
    loaded: _Loaded,
    hook_name: str,
    spec_type: type[BackendSpec] | type[IOBackendSpec] | type[PolicySpec],
    kind: str,
    origins: dict[tuple[str, str], PluginInfo],
) -> dict[str, Any]:
    """Call one register hook plugin by plugin, so that each spec knows its plugin."""
    found: dict[str, Any] = {}
    owner: dict[str, str] = {}
    hook = getattr(loaded.pm.hook, hook_name)
    for impl in hook.get_hookimpls():  # registration order: built-ins first
        plugin_name = impl.plugin_name

        def register(spec: Any, _plugin: str = plugin_name) -> None:
            if not isinstance(spec, spec_type):
                raise PluginError(
                    f"plugin {_plugin!r} passed {spec!r} to register() in {hook_name}; "
                    f"it takes a kvtier.plugins.{spec_type.__name__}",
                    value=spec,
                )
            if spec.name in found:
                raise DuplicatePluginError(kind, spec.name, owner[spec.name], _plugin)
            found[spec.name] = spec
            owner[spec.name] = _plugin
            info = loaded.infos.get(_plugin, PluginInfo(_plugin))
            origins[(kind.replace(" ", "_").lower(), spec.name)] = info

        kwargs: dict[str, Callable[[Any], None]] = {"register": register}
        try:
            impl.function(*[kwargs[arg] for arg in impl.argnames])
        except (PluginError, DuplicatePluginError):
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {plugin_name!r} raised in {hook_name}: {exc!r}", value=plugin_name
            ) from exc
    return found


def load_registry(
    *,
    autoload: bool | None = None,
    disabled: Iterable[str] | None = None,
    plugins: Iterable[tuple[str, object]] = (),
) -> Registry:
    """Load plugins (see :func:`make_plugin_manager`) and return what they declared."""
    loaded = _make(autoload=autoload, disabled=disabled, plugins=plugins)
    origins: dict[tuple[str, str], PluginInfo] = {}
    backends = _collect(loaded, "kvtier_register_backends", BackendSpec, "backend", origins)
    io_backends = _collect(
        loaded, "kvtier_register_io_backends", IOBackendSpec, "IO backend", origins
    )
    policies = _collect(loaded, "kvtier_register_policies", PolicySpec, "policy", origins)
    return Registry(backends, io_backends, origins, policies)


@functools.lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The process-wide registry, loaded once on first use from the environment."""
    return load_registry()
