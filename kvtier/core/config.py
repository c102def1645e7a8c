"""Engine configuration: one extra-config parser and one validation path for the process.

Every place that reads configuration text (the engine config, a backend's extra-config,
the CLI) goes through :func:`parse_extra_config` and :func:`validate_model`, so the same
string is parsed the same way everywhere and every problem surfaces as an error of the
:mod:`kvtier.core.errors` hierarchy that names the culprit, its place and the fix.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from kvtier.core.errors import (
    ConfigError,
    ExtraConfigSyntaxError,
    InvalidFieldError,
    MissingFieldError,
    NotAnObjectError,
    UnknownKeyError,
    did_you_mean,
)
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_from_name, dtype_name
from kvtier.core.layout import Layout
from kvtier.core.specs import Operation

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "AUTO",
    "DEFAULT_BACKEND",
    "GEOMETRY_DEFAULTS",
    "EngineConfig",
    "FieldDoc",
    "config_reference_markdown",
    "describe_fields",
    "load_engine_config",
    "parse_extra_config",
    "validate_model",
]

#: The storage backend an engine gets when it names none.
DEFAULT_BACKEND = "file"
#: The value of ``io_backend`` / ``layout`` that lets capability resolution choose.
AUTO = "auto"

#: Geometry the CLI fills in when a check is run without one (never used by engines).
GEOMETRY_DEFAULTS: dict[AttentionKind, dict[str, int]] = {
    AttentionKind.MHA: {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    AttentionKind.MLA: {"num_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}
_GEOMETRY_FIELDS: dict[AttentionKind, tuple[str, ...]] = {
    kind: tuple(fields) for kind, fields in GEOMETRY_DEFAULTS.items()
}

M = TypeVar("M", bound=BaseModel)

_EXAMPLE = '{"capacity_bytes": 1073741824}'


# --- parsing ---------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    """The JSON (or Python) name of a value's type, for "got ..." messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _short(value: Any, limit: int = 60) -> str:
    """A repr cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _snippet(text: str, line: int, column: int, width: int = 76) -> str:
    """The offending line, indented, with a caret under ``column`` (1-based)."""
    lines = text.splitlines() or [""]
    row = lines[line - 1] if 0 < line <= len(lines) else ""
    index = max(column - 1, 0)
    start = 0
    if len(row) > width:  # keep a window around the column so the caret stays visible
        start = max(0, min(index - width // 2, len(row) - width))
        row = row[start : start + width]
    shown = "".join(ch if ch.isprintable() else " " for ch in row)
    prefix = "..." if start else ""
    caret = " " * (len(prefix) + index - start) + "^"
    return f"    {prefix}{shown}\n    {caret}"


_PY_LITERAL = re.compile(r"(?<![\w\"'])(True|False|None)(?![\w\"'])")
_UNQUOTED_KEY = re.compile(r"[{,]\s*[A-Za-z_][\w\-]*\s*:")
_KEY_EQUALS = re.compile(r"^\s*\{?\s*[A-Za-z_][\w.\-]*\s*=")
_UNQUOTED_VALUE = re.compile(
    r":\s*(?!(?:true|false|null|none)\b)[A-Za-z_/][\w./\-]*\s*[,}]", re.IGNORECASE
)
_TRAILING_COMMA = re.compile(r",\s*[}\]]")
_PATH_LIKE = re.compile(r"^[\w./~\\:\-]+\.(json|toml)$", re.IGNORECASE)


def _json_hints(text: str, position: int) -> list[str]:
    """Hints for the usual ways an extra-config string stops being JSON."""
    hints: list[str] = []
    stripped = text.strip()
    if any(q in text for q in "\u201c\u201d\u2018\u2019"):
        hints.append(
            'replace typographic quotes (\u201c \u201d \u2018 \u2019) with plain double quotes (")'
        )
    if _PY_LITERAL.search(text):
        hints.append(
            "this looks like a pasted Python dict: JSON writes true, false and "
            "null in lower case (json.dumps(d) prints valid JSON)"
        )
    if "'" in text:
        hints.append(
            "JSON needs double quotes around keys and strings: "
            "{\"key\": \"value\"}, not {'key': 'value'}"
        )
    if _TRAILING_COMMA.search(text):
        hints.append("remove the trailing comma before the closing '}' or ']'")
    if _KEY_EQUALS.search(text):
        hints.append(
            'extra-config is JSON, not key=value: write {"key": value}, or put '
            "'key = value' lines in a .toml file and pass @file.toml"
        )
    elif _UNQUOTED_KEY.search(text):
        hints.append(
            "keys are not in double quotes; if you typed them, the shell removed "
            "them: wrap the whole value in single quotes, e.g. "
            "--extra-config '{\"key\": 1}'"
        )
    if _UNQUOTED_VALUE.search(text):
        hints.append('string values need double quotes too: {"path": "/tmp/kv"}')
    if _PATH_LIKE.match(stripped):
        hints.append(f"to read a file, prefix its path with @: @{stripped}")
    if not hints and position >= len(text.rstrip()):
        hints.append(
            "the text ends early: a closing brace, bracket or quote is missing "
            "(if the shell split the value at a space, quote the whole value)"
        )
    if not hints:
        hints.append(f"extra-config must be a JSON object, for example {_EXAMPLE}")
    return hints


def _toml_hints(text: str) -> list[str]:
    """Hints for the usual ways a TOML extra-config file goes wrong."""
    hints: list[str] = []
    if text.lstrip().startswith("{"):
        hints.append("this file holds JSON, not TOML: name it .json")
    if _PY_LITERAL.search(text):
        hints.append(
            "TOML writes true and false in lower case and has no null (leave the key out instead)"
        )
    if re.search(r"=\s*[A-Za-z_/][\w./\-]*\s*$", text, re.MULTILINE):
        hints.append('TOML strings need quotes: key = "value"')
    if not hints:
        hints.append(
            'write one "key = value" per line, strings in quotes, e.g. capacity_bytes = 1073741824'
        )
    return hints


def _syntax_error(
    kind: str, source: str, text: str, message: str, line: int, column: int, hints: list[str]
) -> ExtraConfigSyntaxError:
    """Build the error with position, the offending line under a caret, and hints."""
    hint_text = "".join(f"\nhint: {h}" for h in hints)
    return ExtraConfigSyntaxError(
        f"{source}: invalid {kind} at line {line}, column {column}: {message}\n"
        f"{_snippet(text, line, column)}{hint_text}",
        value=text,
        line=line,
        column=column,
        source=source,
    )


def _position(text: str, index: int) -> tuple[int, int]:
    """1-based (line, column) of a character index."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a key given twice is an error, never a silent overwrite."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _parse_json(text: str, source: str) -> Any:
    """json.loads with every failure turned into an ExtraConfigSyntaxError."""
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as exc:
        raise _syntax_error(
            "JSON", source, text, exc.msg, exc.lineno, exc.colno, _json_hints(text, exc.pos)
        ) from None
    except _DuplicateKey as exc:
        index = max(text.rfind(json.dumps(exc.key)), 0)
        line, column = _position(text, index)
        raise _syntax_error(
            "JSON",
            source,
            text,
            f"key {exc.key!r} is given twice",
            line,
            column,
            ["give each key once"],
        ) from None
    except RecursionError:
        raise ExtraConfigSyntaxError(
            f"{source}: JSON is nested too deeply", value=text, source=source
        ) from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise ExtraConfigSyntaxError(
            f"{source}: invalid JSON: {exc}", value=text, source=source
        ) from None


_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_END = re.compile(r"\s*\(at end of document\)\s*$")


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    """tomllib.loads with every failure turned into an ExtraConfigSyntaxError."""
    try:
        parsed: dict[str, Any] = tomllib.loads(text)
        return parsed
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = _TOML_AT.search(message)
        if match:
            line, column = int(match.group(1)), int(match.group(2))
            message = message[: match.start()]
        else:
            line, column = _position(text, len(text))
            message = _TOML_END.sub("", message)
        raise _syntax_error(
            "TOML", source, text, message, line, column, _toml_hints(text)
        ) from None
    except (RecursionError, ValueError) as exc:
        raise ExtraConfigSyntaxError(
            f"{source}: invalid TOML: {exc!r}", value=text, source=source
        ) from None


def _read_file(spec: str, source: str) -> tuple[str, str, str]:
    """Read ``@path``: returns (text, format, label); errors name the path."""
    raw = spec[1:].strip()
    if not raw:
        raise ConfigError(
            f"{source}: '@' must be followed by a file path, e.g. @kvtier.toml", value=spec
        )
    try:
        path = Path(raw).expanduser()
        suffix = path.suffix.lower()
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"{source}: bad file path {raw!r}: {exc}", value=raw) from None
    if suffix not in (".json", ".toml"):
        raise ConfigError(
            f"{source}: cannot read {raw!r}: the file name must end in .json or .toml "
            f"(got {suffix or 'no extension'!r})",
            value=raw,
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(
            f"{source}: file {str(path)!r} does not exist (cwd {str(Path.cwd())!r})", value=raw
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: file {str(path)!r} is not UTF-8 text: {exc.reason} at byte {exc.start}",
            value=raw,
        ) from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"{source}: cannot read file {str(path)!r}: {reason}", value=raw
        ) from None
    return text, suffix[1:], f"{source} (@{path})"


def parse_extra_config(
    value: str | Mapping[str, Any] | None, *, source: str = "extra-config"
) -> dict[str, Any]:
    """Parse a JSON object string, ``@file.json`` / ``@file.toml``, or a mapping into a dict.

    This is the only extra-config parser in the process; every failure is a
    :class:`~kvtier.core.errors.ConfigError` that names ``source``.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        result = dict(value)
        for key in result:
            if not isinstance(key, str):
                raise NotAnObjectError(
                    f"{source}: keys must be strings, got {_short(key)} ({type(key).__name__})",
                    value=key,
                )
        return result
    if not isinstance(value, str):
        raise NotAnObjectError(
            f"{source} must be a JSON object string, @file or mapping, "
            f"got {type(value).__name__}: {_short(value)}",
            value=value,
        )
    text = value.strip()
    if not text:
        return {}
    kind = "json"
    label = source
    if text.startswith("@"):
        text, kind, label = _read_file(text, source)
        if not text.strip():
            return {}
    parsed = _parse_toml(text, label) if kind == "toml" else _parse_json(text, label)
    if not isinstance(parsed, dict):
        raise NotAnObjectError(
            f"{label} must be a JSON object ({{...}}), got {_json_type(parsed)} "
            f"{_short(parsed)}; for example {_EXAMPLE}",
            value=parsed,
        )
    return parsed


# --- validation ------------------------------------------------------------------------


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
                message = f"{err.get('msg', 'invalid value')}, got {_short(err.get('input'))}"
            problems.append(
                InvalidFieldError(_join(where, loc) or label, message, value=err.get("input"))
            )
    return problems


def _raise_all(problems: list[ConfigError], label: str, footer: str = "") -> typing.NoReturn:
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
    Several problems raise one error listing all of them (see :func:`_raise_all`).
    """
    label = label or where or model_cls.__name__
    if not isinstance(data, Mapping):
        raise NotAnObjectError(
            f"{label} must be an object (mapping), got {_json_type(data)} {_short(data)}",
            value=data,
        )
    try:
        return model_cls.model_validate(dict(data))
    except ValidationError as exc:
        problems = _problems(model_cls, exc, where, label)
    # An unknown key (a typo) often explains the other problems, so it leads.
    problems.sort(key=lambda p: not isinstance(p, UnknownKeyError))
    _raise_all(problems or [ConfigError(f"{label}: invalid configuration")], label)


# --- the engine config -----------------------------------------------------------------

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


def _attention_fields_check(config: EngineConfig) -> None:
    """Geometry fields of the other attention kind are an error, not silently ignored."""
    other = AttentionKind.MLA if config.attention is AttentionKind.MHA else AttentionKind.MHA
    mine = set(_GEOMETRY_FIELDS[config.attention])
    for name in _GEOMETRY_FIELDS[other]:
        if name not in mine and getattr(config, name) is not None:
            raise InvalidFieldError(
                name,
                f"is an {other.value.upper()} geometry field but attention is "
                f"{config.attention.value!r}; an {config.attention.value.upper()} geometry takes "
                f"{', '.join(_GEOMETRY_FIELDS[config.attention])}",
                value=getattr(config, name),
            )


class EngineConfig(BaseModel):
    """Everything an engine tells kvtier at start-up; validated before anything is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        DEFAULT_BACKEND, description="Storage backend name (`kvtier backends` lists them)."
    )
    io_backend: str = Field(
        AUTO,
        description="IO backend that moves pages device <-> host, "
        "or `auto` for the best one that supports the plan.",
    )
    layout: str = Field(
        AUTO,
        description="Host-pool layout (`layer_first`, `page_first`, "
        "`page_first_direct`, `page_head`), or `auto`.",
    )
    attention: AttentionKind = Field(
        AttentionKind.MHA,
        description="`mha` (separate K and V, GQA included) or `mla` (one latent vector).",
    )
    num_layers: PositiveInt | None = Field(None, description="Number of layers.")
    num_kv_heads: PositiveInt | None = Field(
        None, description="MHA: KV heads held by this rank (its share under tensor parallelism)."
    )
    head_dim: PositiveInt | None = Field(None, description="MHA: size of one head.")
    kv_lora_rank: PositiveInt | None = Field(None, description="MLA: latent rank.")
    qk_rope_head_dim: PositiveInt | None = Field(None, description="MLA: rope part of the latent.")
    dtype: str = Field(
        "bfloat16",
        description="KV dtype: float16, bfloat16, float32, float8_* "
        "(aliases bf16, fp16, fp8 accepted).",
    )
    page_size: PositiveInt = Field(64, description="Tokens per page.")
    tp_rank: NonNegativeInt = Field(0, description="This rank under tensor parallelism.")
    tp_size: PositiveInt = Field(
        1, description="Tensor-parallel world size; 0 <= tp_rank < tp_size."
    )
    operations: tuple[Operation, ...] = Field(
        (Operation.BACKUP_ALL, Operation.LOAD_ALL),
        min_length=1,
        description="Transfers the engine will use: backup_all, load_all, load_layer, "
        "backup_layer.",
    )
    model: str = Field(
        "default", min_length=1, description="Model id, part of the page-key namespace."
    )
    tenant: str | None = Field(
        None, description="Tenant salt for the key namespace, so tenants never share pages."
    )
    verify: Literal["full", "header"] = Field(
        "full",
        description="Page verification on load: "
        "`full` checksums the payload, `header` checks "
        "only the envelope header.",
    )
    host_pages: PositiveInt | None = Field(
        None, description="Host-pool size in pages (or give host_bytes)."
    )
    host_bytes: PositiveInt | None = Field(
        None, description="Host-pool size in bytes (or give host_pages)."
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own "
        "options: JSON object string, `@file.json`, "
        "`@file.toml` or a mapping.",
    )

    @field_validator("extra_config", mode="before")
    @classmethod
    def _parse_extra(cls, value: Any) -> dict[str, Any]:
        return parse_extra_config(value, source="extra_config")

    @field_validator("backend", "io_backend")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty name (`kvtier backends` lists them)")
        return value.strip()

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        value = value.strip().lower()
        choices = [AUTO, *(layout.value for layout in Layout)]
        if value not in choices:
            raise ValueError(
                f"unknown layout {value!r}{did_you_mean(value, choices)}; "
                f"choose one of {', '.join(choices)}"
            )
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        try:
            return dtype_name(dtype_from_name(value.strip()))
        except InvalidFieldError as exc:
            raise ValueError(str(exc).removeprefix("dtype: ")) from None

    @model_validator(mode="after")
    def _cross_checks(self) -> EngineConfig:
        if self.tp_rank >= self.tp_size:
            raise InvalidFieldError(
                "tp_rank",
                f"must be below tp_size ({self.tp_size}), got {self.tp_rank}",
                value=self.tp_rank,
            )
        if self.host_pages is not None and self.host_bytes is not None:
            raise InvalidFieldError(
                "host_bytes", "give host_pages or host_bytes, not both", value=self.host_bytes
            )
        _attention_fields_check(self)
        return self

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Validate a mapping, raising kvtier config errors."""
        return validate_model(cls, data, where="", label="engine config")

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """Parse a JSON object string or ``@file.json`` / ``@file.toml`` and validate it."""
        return load_engine_config(text)

    def missing_geometry(self) -> list[str]:
        """The geometry fields this attention kind needs that are not set."""
        return [name for name in _GEOMETRY_FIELDS[self.attention] if getattr(self, name) is None]

    def geometry(self) -> KVGeometry:
        """The KV geometry; a missing field raises MissingFieldError naming all missing ones."""
        missing = self.missing_geometry()
        if missing:
            needed = ", ".join(_GEOMETRY_FIELDS[self.attention])
            hint = f"an {self.attention.value.upper()} geometry needs {needed}"
            if len(missing) == 1:
                raise MissingFieldError(missing[0], hint=f" ({hint})")
            problems: list[ConfigError] = [MissingFieldError(name) for name in missing]
            _raise_all(problems, "engine config", footer=f"\n({hint})")
        if self.attention is AttentionKind.MLA:
            return KVGeometry.mla(
                num_layers=self.num_layers or 0,
                kv_lora_rank=self.kv_lora_rank or 0,
                qk_rope_head_dim=self.qk_rope_head_dim or 0,
                dtype=self.dtype,
                page_size=self.page_size,
            )
        return KVGeometry.mha(
            num_layers=self.num_layers or 0,
            num_kv_heads=self.num_kv_heads or 0,
            head_dim=self.head_dim or 0,
            dtype=self.dtype,
            page_size=self.page_size,
        )

    def with_geometry_defaults(self) -> tuple[EngineConfig, list[str]]:
        """Fill missing geometry fields from :data:`GEOMETRY_DEFAULTS`, saying which.

        For ``kvtier check`` without a model at hand; engines always pass their geometry.
        """
        filled = {name: GEOMETRY_DEFAULTS[self.attention][name] for name in self.missing_geometry()}
        if not filled:
            return self, []
        text = ", ".join(f"{k}={v}" for k, v in filled.items())
        return self.model_copy(update=filled), [f"geometry not given, defaults used: {text}"]


def load_engine_config(
    value: str | Mapping[str, Any] | EngineConfig | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    source: str = "config",
) -> EngineConfig:
    """Build an EngineConfig from JSON text, ``@file``, a mapping or None, plus overrides.

    ``overrides`` replace top-level keys (the CLI's flags over ``--config``); ``source``
    names the text in syntax errors.
    """
    if isinstance(value, EngineConfig):
        data: dict[str, Any] = value.model_dump(exclude_defaults=True)
    else:
        data = parse_extra_config(value, source=source)
    data.update(overrides or {})
    return EngineConfig.from_mapping(data)


# --- reference docs --------------------------------------------------------------------


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
