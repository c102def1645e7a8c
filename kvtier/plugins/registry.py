"""Read-only registries of what the plugins declared, with "did you mean" lookups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvtier.core.errors import UnknownNameError
from kvtier.core.specs import BackendSpec, IOBackendSpec, PolicySpec

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
    """An immutable view of declared storage and IO backends, policies and their origins."""

    def __init__(
        self,
        backends: Mapping[str, BackendSpec],
        io_backends: Mapping[str, IOBackendSpec],
        origins: Mapping[tuple[str, str], PluginInfo],
        policies: Mapping[str, PolicySpec] | None = None,
    ) -> None:
        self._backends = MappingProxyType(dict(backends))
        self._io_backends = MappingProxyType(dict(io_backends))
        self._policies = MappingProxyType(dict(policies or {}))
        self._origins = MappingProxyType(dict(origins))

    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """Storage backends by name (read-only)."""
        return self._backends

    @property
    def io_backends(self) -> Mapping[str, IOBackendSpec]:
        """IO backends by name (read-only)."""
        return self._io_backends

    @property
    def policies(self) -> Mapping[str, PolicySpec]:
        """Eviction and admission policies by name (read-only); ``spec.kind`` tells which."""
        return self._policies

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

    def policy(self, name: str, kind: str | None = None) -> PolicySpec:
        """The policy called ``name`` (of ``kind``, when given: ``"eviction"`` or
        ``"admission"``), or an error listing the installed ones of that kind."""
        known = {n: s for n, s in self._policies.items() if kind is None or s.kind == kind}
        try:
            return known[name]
        except KeyError:
            label = f"{kind} policy" if kind else "policy"
            raise UnknownNameError(label, name, known) from None

    def origin(self, kind: str, name: str) -> PluginInfo:
        """Which plugin declared ``name``; ``kind`` is ``"backend"``, ``"io_backend"`` or
        ``"policy"``."""
        return self._origins[(kind, name)]
