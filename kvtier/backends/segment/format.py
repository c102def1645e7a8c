"""The segment store's on-disk format: segment files, records, names and sequence numbers.

A store is one directory per namespace holding segment files::

    <root>/<namespace>/                         0700
      <id:016x>-<tag:08x>.seg                   a segment, 0600 (id: its creation time)
      .<id:016x>-<tag:08x>.<pid>.tmp            a segment being created; never read

A segment starts with a :data:`SEGMENT_HEADER` block (:data:`ALIGN` bytes, checksummed)
and is followed by records, each at an offset that is a multiple of :data:`ALIGN`::

    record header   BATCH fixed part (32 bytes) + its xxh3-64 (8 bytes)
                    count entries (seq u64, length u64, key length u16, key 160 bytes)
                    count state bytes (LIVE 0, DEAD 1; outside the checksum)
                    zeros up to a multiple of ALIGN          -> header_bytes
    data            the count pages, back to back: each exactly the bytes the page's
                    regions hold (envelope slot, then payload), no padding between them
    (zeros up to a multiple of ALIGN before the next record)

The pages of one record are contiguous, so a get of consecutive pages of one batch put
is one ``preadv``. Each page carries the core's envelope (key digest, length, checksum),
so the record header only has to say which key each page belongs to, how long it is and
which version it is (``seq``, the last writer's wins).

A record is published by writing its data first and its header last: a writer killed
in between leaves zeros (or a torn header, which fails its checksum) where the header
belongs, so the pages are misses, never wrong bytes. Records are reserved at the tail
and written side by side, so such a hole may lie before records that were published
(and acknowledged) after it: a scan of a segment nobody writes any more looks past a
hole for the next valid header at an aligned offset (:func:`is_record_magic` at each
:data:`ALIGN` boundary, then :func:`parse_record`), and never indexes the hole. A record
with ``count == 0`` is a *skip* record (:func:`pack_skip_record`): it spans space whose
write failed, so scans step over it without looking. A page's state byte goes DEAD
when the page is deleted or a newer version is published; a deleted page's first 8
bytes (its envelope magic) become :data:`ERASED` as well, so a reader holding an old
location finds no page.
"""

from __future__ import annotations

import re
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.core.errors import KvtierError
from kvtier.core.keys import MAX_KEY_LENGTH, validate_key

__all__ = [
    "ALIGN",
    "DEAD",
    "ENTRY_BYTES",
    "ERASED",
    "FIXED_BYTES",
    "LIVE",
    "MAX_RECORD_PAGES",
    "SEGMENT_HEADER_BYTES",
    "Clock",
    "Entry",
    "Record",
    "align",
    "header_bytes",
    "is_record_magic",
    "pack_record_header",
    "pack_segment_header",
    "pack_skip_record",
    "parse_record",
    "parse_segment_header",
    "segment_name",
    "segment_of_name",
    "temp_name",
    "temp_writer",
]

#: Alignment of the segment header, of every record and of the data after its header.
ALIGN = 4096
#: Bytes before the first record: the segment header, zero padded.
SEGMENT_HEADER_BYTES = ALIGN
#: Most pages in one record (a larger put is several records).
MAX_RECORD_PAGES = 512

SEGMENT_MAGIC = b"KVTSEGMT"
#: What a deleted page's first 8 bytes (its envelope magic) are overwritten with: a reader
#: that still holds its location (another process's index) reads it as a miss.
ERASED = b"KVTERASE"
RECORD_MAGIC = b"KVTBATCH"
VERSION = 1
LIVE = 0
DEAD = 1

#: magic, version, header bytes, flags, segment id, creation time (ns), writer pid; then
#: the xxh3-64 of those 40 bytes.
_SEGMENT = struct.Struct("<8sHHIQQI4x")
_SUM = struct.Struct("<Q")
#: magic, version, count, header bytes, segment id, data bytes; then their xxh3-64
#: (covering the entries too).
_FIXED = struct.Struct("<8sHHIQQ")
FIXED_BYTES = _FIXED.size + _SUM.size
#: seq, length, key length, key (zero padded).
_ENTRY = struct.Struct(f"<QQH{MAX_KEY_LENGTH}s6x")
ENTRY_BYTES = _ENTRY.size

_NAME = re.compile(r"([0-9a-f]{16})-([0-9a-f]{8})\.seg")
_TEMP = re.compile(r"\.([0-9a-f]{16})-([0-9a-f]{8})\.([0-9]+)\.tmp")


def align(offset: int) -> int:
    """``offset`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


def header_bytes(count: int) -> int:
    """Bytes of the header of a record of ``count`` pages (a multiple of :data:`ALIGN`)."""
    return align(FIXED_BYTES + count * (ENTRY_BYTES + 1)) if count else ALIGN


def state_offset(header: int, count: int, index: int) -> int:
    """File offset of the state byte of entry ``index`` of the record at ``header``."""
    return header + FIXED_BYTES + count * ENTRY_BYTES + index


# --- names ---------------------------------------------------------------------------


def segment_name(segment_id: int, tag: int) -> str:
    """The file name of segment ``segment_id`` (``tag``: random, so names never repeat)."""
    return f"{segment_id:016x}-{tag:08x}.seg"


def segment_of_name(name: str) -> int | None:
    """The segment id a segment file name carries, or None if it is not one."""
    match = _NAME.fullmatch(name)
    return int(match.group(1), 16) if match else None


#: The file every instance of a namespace holds a shared ``flock`` on while it is open,
#: so one can tell it is alone (``SegmentStore.exclusive``).
INSTANCES = ".instances"


def temp_name(segment_id: int, tag: int, pid: int) -> str:
    """The name a segment has while process ``pid`` creates it (hidden: never read)."""
    return f".{segment_id:016x}-{tag:08x}.{pid}.tmp"


def temp_writer(name: str) -> int | None:
    """The pid in a segment temp name, or None if ``name`` is not one."""
    match = _TEMP.fullmatch(name)
    return int(match.group(3)) if match else None


# --- the segment header --------------------------------------------------------------


def pack_segment_header(segment_id: int, created_ns: int, pid: int) -> bytes:
    """The first :data:`SEGMENT_HEADER_BYTES` of a new segment."""
    body = _SEGMENT.pack(
        SEGMENT_MAGIC, VERSION, SEGMENT_HEADER_BYTES, 0, segment_id, created_ns, pid
    )
    head = body + _SUM.pack(xxhash.xxh3_64_intdigest(body))
    return head + bytes(SEGMENT_HEADER_BYTES - len(head))


def parse_segment_header(data: bytes) -> tuple[int, int] | None:
    """``(segment id, creation time ns)`` from a segment's first bytes; None if invalid."""
    end = _SEGMENT.size
    if len(data) < end + _SUM.size:
        return None
    body = data[:end]
    (stored,) = _SUM.unpack_from(data, end)
    if xxhash.xxh3_64_intdigest(body) != stored:
        return None
    magic, version, size, _flags, segment_id, created, _pid = _SEGMENT.unpack(body)
    if magic != SEGMENT_MAGIC or version != VERSION or size != SEGMENT_HEADER_BYTES:
        return None
    return segment_id, created


# --- records -------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One page of a record, as its header describes it."""

    key: str
    seq: int
    length: int
    live: bool


@dataclass(frozen=True)
class Record:
    """A parsed record header: where its data starts and what it holds."""

    offset: int
    header_bytes: int
    data_bytes: int
    entries: tuple[Entry, ...]

    @property
    def end(self) -> int:
        """Where the next record may start."""
        return align(self.offset + self.header_bytes + self.data_bytes)


def pack_record_header(
    segment_id: int, keys: Sequence[str], seqs: Sequence[int], lengths: Sequence[int]
) -> bytes:
    """The header of a record of these pages (every state LIVE), :func:`header_bytes` long.

    ``keys`` are checked page keys (ASCII, at most 160 characters), one length and one
    sequence number each.
    """
    count = len(keys)
    data = sum(lengths)
    return _pack_header(segment_id, count, data, keys, seqs, lengths)


def pack_skip_record(segment_id: int, span: int) -> bytes:
    """The header of a skip record over ``span`` bytes from its start (a reservation whose
    write failed): scans step to the aligned end of the span without looking inside."""
    return _pack_header(segment_id, 0, max(0, span - header_bytes(0)), (), (), ())


def _pack_header(
    segment_id: int,
    count: int,
    data: int,
    keys: Sequence[str],
    seqs: Sequence[int],
    lengths: Sequence[int],
) -> bytes:
    fixed = _FIXED.pack(RECORD_MAGIC, VERSION, count, header_bytes(count), segment_id, data)
    entries = b"".join(
        _ENTRY.pack(seq, length, len(key), key.encode("ascii"))
        for key, seq, length in zip(keys, seqs, lengths, strict=True)
    )
    digest = xxhash.xxh3_64()
    digest.update(fixed)
    digest.update(entries)
    head = b"".join((fixed, _SUM.pack(digest.intdigest()), entries, bytes(count)))
    return head + bytes(header_bytes(count) - len(head))


def is_record_magic(data: bytes | memoryview, at: int = 0) -> bool:
    """Whether a record header's magic starts at ``data[at:]`` (a candidate a scan that
    looks past a hole parses in full)."""
    return data[at : at + len(RECORD_MAGIC)] == RECORD_MAGIC


def parse_record(data: bytes, offset: int, segment_id: int) -> tuple[Record | None, int]:
    """The record whose header starts ``data`` (read at ``offset``), or why there is none.

    Returns ``(record, 0)``; or ``(None, n)`` when ``data`` is too short and ``n`` bytes
    are needed; or ``(None, -1)`` when there is no valid record here: zeros (nothing was
    published yet, or a writer died before publishing), a torn or corrupt header, or a
    record of another segment.
    """
    if len(data) < FIXED_BYTES:
        return None, FIXED_BYTES
    magic, version, count, size, seg, data_bytes = _FIXED.unpack_from(data, 0)
    if (
        magic != RECORD_MAGIC
        or version != VERSION
        or seg != segment_id
        or count > MAX_RECORD_PAGES
        or size != header_bytes(count)
    ):
        return None, -1
    need = FIXED_BYTES + count * (ENTRY_BYTES + 1)
    if len(data) < need:
        return None, need
    (stored,) = _SUM.unpack_from(data, _FIXED.size)
    digest = xxhash.xxh3_64()
    digest.update(data[: _FIXED.size])
    digest.update(data[FIXED_BYTES : FIXED_BYTES + count * ENTRY_BYTES])
    if digest.intdigest() != stored:
        return None, -1
    entries: list[Entry] = []
    total = 0
    states = FIXED_BYTES + count * ENTRY_BYTES
    for i in range(count):
        seq, length, key_length, raw = _ENTRY.unpack_from(data, FIXED_BYTES + i * ENTRY_BYTES)
        try:
            key = validate_key(raw[:key_length].decode("ascii"))
        except (UnicodeDecodeError, KvtierError):
            return None, -1
        if length <= 0:
            return None, -1
        total += length
        entries.append(Entry(key, seq, length, data[states + i] == LIVE))
    if count and total != data_bytes:
        return None, -1
    return Record(offset, size, data_bytes, tuple(entries)), 0


class Clock:
    """Sequence numbers and segment ids: the wall clock in ns, strictly increasing here.

    Several processes on one host share the clock, so a later put of a key has a higher
    number than an earlier one wherever it was made ("last writer wins"); within a
    process numbers never repeat. Seeded at start-up past everything already on disk,
    so a clock stepped back cannot make new pages lose to old ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def seed(self, value: int) -> None:
        """Never hand out ``value`` or anything below it."""
        with self._lock:
            self._last = max(self._last, value)

    def next(self, count: int = 1) -> int:
        """The first of ``count`` consecutive fresh numbers."""
        with self._lock:
            first = max(time.time_ns(), self._last + 1)
            self._last = first + count - 1
            return first
