"""The envelope checks of one get batch, wherever they run.

A page is verified once, by the first of: the backend's own loop (a backend with
``EnvelopeHooks`` checks the whole batch itself: :meth:`BatchChecks.passed`), the backend's
I/O thread right after the page's bytes landed (``PerPageHooks``: :meth:`BatchChecks.check`,
fed the payload as it arrives, :meth:`BatchChecks.feed`), or the page store once the batch
is in (:meth:`BatchChecks.finish`). Each check is compiled where the extension is built,
and covers the payload (``full``) or the header only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvtier.core import compiled_envelope
from kvtier.core.envelope import EnvelopeFormat, Rejection
from kvtier.core.extents import Extent

__all__ = ["BatchChecks"]

#: Runs a function over slices of page indices (on the checksum threads, if any).
RunSlices = Callable[[Callable[[Sequence[int]], object], Sequence[int]], None]
#: Runs a function over each page index (on the checksum threads, if any).
RunEach = Callable[[Callable[[int], Any], Sequence[int]], object]


class BatchChecks:
    """The verdicts of one get batch's pages (``reasons``: index -> None when valid)."""

    def __init__(
        self,
        fmt: EnvelopeFormat,
        keys: Sequence[str],
        buffers: Sequence[Sequence[Extent]],
        *,
        full: bool,
        compiled: bool,
    ) -> None:
        self._fmt = fmt
        self._keys = keys
        self._buffers = buffers
        self._full = full
        self._compiled = compiled
        self._static = fmt.batch(()).static
        #: index -> the page's verdict (None: valid), for every page checked so far.
        self.reasons: dict[int, Rejection | None] = {}
        self._streams: dict[int, tuple[Any, list[int]]] = {}

    def feed(self, i: int, piece: memoryview) -> None:
        """Hash a piece of page ``i``'s payload as it lands (every byte once)."""
        stream = self._streams.get(i)
        if stream is None:
            stream = self._streams[i] = (xxhash.xxh3_128(), [0])
        stream[0].update(piece)
        stream[1][0] += piece.nbytes

    def check(self, i: int) -> Rejection | None:
        """Verify page ``i`` now (with the digest fed, if all of its payload was)."""
        stream = self._streams.pop(i, None)
        keys, buffers = self._keys, self._buffers
        if self._compiled and stream is None:
            (reason,) = compiled_envelope.verify_envelopes(
                self._static, (keys[i],), (buffers[i],), full=self._full
            )
            self.reasons[i] = reason
            return reason
        page = [e.view for e in buffers[i]]
        payload = page[1:]
        digest = None
        if stream is not None and stream[1][0] == sum(view.nbytes for view in payload):
            digest = stream[0].digest()  # hashed as it landed, every byte once
        reason = self._fmt.verify(page[0], keys[i], payload, full=self._full, digest=digest)
        self.reasons[i] = reason
        return reason

    def passed(self, indices: Sequence[int]) -> None:
        """Pages the backend's own loop verified."""
        for i in indices:
            self.reasons[i] = None

    def finish(self, filled: Sequence[int], slices: RunSlices, each: RunEach) -> None:
        """Verify the filled pages nobody checked yet: compiled in slices (full) or in one
        call (header only), else one page at a time (on the checksum threads when full)."""
        todo = [i for i in filled if i not in self.reasons]
        if not todo:
            return
        if self._compiled:
            if self._full:
                slices(self._check_slice, todo)
            else:
                self._check_slice(todo)
        elif self._full:
            each(self.check, todo)
        else:
            for i in todo:
                self.check(i)

    def _check_slice(self, chunk: Sequence[int]) -> None:
        """Verify a slice of pages in one compiled call (it releases the GIL)."""
        found = compiled_envelope.verify_envelopes(
            self._static,
            [self._keys[i] for i in chunk],
            [self._buffers[i] for i in chunk],
            full=self._full,
        )
        for i, reason in zip(chunk, found, strict=True):
            self.reasons[i] = reason
