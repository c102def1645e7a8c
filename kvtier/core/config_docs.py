"""Config reference docs, generated from the pydantic models so that they cannot drift.

:func:`describe_fields` gives each field's name, type, default and description (``kvtier
backends`` lists a backend's options with it); :func:`config_reference_markdown` renders
the Markdown tables the docs embed, and tests compare them with the docs.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvtier.core.config import EngineConfig

__all__ = ["FieldDoc", "config_reference_markdown", "describe_fields"]


def _type_name(annotation: Any) -> str:
    """A readable type for docs and ``kvtier backends``: ``int | None``, ``'a' | 'b'``."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is Annotated:
        return _type_name(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    if origin in (tuple, list, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        item = _type_name(inner[0]) if len(inner) == 1 else ", ".join(map(_type_name, inner))
        return f"list[{item}]" if inner else "list"
    if origin is dict:
        return "object" if not args else f"object[{_type_name(args[0])}, {_type_name(args[1])}]"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _jsonable(value: Any) -> Any:
    """A JSON-friendly form of a default value."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class FieldDoc:
    """One config field, described for docs and ``kvtier backends``."""

    name: str
    type: str
    required: bool
    default: Any  # JSON-friendly; None when required
    description: str

    def default_text(self) -> str:
        """``required`` or the default as JSON."""
        return "required" if self.required else json.dumps(self.default)


def _default_of(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return _jsonable(info.default_factory())  # type: ignore[call-arg]
    return _jsonable(info.default)


def describe_fields(model_cls: type[BaseModel]) -> list[FieldDoc]:
    """Name, type, default and description of every field of a pydantic model."""
    docs = []
    for name, info in model_cls.model_fields.items():
        required = info.is_required()
        docs.append(
            FieldDoc(
                name=info.alias or name,
                type=_type_name(info.annotation),
                required=required,
                default=None if required else _default_of(info),
                description=" ".join((info.description or "").split()),
            )
        )
    return docs


def config_reference_markdown(model_cls: type[BaseModel] = EngineConfig) -> str:
    """The Markdown field table of a config model; docs/configuration.md embeds it."""
    rows = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for doc in describe_fields(model_cls):
        cells = [f"`{doc.name}`", f"`{doc.type}`", f"`{doc.default_text()}`", doc.description]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
