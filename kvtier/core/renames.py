"""Keywords that were renamed, kept in one place: the old spelling still works for a
while, with a :class:`DeprecationWarning` naming the new one; both at once is an error.

Each knob has one name everywhere (the config, the engines' sections, the Python API);
this module is the only place that knows the old ones.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kvtier.core.errors import InvalidFieldError

__all__ = ["RENAMED", "renamed_keywords"]

#: old keyword -> its one name now.
RENAMED: dict[str, str] = {"call_timeout_s": "backend_call_timeout_s"}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def renamed_keywords(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Let ``fn`` take the old names of :data:`RENAMED` (warned once per call site)."""
    where = fn.__qualname__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for old, new in RENAMED.items():
            if old not in kwargs:
                continue
            if new in kwargs:
                raise InvalidFieldError(
                    old,
                    f"{where}() got both {old!r} and {new!r}; pass only {new!r} "
                    f"({old!r} is its old name)",
                    value=kwargs[old],
                )
            warnings.warn(
                f"{where}(): {old!r} is now called {new!r}; the old name will be removed",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs[new] = kwargs.pop(old)
        return fn(*args, **kwargs)

    return call
