"""Read-only registries of what the plugins declared, with "did you mean" lookups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvtier.core.errors import UnknownNameError
from kvtier.core.specs import BackendSpec, IOBackendSpec

__all__ = ["PluginInfo", "Registry"]


@dataclass(frozen=True)
class PluginInfo:
    """Where a declaration came from: the plugin name and its distribution, if any."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution:
            return f"{self.plugin} ({self.distribution} {self.version or '?'})"
        return self.plugin


class Registry:
    """An immutable view of declared storage and IO backends and their origins."""

    def __init__(
        self,
        backends: Mapping[str, BackendSpec],
        io_backends: Mapping[str, IOBackendSpec],
        origins: Mapping[tuple[str, str], PluginInfo],
    ) -> None:
        self._backends = MappingProxyType(dict(backends))
        self._io_backends = MappingProxyType(dict(io_backends))
        self._origins = MappingProxyType(dict(origins))

    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """Storage backends by name (read-only)."""
        return self._backends

    @property
    def io_backends(self) -> Mapping[str, IOBackendSpec]:
        """IO backends by name (read-only)."""
        return self._io_backends

    def backend(self, name: str) -> BackendSpec:
        """The storage backend called ``name``, or an error listing the installed ones."""
        try:
            return self._backends[name]
        except KeyError:
            raise UnknownNameError("backend", name, self._backends) from None

    def io_backend(self, name: str) -> IOBackendSpec:
        """The IO backend called ``name``, or an error listing the installed ones."""
        try:
            return self._io_backends[name]
        except KeyError:
            raise UnknownNameError("IO backend", name, self._io_backends) from None

    def origin(self, kind: str, name: str) -> PluginInfo:
        """Which plugin declared ``name``; ``kind`` is ``"backend"`` or ``"io_backend"``."""
        return self._origins[(kind, name)]
