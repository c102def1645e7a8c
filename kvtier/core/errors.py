"""One exception hierarchy for kvtier.

Every error names the culprit, where it was found and what would work instead, and keeps
the offending value as an attribute so that callers can act on it without parsing text.
Config errors also subclass :class:`ValueError`, pool and transfer errors subclass the
builtin a Python programmer would expect, so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "BackendUnavailableError",
    "CacheClosedError",
    "ConfigError",
    "DuplicatePluginError",
    "ExtentError",
    "ExtraConfigSyntaxError",
    "InjectedFault",
    "IntegrityError",
    "InvalidFieldError",
    "InvalidKeyError",
    "KvtierError",
    "MissingFieldError",
    "NotAnObjectError",
    "OperationNotDeclaredError",
    "PageError",
    "PluginError",
    "PoolExhaustedError",
    "PrometheusMissingError",
    "StorageError",
    "TransferError",
    "UnknownKeyError",
    "UnknownNameError",
    "UnsupportedCombinationError",
    "did_you_mean",
]


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return `` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _names(choices: Iterable[str]) -> str:
    listed = sorted(choices)
    return ", ".join(repr(c) for c in listed) if listed else "(none)"


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""

    def __init__(self, message: str, *, value: Any = None) -> None:
        super().__init__(message)
        self.value = value


# --- configuration --------------------------------------------------------------------


class ConfigError(KvtierError, ValueError):
    """A configuration was rejected before anything was allocated or started."""


class ExtraConfigSyntaxError(ConfigError):
    """The extra-config text is not valid JSON (or TOML for ``@file.toml``)."""

    def __init__(
        self,
        message: str,
        *,
        value: Any = None,
        line: int | None = None,
        column: int | None = None,
        source: str = "extra-config",
    ) -> None:
        super().__init__(message, value=value)
        self.line = line
        self.column = column
        self.source = source


class NotAnObjectError(ConfigError):
    """The extra-config parsed, but is not a JSON object / TOML table."""


class UnknownKeyError(ConfigError):
    """A config object has a key its model does not define."""

    def __init__(self, key: str, *, where: str, allowed: Sequence[str]) -> None:
        self.key = key
        self.where = where
        self.allowed = tuple(sorted(allowed))
        super().__init__(
            f"unknown key {key!r} in {where}{did_you_mean(key, allowed)}; "
            f"allowed keys: {_names(allowed)}",
            value=key,
        )


class InvalidFieldError(ConfigError):
    """A config field has a value of the wrong type or out of range."""

    def __init__(self, path: str, message: str, *, value: Any = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}", value=value)


class MissingFieldError(ConfigError):
    """A required config field was not given."""

    def __init__(self, path: str, *, hint: str = "") -> None:
        self.path = path
        super().__init__(f"{path}: required field is missing{hint}", value=path)


class UnknownNameError(ConfigError):
    """A backend, IO backend, layout or similar name that nothing registered."""

    def __init__(self, kind: str, name: str, available: Iterable[str]) -> None:
        self.kind = kind
        self.available = tuple(sorted(available))
        super().__init__(
            f"unknown {kind} {name!r}{did_you_mean(name, self.available)}; "
            f"available: {_names(self.available)}",
            value=name,
        )


class BackendUnavailableError(ConfigError):
    """A registered backend cannot be used here: a dependency or kernel feature is missing."""

    def __init__(self, kind: str, name: str, reason: str, install_hint: str = "") -> None:
        self.kind = kind
        self.reason = reason
        self.install_hint = install_hint
        hint = f"; {install_hint}" if install_hint else ""
        super().__init__(f"{kind} {name!r} is unavailable: {reason}{hint}", value=name)


class UnsupportedCombinationError(ConfigError):
    """A backend x IO backend x layout x attention x operation plan nothing can execute."""

    def __init__(self, message: str, *, value: Any = None, supported: Sequence[str] = ()) -> None:
        self.supported = tuple(supported)
        listing = "\n  ".join(self.supported) if self.supported else "(none)"
        super().__init__(f"{message}\nCombinations that would work:\n  {listing}", value=value)


# --- plugins --------------------------------------------------------------------------


class PluginError(KvtierError):
    """A plugin declared something kvtier cannot accept."""


class DuplicatePluginError(PluginError):
    """Two plugins declared the same backend or IO backend name."""

    def __init__(self, kind: str, name: str, first: str, second: str) -> None:
        self.kind = kind
        self.plugins = (first, second)
        super().__init__(
            f"{kind} {name!r} is declared by two plugins: {first!r} and {second!r}; "
            f"uninstall one, or block one with KVTIER_DISABLE_PLUGINS={second}",
            value=name,
        )


# --- memory pools and transfers -------------------------------------------------------


class PageError(KvtierError, ValueError):
    """A page id that is out of range, foreign, or freed twice."""


class PoolExhaustedError(KvtierError, MemoryError):
    """The host pool has fewer free pages than were asked for."""


class TransferError(KvtierError, ValueError):
    """A device <-> host transfer was asked for something it cannot do; nothing was written."""


class OperationNotDeclaredError(TransferError):
    """A transfer the engine config did not declare, so start-up never checked it can run.

    ``operation`` is the :class:`~kvtier.core.specs.Operation` value that was asked for.
    """

    def __init__(self, operation: str, call: str, declared: Iterable[str]) -> None:
        self.operation = operation
        self.declared = tuple(declared)
        super().__init__(
            f"{call} is the {operation!r} operation, which this cache's config does not "
            f"declare (it declares: {', '.join(self.declared) or '(none)'}); add "
            f"{operation!r} to the engine config's 'operations' so that start-up checks "
            "that the IO backend and layout can run it",
            value=operation,
        )


class ExtentError(KvtierError, ValueError):
    """Memory that cannot be an extent: not host memory, not contiguous, or read-only."""


# --- the cache and optional features --------------------------------------------------


class CacheClosedError(KvtierError, RuntimeError):
    """An operation was asked of a TieredCache after ``close()``; open a new one."""


class PrometheusMissingError(KvtierError, ImportError):
    """``prometheus_client`` is not installed; the message names the extra that brings it."""

    def __init__(self) -> None:
        super().__init__(
            "Prometheus exposition needs prometheus_client; install it with "
            "pip install 'kvtier[prometheus]' (or pip install prometheus_client)",
            value="prometheus_client",
        )


# --- storage --------------------------------------------------------------------------


class StorageError(KvtierError):
    """A storage backend failed in a way that is not an ordinary miss."""


class InvalidKeyError(KvtierError, ValueError):
    """A page key outside the key charset, or tokens no key can be derived from.

    Raised before any I/O: a path-like key is a bug in the caller, never a miss.
    """


class UnkeyableInputError(InvalidKeyError):
    """A request carries an input that changes its KV but cannot go into its page keys.

    Raised where such a request would otherwise share pages with requests whose KV
    differs (a wrong hit); the adapter then keeps the request away from kvtier.
    """


class InjectedFault(StorageError):
    """Raised on purpose by the testing kit's ``FaultyBackend`` when its ``error_rate`` fires."""


class IntegrityError(StorageError):
    """A stored page failed envelope verification; it is counted as a miss, never loaded."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"page {key!r} rejected: {reason}", value=key)
