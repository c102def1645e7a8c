"""The envelope's layout is declared once: the C header and the built modules agree with it.

:mod:`kvtier.core.envelope_layout` declares the header's fields; the Python writer packs
at those places, ``kvtier/_csrc/envelope_layout.h`` states the same values for the one C
envelope source both extensions compile, and each built module exports them. Any drift
fails here (the header is read as text, so a machine without a compiler checks it too),
and a module built for another layout is not used.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest
import xxhash

import kvtier
from kvtier.backends.filestore import compiled
from kvtier.core import compiled_envelope, envelope_layout
from kvtier.core.envelope import key_digest, write_envelope
from kvtier.core.envelope_layout import FIELDS, LAYOUT, place
from kvtier.core.layout import Layout
from kvtier.testing import require

HEADER_FILE = Path(kvtier.__file__).with_name("_csrc") / "envelope_layout.h"
_DEFINE = re.compile(r"^#define\s+([A-Z0-9_]+)\s+(\d+|\"[^\"]*\")\s*$", re.MULTILINE)


def _stated(text: str) -> dict[str, Any]:
    """Every ``#define NAME value`` of a header's text (ints, and strings as bytes)."""
    return {
        name: int(value) if value.isdigit() else value.strip('"').encode("ascii")
        for name, value in _DEFINE.findall(text)
    }


def _drift(text: str) -> list[str]:
    """Where a header's text and :data:`LAYOUT` differ: each name missing, extra or unequal."""
    stated = _stated(text)
    problems = [
        f"{name}: {stated.get(name)!r} in the header, {value!r} in Python"
        for name, value in LAYOUT.items()
        if stated.get(name) != value
    ]
    return problems + [f"{name}: only in the header" for name in stated.keys() - LAYOUT.keys()]


def test_the_c_header_states_exactly_the_python_layout() -> None:
    assert _drift(HEADER_FILE.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("#define PAYLOAD_LENGTH_AT 72", "#define PAYLOAD_LENGTH_AT 73"),
        ("#define HEADER_BYTES 104", "#define HEADER_BYTES 112"),
        ('#define MAGIC "KVTIERPG"', '#define MAGIC "KVTIERP2"'),
        ("#define FORMAT_VERSION 1", "#define FORMAT_VERSION 2"),
        ("#define STATIC_BYTES 56", "#define STATIC_BYTES 56\n#define SPARE_AT 104"),
    ],
    ids=["offset", "size", "magic", "version", "extra"],
)
def test_a_header_that_drifted_is_caught(old: str, new: str) -> None:
    text = HEADER_FILE.read_text()
    assert old in text
    assert _drift(text.replace(old, new)) != []


def test_every_field_is_where_the_python_writer_puts_it() -> None:
    # distinct values in every field the writer fills, read back at the declared places
    slot = memoryview(bytearray(b"\xff" * 4096))
    payload = [memoryview(bytearray(b"abc" * 100)), memoryview(bytearray(b"z" * 7))]
    write_envelope(slot, key="k-1", fingerprint="fp123", layout=Layout.PAGE_HEAD, payload=payload)

    def field(name: str) -> bytes:
        offset, size = place(name)
        return bytes(slot[offset : offset + size])

    data = b"".join(bytes(view) for view in payload)
    assert field("magic") == LAYOUT["MAGIC"]
    assert field("version") == LAYOUT["FORMAT_VERSION"].to_bytes(2, "little")
    assert field("header_length") == LAYOUT["HEADER_BYTES"].to_bytes(2, "little")
    assert field("flags") == bytes(4) and field("reserved") == bytes(LAYOUT["RESERVED_BYTES"])
    assert field("fingerprint") == b"fp123".ljust(LAYOUT["FINGERPRINT_BYTES"], b"\0")
    assert field("layout") == bytes([4])  # page_head
    assert field("checksum_id") == bytes([LAYOUT["CHECKSUM_XXH3_128"]])
    assert field("key_digest") == key_digest("k-1")
    assert field("payload_length") == len(data).to_bytes(8, "little")
    assert field("payload_checksum") == xxhash.xxh3_128(data).digest()
    body = bytes(slot[: LAYOUT["BODY_BYTES"]])
    assert field("header_checksum") == xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    assert bytes(slot[LAYOUT["HEADER_BYTES"] :]) == bytes(4096 - LAYOUT["HEADER_BYTES"])


def test_the_fields_tile_the_header_and_the_sizes_follow_from_them() -> None:
    end = 0
    for name, _code in FIELDS:
        offset, size = place(name)
        assert offset == end, name
        end = offset + size
    assert end == LAYOUT["HEADER_BYTES"]
    assert LAYOUT["STATIC_BYTES"] == LAYOUT["KEY_DIGEST_AT"]
    assert LAYOUT["BODY_BYTES"] == LAYOUT["HEADER_CHECKSUM_AT"]
    with pytest.raises(KeyError):
        place("no_such_field")


def _built(name: str) -> Any:
    """The built module ``name`` ('envelope' or 'pageio'), required to be there."""
    if name == "envelope":
        require("compiled", None if compiled_envelope.available() else compiled_envelope.MISSING)
        return compiled_envelope._envelope
    require("compiled", None if compiled.available() else compiled.MISSING)
    return compiled._pageio


@pytest.mark.parametrize("name", ["envelope", "pageio"])
def test_each_built_module_exports_the_python_layout(name: str) -> None:
    module = _built(name)
    assert {key: getattr(module, key, None) for key in LAYOUT} == dict(LAYOUT)
    assert envelope_layout.disagreement(module) is None


def test_a_module_built_for_another_layout_is_named_and_not_used() -> None:
    drifted = types.SimpleNamespace(**{**LAYOUT, "PAYLOAD_CHECKSUM_AT": 88})
    reason = envelope_layout.disagreement(drifted)
    assert reason is not None and "PAYLOAD_CHECKSUM_AT is 88 there, 80" in reason
    assert compiled_envelope._agrees(drifted) == reason  # the core refuses it at import
    missing = types.SimpleNamespace(**{k: v for k, v in LAYOUT.items() if k != "MAGIC"})
    assert "MAGIC is None there" in (envelope_layout.disagreement(missing) or "")
