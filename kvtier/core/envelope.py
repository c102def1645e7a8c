"""The stored page format: a fixed-size envelope header in front of every page's payload.

The envelope is a little-endian binary header at the start of a :data:`ENVELOPE_BYTES`
slot; the rest of the slot is zero. ``docs/integrity.md`` describes it byte by byte;
:mod:`kvtier.core.envelope_layout` declares its fields, the one layout this module and the
compiled code (``kvtier/_csrc/envelope.c``) both follow.
The payload checksum streams over the page's extents in place (no concatenation); the
header carries its own checksum, so a flipped bit in the header is caught too.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvtier.core.envelope_layout import (
    BODY_BYTES,
    CHECKSUM_XXH3_128,
    FORMAT_VERSION,
    MAGIC,
    STATIC_BYTES,
    fields_struct,
    place,
)
from kvtier.core.errors import InvalidFieldError
from kvtier.core.extents import Extent
from kvtier.core.layout import ALIGNMENT, Layout

__all__ = [
    "BODY_BYTES",
    "ENVELOPE_BYTES",
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "STATIC_BYTES",
    "BatchEnvelope",
    "ChecksumAlgorithm",
    "EnvelopeFormat",
    "Rejection",
    "key_digest",
    "layout_code",
    "payload_checksum",
    "validate_fingerprint",
    "verify_envelope",
    "write_envelope",
]

#: Bytes reserved for the envelope in front of every stored page: one alignment block,
#: which keeps the payload aligned for O_DIRECT on storage and the header slot aligned in
#: the host pool.
ENVELOPE_BYTES = ALIGNMENT


#: magic, version, header length, flags, fingerprint, layout code, checksum id, reserved,
#: key digest, payload length, payload checksum: what the header checksum covers.
_BODY = fields_struct(end="header_checksum")
_HEADER_SUM = fields_struct("header_checksum")
#: The whole header: body plus its xxh3_64 checksum.
HEADER = fields_struct()
_PREFIX = fields_struct(end="flags")  # magic, version, header length
_LENGTH = fields_struct("payload_length", "payload_checksum")
_FINGERPRINT_BYTES = place("fingerprint")[1]
#: Where the payload length starts (the key digest ends); where the payload checksum is.
_LENGTH_AT = place("payload_length")[0]
_CHECKSUM_AT, _CHECKSUM_BYTES = place("payload_checksum")
_CHECKSUM = slice(_CHECKSUM_AT, _CHECKSUM_AT + _CHECKSUM_BYTES)
_ZEROS = memoryview(bytes(ENVELOPE_BYTES))

_LAYOUT_CODES: dict[Layout, int] = {
    Layout.LAYER_FIRST: 1,
    Layout.PAGE_FIRST: 2,
    Layout.PAGE_FIRST_DIRECT: 3,
    Layout.PAGE_HEAD: 4,
}


class ChecksumAlgorithm(enum.IntEnum):
    """The payload checksum, by the id stored in the header."""

    XXH3_128 = CHECKSUM_XXH3_128


#: The algorithm :func:`write_envelope` uses (chosen by measurement, docs/integrity.md).
DEFAULT_CHECKSUM = ChecksumAlgorithm.XXH3_128


class Rejection(str, enum.Enum):
    """Why a stored page was rejected; the value is the stats counter name."""

    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    CORRUPT_HEADER = "corrupt_header"
    WRONG_GEOMETRY = "wrong_geometry"
    LAYOUT_MISMATCH = "layout_mismatch"
    WRONG_KEY = "wrong_key"
    UNKNOWN_CHECKSUM = "unknown_checksum"
    WRONG_LENGTH = "wrong_length"
    CORRUPT_CHECKSUM = "corrupt_checksum"

    def __str__(self) -> str:
        return self.value


def layout_code(layout: Layout | str) -> int:
    """The one-byte code of a layout in the header."""
    return _LAYOUT_CODES[Layout(layout)]


def key_digest(key: str) -> bytes:
    """16 bytes of BLAKE2b over the key: which key a stored page was written under."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()


def validate_fingerprint(fingerprint: str) -> str:
    """Return ``fingerprint`` if it fits the header (1 to 32 ASCII characters); else raise."""
    _fingerprint_field(fingerprint)
    return fingerprint


def _fingerprint_field(fingerprint: str) -> bytes:
    ok = isinstance(fingerprint, str) and fingerprint.isascii()
    raw = fingerprint.encode("ascii") if ok else b""
    if not raw or len(raw) > _FINGERPRINT_BYTES:
        raise InvalidFieldError(
            "fingerprint",
            f"must be 1 to {_FINGERPRINT_BYTES} ASCII characters, got {fingerprint!r}",
            value=fingerprint,
        )
    return raw.ljust(_FINGERPRINT_BYTES, b"\0")


def _view(slot: Extent | memoryview) -> memoryview:
    view = slot.view if isinstance(slot, Extent) else slot
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes < HEADER.size:
        raise InvalidFieldError(
            "slot",
            f"an envelope slot needs at least {HEADER.size} bytes, got {view.nbytes}",
            value=view.nbytes,
        )
    return view


def payload_checksum(payload: Sequence[Extent | memoryview]) -> tuple[int, bytes]:
    """Payload length and its xxh3_128 digest, streamed over the extents in place."""
    h = xxhash.xxh3_128()
    length = 0
    for region in payload:
        view = region.view if isinstance(region, Extent) else region
        h.update(view)
        length += view.nbytes
    return length, h.digest()


def write_envelope(
    slot: Extent | memoryview,
    *,
    key: str,
    fingerprint: str,
    layout: Layout | str,
    payload: Sequence[Extent | memoryview],
) -> None:
    """Write the envelope for ``payload`` stored under ``key`` into ``slot``; zero the rest."""
    view = _view(slot)
    length, digest = payload_checksum(payload)
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER.size,
        0,
        _fingerprint_field(fingerprint),
        layout_code(layout),
        int(DEFAULT_CHECKSUM),
        b"",
        key_digest(key),
        length,
        digest,
    )
    view[: _BODY.size] = body
    _HEADER_SUM.pack_into(view, _BODY.size, xxhash.xxh3_64_intdigest(body))
    rest = view.nbytes - HEADER.size
    view[HEADER.size :] = _ZEROS[:rest] if rest <= len(_ZEROS) else bytes(rest)


def verify_envelope(
    slot: Extent | memoryview,
    *,
    key: str,
    fingerprint: str,
    layout: Layout | str,
    payload: Sequence[Extent | memoryview],
    full: bool = True,
) -> Rejection | None:
    """Why the page in ``slot`` + ``payload`` must not be used, or None if it is valid.

    ``full=False`` checks the header only (magic, version, header checksum, geometry,
    layout, key, length) and skips the payload checksum.
    """
    view = _view(slot)
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        return Rejection.BAD_MAGIC
    if version != FORMAT_VERSION:
        return Rejection.UNSUPPORTED_VERSION
    if header_len != HEADER.size:
        return Rejection.CORRUPT_HEADER
    body = bytes(view[: _BODY.size])
    (stored_sum,) = _HEADER_SUM.unpack_from(view, _BODY.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        return Rejection.CORRUPT_HEADER
    (_, _, _, _, fp, code, algo, _, digest, length, checksum) = _BODY.unpack(body)
    if fp != _fingerprint_field(fingerprint):
        return Rejection.WRONG_GEOMETRY
    if code != layout_code(layout):
        return Rejection.LAYOUT_MISMATCH
    if digest != key_digest(key):
        return Rejection.WRONG_KEY
    if algo not in ChecksumAlgorithm.__members__.values():
        return Rejection.UNKNOWN_CHECKSUM
    expected = sum(
        (region.view if isinstance(region, Extent) else region).nbytes for region in payload
    )
    if length != expected:
        return Rejection.WRONG_LENGTH
    if full:
        _, actual = payload_checksum(payload)
        if actual != checksum:
            return Rejection.CORRUPT_CHECKSUM
    return None


@dataclass
class BatchEnvelope:
    """One batch's envelopes, for a backend that writes and checks them in its own loop.

    Every header is ``static`` + the page's key digest + payload length (u64) + payload
    xxh3-128 (canonical), then the xxh3-64 of those :data:`BODY_BYTES`, little-endian
    (``docs/integrity.md``). On a get the backend appends to ``valid`` the index of every
    page it found valid (the payload checksum included when ``full``); the core checks
    any other page it filled. The key digest is :func:`key_digest` of the page's key in
    ``keys``; the backend computes it where it writes or checks the header (the file
    backends' compiled loop hashes the keys in C).
    """

    static: bytes
    keys: Sequence[str]
    full: bool = True
    valid: list[int] = field(default_factory=list)


class EnvelopeFormat:
    """:func:`write_envelope` / :func:`verify_envelope` for one fingerprint and layout.

    The fields every page of a store shares (magic, version, fingerprint, layout,
    checksum id) are packed once, so a page costs one comparison of them, the key digest,
    the header checksum and the payload checksum. Same bytes, same answers as the
    functions (a mismatch is explained by :func:`verify_envelope` itself); payloads are
    plain byte-format memoryviews, as the page's extents hold them.
    """

    def __init__(self, fingerprint: str, layout: Layout | str) -> None:
        self.fingerprint = validate_fingerprint(fingerprint)
        self.layout = Layout(layout)
        self._static = _BODY.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER.size,
            0,
            _fingerprint_field(fingerprint),
            layout_code(layout),
            int(DEFAULT_CHECKSUM),
            b"",
            b"",
            0,
            b"",
        )[:STATIC_BYTES]

    def batch(self, keys: Sequence[str], *, full: bool = True) -> BatchEnvelope:
        """The envelopes of ``keys``, for a backend that writes or checks them itself."""
        return BatchEnvelope(self._static, keys, full)

    def write(self, slot: memoryview, key: str, payload: Sequence[memoryview]) -> None:
        """Write ``key``'s envelope for ``payload`` into ``slot`` and zero the slot's rest."""
        if slot.format != "B" or slot.ndim != 1 or slot.nbytes < HEADER.size:
            slot = _view(slot)  # cast, or the error that names a too-small slot
        h = xxhash.xxh3_128()
        length = 0
        for view in payload:
            h.update(view)
            length += view.nbytes
        body = b"".join((self._static, key_digest(key), _LENGTH.pack(length), h.digest()))
        end = _BODY.size
        slot[:end] = body
        _HEADER_SUM.pack_into(slot, end, xxhash.xxh3_64_intdigest(body))
        rest = slot.nbytes - HEADER.size
        slot[HEADER.size :] = _ZEROS[:rest] if rest <= len(_ZEROS) else bytes(rest)

    def verify(
        self,
        slot: memoryview,
        key: str,
        payload: Sequence[memoryview],
        *,
        full: bool = True,
        digest: bytes | None = None,
    ) -> Rejection | None:
        """Why the page in ``slot`` + ``payload`` must not be used, or None if it is valid.

        ``digest``: the payload's xxh3-128, when the caller hashed it as it was read
        (then the payload is not read a second time).
        """
        if slot.format != "B" or slot.ndim != 1 or slot.nbytes < HEADER.size:
            slot = _view(slot)
        body = bytes(slot[: _BODY.size])
        expected = 0
        for view in payload:
            expected += view.nbytes
        if (
            body[:STATIC_BYTES] != self._static
            or body[STATIC_BYTES:_LENGTH_AT] != key_digest(key)
            or _LENGTH.unpack_from(body, _LENGTH_AT)[0] != expected
        ):  # something differs: let the general check say what
            return verify_envelope(
                slot,
                key=key,
                fingerprint=self.fingerprint,
                layout=self.layout,
                payload=payload,
                full=full,
            )
        (stored_sum,) = _HEADER_SUM.unpack_from(slot, _BODY.size)
        if xxhash.xxh3_64_intdigest(body) != stored_sum:
            return Rejection.CORRUPT_HEADER
        if full:
            if digest is None:
                h = xxhash.xxh3_128()
                for view in payload:
                    h.update(view)
                digest = h.digest()
            if digest != body[_CHECKSUM]:
                return Rejection.CORRUPT_CHECKSUM
        return None
