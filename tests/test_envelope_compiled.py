"""The core's compiled envelope code (``kvtier.core._envelope``) against the Python one.

The compiled writer must write byte for byte what :func:`~kvtier.core.envelope.write_envelope`
writes, and the compiled verifier must give every page, whatever its damage, the verdict
:func:`~kvtier.core.envelope.verify_envelope` gives it (full and header-only); its key
digests are BLAKE2b-128 as :mod:`hashlib` computes it. Through ``PageStore`` the two paths
give the same results, verdicts and counters. ``KVTIER_REQUIRE_COMPILED=1`` (CI) makes a
missing build a failure instead of a skip.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import xxhash

import kvtier
from kvtier.core import compiled_envelope
from kvtier.core.envelope import (
    BODY_BYTES,
    ENVELOPE_BYTES,
    HEADER,
    EnvelopeFormat,
    Rejection,
    key_digest,
    verify_envelope,
    write_envelope,
)
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import PageBuffers, StorageBackend
from kvtier.testing import require

FP = "fedcba9876543210"
KEY = "0123456789abcdef-00aa"
LAYOUTS = tuple(Layout)


@pytest.fixture(autouse=True)
def _compiled_envelope_built() -> None:
    missing = None if compiled_envelope.available() else f"not built: {compiled_envelope.MISSING}"
    require("compiled", missing)


def _static(fingerprint: str = FP, layout: Layout | str = Layout.PAGE_FIRST) -> bytes:
    return EnvelopeFormat(fingerprint, layout).batch(()).static


def _page(
    rng: random.Random, sizes: Sequence[int], slot_bytes: int = ENVELOPE_BYTES
) -> tuple[memoryview, list[memoryview]]:
    """A slot of garbage (the writer must zero its rest) and random payload regions."""
    slot = memoryview(bytearray(rng.randbytes(slot_bytes)))
    return slot, [memoryview(bytearray(rng.randbytes(n))) for n in sizes]


def _sizes(rng: random.Random) -> list[int]:
    """Payload region sizes: none to five regions, empty ones and odd lengths included."""
    choices = (0, 1, 7, 64, 100, 255, 256, 1000, 4096, 5000, 16384, 70001)
    return [rng.choice(choices) for _ in range(rng.randrange(0, 6))]


def _key(rng: random.Random) -> str:
    """A key: checked page keys, and any str the Python digest takes (long, non-ASCII)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_"
    kind = rng.randrange(3)
    if kind == 0:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 161)))
    if kind == 1:
        return "".join(rng.choice("aé字🙂-") for _ in range(rng.randrange(0, 200)))
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(100, 400)))


def _python_verdict(
    slot: memoryview,
    payload: Sequence[memoryview],
    key: str,
    full: bool,
    fingerprint: str = FP,
    layout: Layout | str = Layout.PAGE_FIRST,
) -> Rejection | None:
    return verify_envelope(
        slot, key=key, fingerprint=fingerprint, layout=layout, payload=payload, full=full
    )


def _compiled_verdict(
    slot: memoryview,
    payload: Sequence[memoryview],
    key: str,
    full: bool,
    fingerprint: str = FP,
    layout: Layout | str = Layout.PAGE_FIRST,
) -> Rejection | None:
    (verdict,) = compiled_envelope.verify_envelopes(
        _static(fingerprint, layout), [key], [[slot, *payload]], full=full
    )
    return verdict


def _reseal(slot: memoryview) -> None:
    """Recompute the header checksum, so that a changed field is what gets noticed."""
    struct.pack_into("<Q", slot, BODY_BYTES, xxhash.xxh3_64_intdigest(bytes(slot[:BODY_BYTES])))


# --- key digests ---------------------------------------------------------------------


def test_key_digests_match_hashlib() -> None:
    rng = random.Random(1)
    keys = ["", "a", KEY, "x" * 127, "x" * 128, "x" * 129, "y" * 256, "é" * 64]
    keys += [_key(rng) for _ in range(300)]
    for key in keys:
        expected = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
        assert compiled_envelope.key_digest(key) == expected == key_digest(key), key


def test_the_written_key_digest_is_hashlibs() -> None:
    rng = random.Random(2)
    for _ in range(50):
        key = _key(rng)
        slot, payload = _page(rng, [100])
        compiled_envelope.write_envelopes(_static(), [key], [[slot, *payload]])
        expected = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
        assert bytes(slot[56:72]) == expected


# --- the writer ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_the_writer_writes_the_bytes_write_envelope_writes(seed: int) -> None:
    rng = random.Random(seed)
    keys: list[str] = []
    pages: list[list[memoryview]] = []
    expected: list[bytes] = []
    fingerprint = "".join(rng.choice("0123456789abcdef") for _ in range(rng.randrange(1, 33)))
    layout = rng.choice(LAYOUTS)
    for _ in range(24):
        key = _key(rng)
        slot_bytes = rng.choice((HEADER.size, 200, ENVELOPE_BYTES, 2 * ENVELOPE_BYTES))
        slot, payload = _page(rng, _sizes(rng), slot_bytes)
        theirs = memoryview(bytearray(rng.randbytes(slot_bytes)))
        write_envelope(theirs, key=key, fingerprint=fingerprint, layout=layout, payload=payload)
        keys.append(key)
        pages.append([slot, *payload])
        expected.append(bytes(theirs))
    compiled_envelope.write_envelopes(_static(fingerprint, layout), keys, pages)
    for key, page, want in zip(keys, pages, expected, strict=True):
        assert bytes(page[0]) == want  # the header, and the rest of the slot zeroed
        assert _python_verdict(page[0], page[1:], key, True, fingerprint, layout) is None


def test_the_writer_takes_extents_and_host_pool_pages() -> None:
    geometry = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
    for layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_HEAD):
        pool = HostPool(geometry, layout, num_pages=3, pin_memory=False)
        keys = PageKeyer(Namespace("m", geometry.fingerprint), 4).keys(list(range(12)))
        pages = [pool.page_buffers(p) for p in range(3)]
        for page in pages:
            for extent in page[1:]:
                extent.view[:] = os.urandom(extent.length)
        static = _static(geometry.fingerprint, layout)
        compiled_envelope.write_envelopes(static, keys, pages)
        for key, page in zip(keys, pages, strict=True):
            theirs = memoryview(bytearray(ENVELOPE_BYTES))
            payload = [e.view for e in page[1:]]
            write_envelope(
                theirs, key=key, fingerprint=geometry.fingerprint, layout=layout, payload=payload
            )
            assert bytes(page[0].view) == bytes(theirs)
        assert compiled_envelope.verify_envelopes(static, keys, pages) == [None] * 3


# --- the verifier ----------------------------------------------------------------------

Damage = Callable[[memoryview, list[memoryview], random.Random], None]


def _set(offset: int, fmt: str, value: int, reseal: bool = True) -> Damage:
    def damage(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
        struct.pack_into(fmt, slot, offset, value)
        if reseal:
            _reseal(slot)

    return damage


def _flip_header(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    slot[rng.randrange(HEADER.size)] ^= 1 << rng.randrange(8)


def _flip_payload(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    regions = [view for view in payload if view.nbytes]
    if regions:
        view = rng.choice(regions)
        view[rng.randrange(view.nbytes)] ^= 1 << rng.randrange(8)


def _fingerprint(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    slot[16:48] = b"0123456789abcdef".ljust(32, b"\0")
    _reseal(slot)


def _zero_header(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    slot[: HEADER.size] = bytes(HEADER.size)


def _garbage_header(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    slot[: HEADER.size] = rng.randbytes(HEADER.size)


def _garbage_after_magic(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    slot[8 : HEADER.size] = rng.randbytes(HEADER.size - 8)


def _padding(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    if slot.nbytes > HEADER.size:
        slot[HEADER.size] = 0xFF  # carries nothing: not verified


#: Header fields a damage can change (each resealed), for several changed at once.
FIELDS: tuple[Damage, ...] = (
    _set(8, "<H", 3),
    _set(10, "<H", 96),
    _fingerprint,
    _set(48, "<B", 1),
    _set(49, "<B", 5),
    _set(60, "<I", 1),
    _set(72, "<Q", 12),
    _set(88, "<Q", 1),
)


def _several(slot: memoryview, payload: list[memoryview], rng: random.Random) -> None:
    """Two or more fields at once: the verdict is the first in verify_envelope's order."""
    for damage in rng.sample(FIELDS, rng.randrange(2, len(FIELDS) + 1)):
        damage(slot, payload, rng)


#: Every kind of damage, named by what it does (the verdicts come from the Python path).
DAMAGE: dict[str, Damage] = {
    "none": lambda slot, payload, rng: None,
    "bad_magic": _set(0, "<B", ord("X"), reseal=False),
    "bad_magic_resealed": _set(7, "<B", ord("X")),
    "zeroed_header": _zero_header,
    "garbage_header": _garbage_header,
    "garbage_after_magic": _garbage_after_magic,
    "version": _set(8, "<H", 2),
    "version_unsealed": _set(8, "<H", 2, reseal=False),
    "header_length": _set(10, "<H", 105),
    "flags": _set(12, "<I", 1),
    "flags_unsealed": _set(12, "<I", 1, reseal=False),
    "header_checksum": _set(96, "<Q", 12345, reseal=False),
    "header_bit": _flip_header,
    "fingerprint": _fingerprint,
    "layout": _set(48, "<B", 9),
    "checksum_id": _set(49, "<B", 2),
    "checksum_id_zero": _set(49, "<B", 0),
    "reserved": _set(50, "<H", 7),
    "reserved_u32": _set(52, "<I", 7),
    "key_digest": _set(56, "<Q", 0xDEADBEEF),
    "length": _set(72, "<Q", 1),
    "length_huge": _set(72, "<Q", 2**64 - 1),
    "payload_checksum": _set(80, "<Q", 42),
    "payload_bit": _flip_payload,
    "padding": _padding,
    "checksum_id_and_length": lambda slot, payload, rng: (
        [damage(slot, payload, rng) for damage in (FIELDS[4], FIELDS[6])] and None
    ),
    "several_fields": _several,
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
@pytest.mark.parametrize("full", [True, False], ids=["full", "header"])
def test_every_kind_of_damage_gets_the_python_verdict(name: str, full: bool) -> None:
    rng = random.Random(name)
    seen: set[Rejection | None] = set()
    for _ in range(20):
        key = _key(rng)
        slot, payload = _page(rng, _sizes(rng) or [100])
        write_envelope(slot, key=key, fingerprint=FP, layout=Layout.PAGE_FIRST, payload=payload)
        DAMAGE[name](slot, payload, rng)
        theirs = _python_verdict(slot, payload, key, full)
        assert _compiled_verdict(slot, payload, key, full) == theirs
        seen.add(theirs)
    if name == "none":
        assert seen == {None}


@pytest.mark.parametrize("full", [True, False], ids=["full", "header"])
def test_every_verdict_is_reached_and_agrees(full: bool) -> None:
    """Each Rejection, reached through the reader's side too (another key, fingerprint,
    layout or payload length than the page was written with)."""
    rng = random.Random(3)
    seen: set[Rejection | None] = set()
    for trial in range(400):
        key = _key(rng)
        layout = rng.choice(LAYOUTS)
        slot, payload = _page(rng, _sizes(rng) or [64])
        write_envelope(slot, key=key, fingerprint=FP, layout=layout, payload=payload)
        DAMAGE[rng.choice(sorted(DAMAGE))](slot, payload, rng)
        reader_key = key if rng.random() < 0.7 else _key(rng)
        reader_fp = FP if rng.random() < 0.8 else "0011223344556677"
        reader_layout = layout if rng.random() < 0.8 else rng.choice(LAYOUTS)
        reader_payload = payload
        if rng.random() < 0.15:
            reader_payload = [*payload, memoryview(bytearray(rng.choice((1, 4096))))]
        args = (slot, reader_payload, reader_key, full, reader_fp, reader_layout)
        theirs = _python_verdict(*args)
        assert _compiled_verdict(*args) == theirs, trial
        seen.add(theirs)
    expected = set(Rejection) | {None}
    if not full:
        expected.discard(Rejection.CORRUPT_CHECKSUM)
    assert seen == expected


@pytest.mark.parametrize("offset", range(HEADER.size))
def test_any_flipped_header_byte_gets_the_python_verdict(offset: int) -> None:
    rng = random.Random(offset)
    slot, payload = _page(rng, [1000, 3000])
    write_envelope(slot, key=KEY, fingerprint=FP, layout=Layout.PAGE_FIRST, payload=payload)
    for resealed in (False, True):
        damaged = memoryview(bytearray(slot))
        damaged[offset] ^= 1 << rng.randrange(8)
        if resealed and offset < BODY_BYTES:
            _reseal(damaged)
        for full in (True, False):
            theirs = _python_verdict(damaged, payload, KEY, full)
            assert _compiled_verdict(damaged, payload, KEY, full) == theirs


def test_one_verdict_per_page_of_a_batch_in_order() -> None:
    rng = random.Random(4)
    static = _static()
    keys, pages, expected = [], [], []
    for name in sorted(DAMAGE) * 3:
        key = _key(rng)
        slot, payload = _page(rng, _sizes(rng) or [10])
        write_envelope(slot, key=key, fingerprint=FP, layout=Layout.PAGE_FIRST, payload=payload)
        DAMAGE[name](slot, payload, rng)
        keys.append(key)
        pages.append([slot, *payload])
        expected.append(_python_verdict(slot, payload, key, True))
    assert compiled_envelope.verify_envelopes(static, keys, pages) == expected
    assert compiled_envelope.verify_envelopes(static, [], []) == []


def test_bad_arguments_are_errors() -> None:
    slot, payload = _page(random.Random(5), [10])
    static = _static()
    with pytest.raises(TypeError):
        compiled_envelope.verify_envelopes(static[:55], [KEY], [[slot, *payload]])
    with pytest.raises(ValueError, match="keys for"):
        compiled_envelope.verify_envelopes(static, [KEY, KEY], [[slot, *payload]])
    with pytest.raises(TypeError, match="key must be a str"):
        compiled_envelope.write_envelopes(static, [b"k"], [[slot, *payload]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of its header slot"):
        compiled_envelope.write_envelopes(static, [KEY], [[]])
    with pytest.raises(ValueError, match="smaller than the envelope header"):
        compiled_envelope.write_envelopes(static, [KEY], [[slot[: HEADER.size - 1], *payload]])
    with pytest.raises((TypeError, BufferError)):  # a header slot that cannot be written
        compiled_envelope.write_envelopes(static, [KEY], [[memoryview(bytes(4096)), *payload]])
    assert bytes(slot[:8]) != b"KVTIERPG"  # nothing was written by the refused calls


def test_the_built_module_is_not_older_than_its_sources() -> None:
    # its own C file, and the shared ones: the one envelope source, hashing, glue
    # (hatch_build.py compiles them all)
    module = importlib.import_module("kvtier.core._envelope")
    built = Path(module.__file__ or "")
    home = Path(compiled_envelope.__file__).with_name("_envelope_src")
    if built.parent != home.parent:  # an installed wheel: built from its own source
        pytest.skip(f"the module was installed from a wheel ({built})")
    shared = Path(kvtier.__file__).with_name("_csrc")
    sources = sorted(home.glob("*.[ch]")) + sorted(shared.glob("*.[ch]"))
    names = {source.name for source in sources}
    assert {"module.c", "envelope.c", "envelope.h", "blake2b.c", "xxh.c", "kvhash.h"} <= names
    newer = [source.name for source in sources if source.stat().st_mtime > built.stat().st_mtime]
    assert not newer, (
        f"{built.name} is older than {', '.join(newer)}: rebuild it with "
        "`pip install --no-deps -e .`"
    )


# --- through PageStore -------------------------------------------------------------------

GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
PAGES = len(DAMAGE) + 3


class DamagingBackend(StorageBackend):
    """Stores each page's bytes in a dict; a get hands back each key's damaged copy."""

    def __init__(self, seed: int) -> None:
        self.objects: dict[str, bytearray] = {}
        self.damage: dict[str, Damage] = {}
        self.swap: dict[str, str] = {}  # key -> key whose object a get returns
        self.seed = seed

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        out = []
        for i, (key, regions) in enumerate(zip(keys, pages, strict=True)):
            blob = self.objects.get(self.swap.get(key, key))
            if blob is None or len(blob) < sum(r.length for r in regions):
                out.append(False)
                continue
            offset = 0
            for r in regions:
                r.view[:] = blob[offset : offset + r.length]
                offset += r.length
            damage = self.damage.get(key)
            if damage is not None:
                views = [r.view for r in regions]
                damage(views[0], views[1:], random.Random(self.seed * 1000 + i))
            out.append(True)
        return out

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        for key, regions in zip(keys, pages, strict=True):
            self.objects[key] = bytearray(b"".join(r.view for r in regions))
        return [True] * len(keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return [self.objects.pop(k, None) is not None for k in keys]

    def clear(self) -> None:
        self.objects.clear()

    def stats(self) -> dict[str, int | float]:
        return {}

    def close(self) -> None:
        pass


def _run_store(layout: Layout, *, seed: int, **store: Any) -> dict[str, Any]:
    """Put pages, damage them every way on the way back, get them: what the store said."""
    pool = HostPool(GEOMETRY, layout, num_pages=PAGES, pin_memory=False)
    rng = random.Random(seed)
    for page in range(PAGES):
        for extent in pool.extents(page):
            extent.view[:] = rng.randbytes(extent.length)
    keys = PageKeyer(Namespace("m", GEOMETRY.fingerprint), 4).keys(list(range(4 * PAGES)))
    backend = DamagingBackend(seed)
    ps = PageStore(
        backend, pool, fingerprint=GEOMETRY.fingerprint, backend_call_timeout_s=None, **store
    )
    pages = list(range(PAGES))
    put = ps.put(keys, pages)
    headers = [bytes(pool.header_extent(p).view) for p in pages]
    for key, name in zip(keys, sorted(DAMAGE), strict=False):
        backend.damage[key] = DAMAGE[name]
    backend.swap[keys[-3]] = keys[-2]  # another key's page: wrong_key
    backend.objects[keys[-1]] = backend.objects[keys[-1]][:100]  # truncated: a miss
    verdicts: dict[int, str] = {}
    got = ps.get(keys, pages, verdicts=verdicts)
    payloads = [b"".join(bytes(e.view) for e in pool.extents(p)) for p in pages]
    header_only = PageStore(
        backend, pool, fingerprint=GEOMETRY.fingerprint, verify="header", owns_backend=False
    )
    header_verdicts: dict[int, str] = {}
    header_got = header_only.get(keys, pages, verdicts=header_verdicts)
    return {
        "put": list(put),
        "headers": headers,
        "get": list(got),
        "verdicts": verdicts,
        "payloads": payloads,
        "stats": ps.stats(),
        "header_get": list(header_got),
        "header_verdicts": header_verdicts,
        "header_stats": header_only.stats(),
    }


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT])
def test_page_store_gives_the_same_answers_and_counters_either_way(
    layout: Layout, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _run_store(layout, seed=7, checksum_workers=workers)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Python path called the compiled code")

    with monkeypatch.context() as patch:  # the Python path, as where the module is missing
        patch.setattr(compiled_envelope, "available", lambda: False)
        patch.setattr(compiled_envelope, "write_envelopes", refuse)
        patch.setattr(compiled_envelope, "verify_envelopes", refuse)
        theirs = _run_store(layout, seed=7, checksum_workers=workers)
    assert ours == theirs
    assert ours["put"] == [True] * PAGES
    reasons = set(ours["verdicts"].values())
    assert reasons == {r.value for r in Rejection}  # every kind, through the store
    assert ours["stats"]["invalid"] == len(ours["verdicts"])
    assert ours["stats"]["misses"] == 1


def test_page_store_makes_one_compiled_call_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    write, verify = compiled_envelope.write_envelopes, compiled_envelope.verify_envelopes

    def counted_write(static: bytes, keys: Sequence[str], pages: Sequence[Any]) -> None:
        calls.append(("write", len(keys)))
        write(static, keys, pages)

    def counted_verify(
        static: bytes, keys: Sequence[str], pages: Sequence[Any], *, full: bool = True
    ) -> list[Rejection | None]:
        calls.append(("verify", len(keys)))
        return verify(static, keys, pages, full=full)

    monkeypatch.setattr(compiled_envelope, "write_envelopes", counted_write)
    monkeypatch.setattr(compiled_envelope, "verify_envelopes", counted_verify)
    pool = HostPool(GEOMETRY, Layout.PAGE_FIRST, num_pages=8, pin_memory=False)
    keys = PageKeyer(Namespace("m", GEOMETRY.fingerprint), 4).keys(list(range(32)))
    ps = PageStore(DamagingBackend(0), pool, fingerprint=GEOMETRY.fingerprint)
    assert ps.put(keys, range(8)) == [True] * 8
    assert ps.get(keys, range(8)) == [True] * 8
    assert calls == [("write", 8), ("verify", 8)]
    calls.clear()
    split = PageStore(
        DamagingBackend(0), pool, fingerprint=GEOMETRY.fingerprint, checksum_workers=3
    )
    assert split.put(keys, range(8)) == [True] * 8
    assert split.get(keys, range(8)) == [True] * 8
    # one call per checksum thread's slice of the batch
    assert sorted(calls) == sorted([(op, n) for op in ("write", "verify") for n in (3, 3, 2)])
    split.close()
    ps.close()
