"""The envelope header's layout: every field's place and size, declared once.

The header (``docs/integrity.md``) is little-endian, its fields in the order of
:data:`FIELDS`; the rest of its slot is zeros. :mod:`kvtier.core.envelope` packs and
checks it with the structs and offsets made here. The compiled modules are built from
``kvtier/_csrc/envelope_layout.h``, which states every value of :data:`LAYOUT` under the
same name and which they export: ``tests/test_envelope_layout.py`` fails when the header,
a built module and this module differ, and a module built for another layout is not
used (:func:`disagreement`). Nothing here imports beyond the standard library.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "BODY_BYTES",
    "CHECKSUM_XXH3_128",
    "FIELDS",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "LAYOUT",
    "MAGIC",
    "STATIC_BYTES",
    "disagreement",
    "fields_struct",
    "place",
]

#: First 8 bytes of every envelope.
MAGIC = b"KVTIERPG"
#: The version of the format kvtier writes and reads.
FORMAT_VERSION = 1
#: The id of the one payload checksum the format knows (xxh3-128), in the header.
CHECKSUM_XXH3_128 = 1

#: The header's fields in order, each ``(name, struct code)``; the fields before the key
#: digest are the same in every page of one store ("static").
FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "8s"),
    ("version", "H"),
    ("header_length", "H"),
    ("flags", "I"),
    ("fingerprint", "32s"),
    ("layout", "B"),
    ("checksum_id", "B"),
    ("reserved", "6s"),
    ("key_digest", "16s"),
    ("payload_length", "Q"),
    ("payload_checksum", "16s"),
    ("header_checksum", "Q"),
)


def fields_struct(first: str | None = None, end: str | None = None) -> struct.Struct:
    """The little-endian struct of the header's fields from ``first`` up to, not
    including, ``end`` (from the first field, to the last, where None)."""
    names = [name for name, _code in FIELDS]
    start = 0 if first is None else names.index(first)
    stop = len(FIELDS) if end is None else names.index(end)
    return struct.Struct("<" + "".join(code for _name, code in FIELDS[start:stop]))


def place(name: str) -> tuple[int, int]:
    """``(offset, size)`` of the header field ``name`` (a name in :data:`FIELDS`)."""
    offset = 0
    for field, code in FIELDS:
        size = struct.calcsize("<" + code)
        if field == name:
            return offset, size
        offset += size
    raise KeyError(name)


#: The bytes every page of one store shares: the fields before the key digest.
STATIC_BYTES = place("key_digest")[0]
#: The bytes the header checksum covers: every field before it.
BODY_BYTES = place("header_checksum")[0]
#: The whole header, its checksum included.
HEADER_BYTES = fields_struct().size


def _layout() -> dict[str, Any]:
    names: dict[str, Any] = {}
    for name, _code in FIELDS:
        offset, size = place(name)
        names[f"{name.upper()}_AT"] = offset
        names[f"{name.upper()}_BYTES"] = size
    names.update(
        STATIC_BYTES=STATIC_BYTES,
        BODY_BYTES=BODY_BYTES,
        HEADER_BYTES=HEADER_BYTES,
        MAGIC=MAGIC,
        FORMAT_VERSION=FORMAT_VERSION,
        CHECKSUM_XXH3_128=CHECKSUM_XXH3_128,
    )
    return names


#: Every value of the layout under its name in ``kvtier/_csrc/envelope_layout.h``: each
#: field's ``<NAME>_AT`` and ``<NAME>_BYTES``, the three sizes, the magic, the version and
#: the checksum id. What the compiled modules must export, equal, to be used.
LAYOUT: Mapping[str, Any] = MappingProxyType(_layout())


def disagreement(module: Any) -> str | None:
    """Why a compiled module was built for another envelope layout, or None if it was not.

    The module exports every name of :data:`LAYOUT`; the first that is missing or differs
    is named, with both values.
    """
    for name, value in LAYOUT.items():
        built = getattr(module, name, None)
        if built != value:
            return (
                f"built for another envelope layout: {name} is {built!r} there, {value!r} "
                "in kvtier.core.envelope_layout (rebuild the extension)"
            )
    return None
