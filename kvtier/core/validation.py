"""Validate data against a pydantic model, raising kvtier's config errors, never pydantic's.

:func:`validate_model` is the one validation path of the process: each pydantic error
becomes the matching error of :mod:`kvtier.core.errors` (unknown key with "did you mean",
missing field, invalid field by dotted path), and several problems raise one error that
lists them all.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from kvtier.core.errors import (
    ConfigError,
    InvalidFieldError,
    MissingFieldError,
    NotAnObjectError,
    UnknownKeyError,
)
from kvtier.core.extra_config import json_type_name, short_repr

__all__ = ["raise_problems", "validate_model"]

M = TypeVar("M", bound=BaseModel)


def _join(where: str, loc: tuple[Any, ...]) -> str:
    """Dotted path: ``x`` + ``("tiers", 0, "size")`` -> ``x.tiers[0].size``."""
    path = where
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


def _find_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``Model | None``, ``list[Model]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _allowed_keys(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys the (possibly nested) model at ``loc`` accepts."""
    current: type[BaseModel] | None = model_cls
    for part in loc:
        if current is None:
            break
        if isinstance(part, int):
            continue
        info = current.model_fields.get(str(part))
        current = _find_model(info.annotation) if info is not None else None
    if current is None:
        return []
    return [info.alias or name for name, info in current.model_fields.items()]


def _relocated(error: ConfigError, where: str, loc: tuple[Any, ...]) -> ConfigError:
    """Re-root a path-carrying error raised inside a validator under ``where``/``loc``."""
    if isinstance(error, (InvalidFieldError, MissingFieldError)):
        inner = error.path
        # A field validator's error sits at the field's own location (loc ends with its
        # path); a model validator's error sits at the model and carries a relative path.
        at_field = bool(loc) and str(loc[-1]) == inner.split(".")[0]
        path = _join(where, loc) if at_field else _join(where, (*loc, inner))
        if path == inner:
            return error
        detail = str(error)[len(inner) + 2 :] if str(error).startswith(f"{inner}: ") else str(error)
        if isinstance(error, MissingFieldError):
            return MissingFieldError(path)
        return InvalidFieldError(path, detail, value=error.value)
    return error


def _problems(
    model_cls: type[BaseModel], exc: ValidationError, where: str, label: str
) -> list[ConfigError]:
    """Turn each pydantic error into the matching kvtier config error."""
    problems: list[ConfigError] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err.get("loc", ()))
        kind = err.get("type", "")
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if kind == "extra_forbidden" and loc:
            parent = loc[:-1]
            problems.append(
                UnknownKeyError(
                    str(loc[-1]),
                    where=_join(where, parent) if parent else label,
                    allowed=_allowed_keys(model_cls, parent),
                )
            )
        elif kind == "missing":
            problems.append(MissingFieldError(_join(where, loc) or label))
        elif isinstance(cause, ConfigError):
            problems.append(_relocated(cause, where, loc))
        else:
            if kind == "value_error" and cause is not None:
                message = str(cause)
            else:
                message = f"{err.get('msg', 'invalid value')}, got {short_repr(err.get('input'))}"
            problems.append(
                InvalidFieldError(_join(where, loc) or label, message, value=err.get("input"))
            )
    return problems


def raise_problems(problems: list[ConfigError], label: str, footer: str = "") -> typing.NoReturn:
    """Raise the first problem, its message listing every problem, all kept in ``.problems``.

    The exception's class is that of the first problem, so ``except UnknownKeyError``
    keeps working; ``exc.problems`` holds each problem as its own error.
    """
    first = problems[0]
    if len(problems) > 1:
        listing = "\n".join(f"  - {str(p).replace(chr(10), chr(10) + '    ')}" for p in problems)
        first.args = (f"{len(problems)} problems in {label}:\n{listing}{footer}",)
    setattr(first, "problems", tuple(problems))  # noqa: B010 - not declared on ConfigError
    raise first


def validate_model(
    model_cls: type[M], data: Mapping[str, Any], *, where: str, label: str | None = None
) -> M:
    """Validate ``data`` against a pydantic model, raising kvtier errors, never pydantic's.

    ``where`` is the dotted path prefix of every field named in an error (``""`` for the
    top level); ``label`` names the whole object in messages (default: ``where``).
    Several problems raise one error listing all of them (see :func:`raise_problems`).
    """
    label = label or where or model_cls.__name__
    if not isinstance(data, Mapping):
        raise NotAnObjectError(
            f"{label} must be an object (mapping), got {json_type_name(data)} {short_repr(data)}",
            value=data,
        )
    try:
        return model_cls.model_validate(dict(data))
    except ValidationError as exc:
        problems = _problems(model_cls, exc, where, label)
    # An unknown key (a typo) often explains the other problems, so it leads.
    problems.sort(key=lambda p: not isinstance(p, UnknownKeyError))
    raise_problems(problems or [ConfigError(f"{label}: invalid configuration")], label)
