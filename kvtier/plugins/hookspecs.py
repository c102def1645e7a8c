"""The hooks kvtier calls. This module is the reference for plugin authors.

A plugin is a module (or object) with functions marked ``@kvtier.hookimpl`` whose names
are the hooks below. Built-in backends are plugins registered exactly like third-party
ones, which arrive through the ``kvtier`` entry-point group. Hooks grow by adding
arguments; an implementation may accept fewer arguments than the spec lists.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from kvtier.core.specs import BackendSpec, IOBackendSpec, PolicySpec

__all__ = ["hookimpl", "hookspec"]

PROJECT = "kvtier"

#: Marks a hook specification (kvtier itself uses it).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin's hook implementation: ``@kvtier.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare storage backends by calling ``register(BackendSpec(...))`` once per backend.

    Called once when the plugin manager loads, for every plugin. Must not import the
    backend's optional dependencies: give the factory as a lazy ``"module:Class"``
    string and list the modules in ``requires``. Returns nothing; a name declared twice
    is an error that names both plugins.
    """


@hookspec
def kvtier_register_io_backends(register: Callable[[IOBackendSpec], None]) -> None:
    """Declare IO backends (device <-> host movers) with ``register(IOBackendSpec(...))``.

    Called once when the plugin manager loads. Each spec lists exactly the
    (layout, attention, operation) capabilities it executes; capability resolution
    refuses everything else at config time. Returns nothing.
    """


@hookspec
def kvtier_register_policies(register: Callable[[PolicySpec], None]) -> None:
    """Declare eviction and admission policies with ``register(PolicySpec(...))``.

    Called once when the plugin manager loads, for every plugin. Each spec names its
    ``kind`` (``"eviction"``: chooses which pages leave a full tier; ``"admission"``:
    decides whether a page enters a tier), a factory (a callable or a lazy
    ``"module:Class"`` string) called with the validated ``config_model`` instance, and
    that model. A tier's config names a policy by its name; each tier builds its own
    instance with ``PolicySpec.build(options)``. Returns nothing; a name declared twice is
    an error that names both plugins.
    """
