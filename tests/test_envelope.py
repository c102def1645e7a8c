"""The envelope: byte layout, round trip, and every reason a stored page is rejected."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch
import xxhash

from kvtier.core.envelope import (
    ENVELOPE_BYTES,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    EnvelopeFormat,
    Rejection,
    key_digest,
    layout_code,
    verify_envelope,
    write_envelope,
)
from kvtier.core.errors import InvalidFieldError
from kvtier.core.extents import Extent, extent_of_tensor, extent_of_view
from kvtier.core.layout import Layout

KEY = "0123456789abcdef-00aa"
FP = "fedcba9876543210"


def make_page(sizes: tuple[int, ...] = (1000, 3000)) -> tuple[memoryview, list[Extent]]:
    slot = memoryview(bytearray(os.urandom(ENVELOPE_BYTES)))  # garbage that must be zeroed
    payload = [extent_of_view(memoryview(bytearray(os.urandom(n)))) for n in sizes]
    return slot, payload


def write(slot: memoryview, payload: list[Extent], **over: object) -> None:
    args: dict = {"key": KEY, "fingerprint": FP, "layout": Layout.PAGE_FIRST, **over}
    write_envelope(slot, payload=payload, **args)


def verify(slot: memoryview, payload: list[Extent], full: bool = True, **over: object):
    args: dict = {"key": KEY, "fingerprint": FP, "layout": Layout.PAGE_FIRST, **over}
    return verify_envelope(slot, payload=payload, full=full, **args)


def test_round_trip_and_zeroed_tail() -> None:
    slot, payload = make_page()
    write(slot, payload)
    assert verify(slot, payload) is None
    assert verify(slot, payload, full=False) is None
    assert bytes(slot[HEADER.size :]) == bytes(ENVELOPE_BYTES - HEADER.size)


def test_header_bytes_are_the_documented_format() -> None:
    slot, payload = make_page((10, 20))
    write(slot, payload, layout="layer_first")
    fields = struct.unpack_from("<8sHHI32sBBHI16sQ16sQ", slot)
    magic, version, hlen, flags, fp, layout, algo, _, _, kd, length, checksum, hsum = fields
    assert (magic, version, hlen, flags) == (MAGIC, FORMAT_VERSION, 104, 0)
    assert HEADER.size == 104
    assert fp == FP.encode().ljust(32, b"\0")
    assert layout == layout_code(Layout.LAYER_FIRST) == 1
    assert algo == 1
    assert kd == hashlib.blake2b(KEY.encode(), digest_size=16).digest() == key_digest(KEY)
    assert length == 30
    whole = bytes(payload[0].view) + bytes(payload[1].view)
    assert checksum == xxhash.xxh3_128_digest(whole)
    assert hsum == xxhash.xxh3_64_intdigest(bytes(slot[:96]))


def test_checksum_does_not_depend_on_how_the_payload_is_split() -> None:
    data = os.urandom(4096)
    one = [extent_of_view(memoryview(bytearray(data)))]
    three = [
        extent_of_view(memoryview(bytearray(data[a:b])))
        for a, b in ((0, 1), (1, 4000), (4000, 4096))
    ]
    slot_a, slot_b = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    write(slot_a, one)
    write(slot_b, three)
    assert bytes(slot_a) == bytes(slot_b)
    assert verify(slot_a, three) is None


def test_works_on_tensor_extents_and_plain_views() -> None:
    header = torch.zeros(ENVELOPE_BYTES, dtype=torch.uint8)
    body = torch.randn(2, 64, 8)
    slot = extent_of_tensor(header)
    payload = [extent_of_tensor(body[0]), extent_of_tensor(body[1])]
    write_envelope(slot, key=KEY, fingerprint=FP, layout="page_first", payload=payload)
    assert (
        verify_envelope(
            slot,
            key=KEY,
            fingerprint=FP,
            layout="page_first",
            payload=[p.view for p in payload],
            full=True,
        )
        is None
    )
    body[1, 3, 2] += 1.0
    assert verify(slot.view, payload) is Rejection.CORRUPT_CHECKSUM


@pytest.mark.parametrize("offset", range(HEADER.size))
def test_any_flipped_header_bit_is_caught(offset: int) -> None:
    slot, payload = make_page((64,))
    write(slot, payload)
    slot[offset] ^= 1 << (offset % 8)
    assert verify(slot, payload, full=False) is not None
    assert verify(slot, payload, full=True) is not None


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, Rejection.BAD_MAGIC),
        (8, Rejection.UNSUPPORTED_VERSION),
        (10, Rejection.CORRUPT_HEADER),
        (20, Rejection.CORRUPT_HEADER),
        (90, Rejection.CORRUPT_HEADER),
        (100, Rejection.CORRUPT_HEADER),
    ],
)
def test_flips_give_the_right_reason(offset: int, reason: Rejection) -> None:
    slot, payload = make_page((64,))
    write(slot, payload)
    slot[offset] ^= 0x10
    assert verify(slot, payload) is reason


def test_payload_flip_caught_in_full_mode_only() -> None:
    slot, payload = make_page()
    write(slot, payload)
    payload[1].view[2999] ^= 0x80
    assert verify(slot, payload, full=True) is Rejection.CORRUPT_CHECKSUM
    assert verify(slot, payload, full=False) is None


def test_wrong_key_geometry_layout_length() -> None:
    slot, payload = make_page()
    write(slot, payload)
    assert verify(slot, payload, key=KEY + "x") is Rejection.WRONG_KEY
    assert verify(slot, payload, fingerprint="0000000000000000") is Rejection.WRONG_GEOMETRY
    assert verify(slot, payload, layout=Layout.PAGE_FIRST_DIRECT) is Rejection.LAYOUT_MISMATCH
    assert verify(slot, payload[:1]) is Rejection.WRONG_LENGTH
    assert str(Rejection.LAYOUT_MISMATCH) == "layout_mismatch"


def test_zeroed_or_other_version_headers() -> None:
    slot, payload = make_page()
    assert verify(memoryview(bytearray(ENVELOPE_BYTES)), payload) is Rejection.BAD_MAGIC
    write(slot, payload)
    struct.pack_into("<H", slot, 8, FORMAT_VERSION + 1)
    assert verify(slot, payload) is Rejection.UNSUPPORTED_VERSION


def test_unknown_checksum_algorithm_with_a_valid_header_checksum() -> None:
    slot, payload = make_page()
    write(slot, payload)
    slot[49] = 77  # checksum algorithm id
    struct.pack_into("<Q", slot, 96, xxhash.xxh3_64_intdigest(bytes(slot[:96])))
    assert verify(slot, payload) is Rejection.UNKNOWN_CHECKSUM


def test_every_layout_has_a_distinct_code() -> None:
    codes = {layout_code(layout) for layout in Layout}
    assert len(codes) == len(Layout) and 0 not in codes


def test_bad_arguments_are_errors() -> None:
    slot, payload = make_page()
    with pytest.raises(InvalidFieldError, match="slot"):
        write(memoryview(bytearray(64)), payload)
    for bad in ("", "x" * 33, "é"):
        with pytest.raises(InvalidFieldError, match="fingerprint"):
            write(slot, payload, fingerprint=bad)
    with pytest.raises(ValueError):
        write(slot, payload, layout="diagonal")


# --- EnvelopeFormat: the precomputed per-store form must say exactly what the functions say


def _format_page(sizes: tuple[int, ...] = (1000, 3000)) -> tuple[memoryview, list[memoryview]]:
    slot, payload = make_page(sizes)
    return slot, [e.view for e in payload]


def test_envelope_format_writes_the_same_bytes_as_write_envelope() -> None:
    fmt = EnvelopeFormat(FP, Layout.PAGE_FIRST)
    slot, views = _format_page()
    fmt.write(slot, KEY, views)
    other = memoryview(bytearray(os.urandom(ENVELOPE_BYTES)))
    write(other, [extent_of_view(v) for v in views])
    assert bytes(slot) == bytes(other)


@pytest.mark.parametrize(
    ("offset", "over"),
    [
        (0, {}),  # magic
        (8, {}),  # version
        (10, {}),  # header length
        (12, {}),  # flags: only the header checksum notices
        (16, {}),  # fingerprint
        (48, {}),  # layout code
        (49, {}),  # checksum id
        (56, {}),  # key digest
        (72, {}),  # payload length
        (80, {}),  # stored payload checksum
        (96, {}),  # the header checksum itself
        (None, {"key": "another-key"}),
        (None, {"fingerprint": "0000"}),
        (None, {"layout": Layout.LAYER_FIRST}),
        (None, {"payload_byte": 5}),
        (None, {"short_payload": True}),
    ],
)
@pytest.mark.parametrize("full", [True, False])
def test_envelope_format_verify_agrees_with_verify_envelope(
    offset: int | None, over: dict, full: bool
) -> None:
    slot, views = _format_page()
    EnvelopeFormat(FP, Layout.PAGE_FIRST).write(slot, KEY, views)
    over = dict(over)
    payload_only = "payload_byte" in over
    if offset is not None:
        slot[offset] ^= 0x40
    if "payload_byte" in over:
        views[1][over.pop("payload_byte")] ^= 1
    if over.pop("short_payload", False):
        views = [views[0], views[1][:-1]]
    key = over.get("key", KEY)
    fmt = EnvelopeFormat(over.get("fingerprint", FP), over.get("layout", Layout.PAGE_FIRST))
    expected = verify(slot, [extent_of_view(v) for v in views], full=full, **over)
    assert fmt.verify(slot, key, views, full=full) == expected
    # every case is a bad page, which only header-only mode may miss in the payload
    assert (expected is None) == (payload_only and not full)


def test_envelope_format_refuses_a_bad_fingerprint() -> None:
    with pytest.raises(InvalidFieldError, match="fingerprint"):
        EnvelopeFormat("x" * 33, Layout.PAGE_FIRST)


def test_envelope_format_names_a_slot_too_small_for_the_header() -> None:
    fmt = EnvelopeFormat(FP, Layout.PAGE_FIRST)
    with pytest.raises(InvalidFieldError, match="slot"):
        fmt.write(memoryview(bytearray(HEADER.size - 1)), KEY, [])
    with pytest.raises(InvalidFieldError, match="slot"):
        fmt.verify(memoryview(bytearray(HEADER.size - 1)), KEY, [])


def test_envelope_format_takes_a_slot_of_wider_items() -> None:
    fmt = EnvelopeFormat(FP, Layout.PAGE_FIRST)
    slot, views = _format_page()
    wide = slot.cast("I")  # the same bytes seen as 4-byte items
    fmt.write(wide, KEY, views)
    assert fmt.verify(wide, KEY, views) is None
    assert verify(slot, [extent_of_view(v) for v in views]) is None
