"""Every kvtier error, in one hierarchy under :class:`KvtierError` (the public face of
:mod:`kvtier.core.errors`, where they are defined).

Each error names what was wrong, where, and what would work, and carries the offending
value as ``.value``. Catch :class:`KvtierError` for all of them, :class:`ConfigError` for
everything a start-up check refuses.
"""

from __future__ import annotations

from kvtier.core.errors import (
    BackendUnavailableError,
    CacheClosedError,
    ConfigError,
    DuplicatePluginError,
    ExtentError,
    ExtraConfigSyntaxError,
    InjectedFault,
    IntegrityError,
    InvalidFieldError,
    InvalidKeyError,
    KvtierError,
    MissingFieldError,
    NotAnObjectError,
    OperationNotDeclaredError,
    PageError,
    PluginError,
    PoolExhaustedError,
    PrometheusMissingError,
    StorageError,
    TransferError,
    UnkeyableInputError,
    UnknownKeyError,
    UnknownNameError,
    UnsupportedCombinationError,
)

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
    "UnkeyableInputError",
    "UnknownKeyError",
    "UnknownNameError",
    "UnsupportedCombinationError",
]
