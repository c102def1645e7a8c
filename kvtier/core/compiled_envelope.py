"""The core's envelope writer and verifier in compiled code (``_envelope``), or None.

``PageStore`` writes every page's envelope on put and verifies it on get. For a backend
without a compiled loop of its own (memory, mooncake, segment, third-party plugins) that
per-page work is the core's cost per page: in Python, 6-7 µs a 16 KiB page over a backend
that moves nothing, twice what a raw ``preadv`` of the page costs. ``_envelope`` (built
by ``hatch_build.py`` from ``_envelope_src/`` and the code shared with the file backends'
loop, ``kvtier/_csrc/``: the one C envelope writer and verifier, and the hashing) does a
whole batch in one call with the GIL released:
key digests (BLAKE2b-128), payload xxh3-128 streamed over the regions in place, header
xxh3-64, and one verdict per page, the very one :func:`~kvtier.core.envelope.verify_envelope`
decides. It binds xxHash at import, from the ``xxhash`` package (SIMD dispatch) or the
system's libxxhash (0.8 or later).

Where the module was not built (no C compiler), does not load, or was built for another
envelope layout than :mod:`kvtier.core.envelope_layout` declares, :data:`MISSING` says
why and :func:`available` is False: the caller runs :class:`~kvtier.core.envelope.EnvelopeFormat`
instead, with the same bytes and the same verdicts. Nothing here imports from outside
``kvtier.core``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

from kvtier.core.envelope import ChecksumAlgorithm, Rejection
from kvtier.core.envelope_layout import disagreement
from kvtier.core.extents import Extent

__all__ = [
    "MISSING",
    "available",
    "key_digest",
    "verify_envelopes",
    "write_envelopes",
]

#: One page's regions as the module takes them: header slot first, then the payload;
#: memoryviews or :class:`~kvtier.core.extents.Extent` (``HostPool.page_buffers``).
Regions = Sequence[Extent] | Sequence[memoryview]

#: The compiled module, or None where it was not built (then MISSING says why).
_envelope: Any = None
MISSING: str | None = None
#: Verdict code -> what :func:`~kvtier.core.envelope.verify_envelope` returns for it.
_VERDICTS: tuple[Rejection | None, ...] = ()


def _xxhash_libraries() -> list[str]:
    """The shared objects to bind XXH3 from: the xxhash package's extension (it carries
    the library, with SIMD dispatch), then the system's ``libxxhash``."""
    spec = importlib.util.find_spec("xxhash._xxhash")  # no public name for its file
    own = [spec.origin] if spec is not None and spec.origin else []
    return [*own, "libxxhash.so.0"]


def _agrees(module: Any) -> str | None:
    """Why the built module does not speak this envelope format, or None if it does."""
    layout = disagreement(module)  # every offset and size of kvtier.core.envelope_layout
    if layout is not None:
        return layout
    if {int(a) for a in ChecksumAlgorithm} != {module.CHECKSUM_XXH3_128}:
        return "built for another set of payload checksums"
    codes = [getattr(module, r.name, None) for r in Rejection]
    if module.VALID != 0 or sorted(c for c in codes if c is not None) != list(
        range(1, len(Rejection) + 1)
    ):
        return "its verdict codes do not cover kvtier.core.envelope.Rejection"
    return None


try:
    _module = importlib.import_module("kvtier.core._envelope")
except ImportError as exc:  # built without a C compiler: the Python path
    MISSING = str(exc)
else:
    MISSING = _agrees(_module)
    if MISSING is None and not any(_module.bind(lib) for lib in _xxhash_libraries()):
        MISSING = "no loaded xxHash library exports the XXH3 functions"
    if MISSING is None:
        _envelope = _module
        verdicts: list[Rejection | None] = [None] * (len(Rejection) + 1)
        for reason in Rejection:
            verdicts[getattr(_module, reason.name)] = reason
        _VERDICTS = tuple(verdicts)


def available() -> bool:
    """Whether the compiled envelope code was built, loads and binds xxHash."""
    return _envelope is not None


def write_envelopes(static: bytes, keys: Sequence[str], pages: Sequence[Regions]) -> None:
    """Write page ``i``'s envelope for its payload under ``keys[i]`` into its header slot.

    ``static``: the 56 bytes every page of the store shares
    (:attr:`~kvtier.core.envelope.BatchEnvelope.static`). Byte for byte what
    :func:`~kvtier.core.envelope.write_envelope` writes (the rest of each slot zeroed).
    One call, the GIL released; only where :func:`available`.
    """
    assert _envelope is not None, MISSING
    _envelope.write_envelopes(static, keys, pages)


def verify_envelopes(
    static: bytes, keys: Sequence[str], pages: Sequence[Regions], *, full: bool = True
) -> list[Rejection | None]:
    """The verdict on each page asked for under ``keys[i]``: None (valid) or the
    :class:`~kvtier.core.envelope.Rejection` :func:`~kvtier.core.envelope.verify_envelope`
    gives it (``full=False``: header only, no payload checksum). One call, the GIL
    released; only where :func:`available`."""
    assert _envelope is not None, MISSING
    table = _VERDICTS
    return [table[code] for code in _envelope.verify_envelopes(static, keys, pages, full)]


def key_digest(key: str) -> bytes:
    """The key's 16-byte BLAKE2b as the compiled code computes it for the envelopes
    (the same as :func:`kvtier.core.envelope.key_digest`); only where :func:`available`."""
    assert _envelope is not None, MISSING
    digest: bytes = _envelope.key_digest(key)
    return digest
