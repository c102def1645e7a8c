"""The one extra-config parser: a JSON object string, ``@file.json`` / ``@file.toml``, or a mapping.

Every place that reads configuration text (the engine config, a backend's extra-config,
the CLI, the engine adapters) calls :func:`parse_extra_config`, so the same string is
parsed the same way everywhere; a syntax error gives line, column, the offending text
under a caret and hints at the usual mistakes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError, ExtraConfigSyntaxError, NotAnObjectError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["json_type_name", "parse_extra_config", "short_repr"]

_EXAMPLE = '{"capacity_bytes": 1073741824}'


def json_type_name(value: Any) -> str:
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


def short_repr(value: Any, limit: int = 60) -> str:
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
                    f"{source}: keys must be strings, got {short_repr(key)} ({type(key).__name__})",
                    value=key,
                )
        return result
    if not isinstance(value, str):
        raise NotAnObjectError(
            f"{source} must be a JSON object string, @file or mapping, "
            f"got {type(value).__name__}: {short_repr(value)}",
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
            f"{label} must be a JSON object ({{...}}), got {json_type_name(parsed)} "
            f"{short_repr(parsed)}; for example {_EXAMPLE}",
            value=parsed,
        )
    return parsed
