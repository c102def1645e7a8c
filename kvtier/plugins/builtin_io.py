"""Built-in IO backends ``direct`` and ``kernel``, registered like any third-party plugin."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.io import DIRECT_SPEC, KERNEL_SPEC
from kvtier.core.specs import IOBackendSpec
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["kvtier_register_io_backends"]


@hookimpl
def kvtier_register_io_backends(register: Callable[[IOBackendSpec], None]) -> None:
    """Declare core's page-granular ``direct`` and token-granular ``kernel`` IO backends."""
    register(DIRECT_SPEC)
    register(KERNEL_SPEC)
