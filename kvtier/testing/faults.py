"""A fault-injecting wrapper around any storage backend, for conformance and chaos tests.

:class:`FaultyBackend` forwards every call to an inner backend and, with seeded
probabilities, makes a key's operation fail, raises from a whole call, delays calls,
flips a bit in a page that was read, or stores a truncated page. Everything it breaks is
something a real disk, network or buggy backend does; the core's envelope and error
boundary must turn each into a counted miss, never into bad data.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from kvtier.core.envelope import HEADER
from kvtier.core.errors import InjectedFault, InvalidFieldError
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.storage import PageBuffers, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.host_pool import HostPool

__all__ = ["FaultyBackend", "InjectedFault"]

FlipWhere = Literal["any", "header", "payload"]


def _rate(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise InvalidFieldError(
            name, f"must be a probability in [0, 1], got {value!r}", value=value
        )
    return value


class FaultyBackend(StorageBackend):
    """Wraps ``inner`` and injects faults with the given per-key (or per-call) probabilities.

    - ``fail_rate``: a key's get / put reports False (a put then stores nothing);
    - ``error_rate``: a whole call raises :class:`InjectedFault` (a backend bug);
    - ``delay``: seconds slept before every call (a slow disk or network);
    - ``bit_flip_rate``: a page read successfully gets one bit flipped, in the envelope
      header (the first region's header bytes), the payload, or either (``flip_in``);
    - ``truncate_rate``: a put stores only a prefix of the page (a short object), which a
      later get must report as a miss or the envelope must reject.

    Faults are drawn from ``random.Random(seed)``, so a failing run can be replayed.
    ``injected`` counts what fired, by kind.
    """

    def __init__(
        self,
        inner: StorageBackend,
        *,
        seed: int = 0,
        fail_rate: float = 0.0,
        error_rate: float = 0.0,
        delay: float = 0.0,
        bit_flip_rate: float = 0.0,
        truncate_rate: float = 0.0,
        flip_in: FlipWhere = "any",
    ) -> None:
        self.inner = inner
        self.fail_rate = _rate("fail_rate", fail_rate)
        self.error_rate = _rate("error_rate", error_rate)
        self.bit_flip_rate = _rate("bit_flip_rate", bit_flip_rate)
        self.truncate_rate = _rate("truncate_rate", truncate_rate)
        if delay < 0:
            raise InvalidFieldError("delay", f"must be >= 0 seconds, got {delay!r}", value=delay)
        if flip_in not in ("any", "header", "payload"):
            raise InvalidFieldError(
                "flip_in", f"must be 'any', 'header' or 'payload', got {flip_in!r}", value=flip_in
            )
        self.delay = delay
        self.flip_in: FlipWhere = flip_in
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}

    # --- drawing faults ----------------------------------------------------------------

    def _hit(self, rate: float, kind: str) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            fired = self._random.random() < rate
            if fired:
                self.injected[kind] = self.injected.get(kind, 0) + 1
        return fired

    def _randrange(self, n: int) -> int:
        with self._lock:
            return self._random.randrange(n)

    def _before_call(self, op: str) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self._hit(self.error_rate, "errors"):
            raise InjectedFault(f"injected failure of {op}()", value=op)

    def _flip(self, page: PageBuffers) -> None:
        # the envelope header proper (not the slot's zero padding, where a flip is harmless)
        header = [page[0].view[: min(HEADER.size, page[0].length)]] if page else []
        payload = [e.view for e in page[1:]]
        if self.flip_in == "header":
            regions = header
        elif self.flip_in == "payload":
            regions = payload
        else:
            regions = header + payload
        regions = [r for r in regions if r.nbytes]
        if not regions:
            return
        total = sum(r.nbytes for r in regions)
        bit = self._randrange(total * 8)
        byte, shift = divmod(bit, 8)
        for region in regions:
            if byte < region.nbytes:
                region[byte] ^= 1 << shift
                return
            byte -= region.nbytes

    def _truncated(self, page: PageBuffers) -> list[Extent]:
        total = sum(e.length for e in page)
        keep = self._randrange(total) if total else 0
        out: list[Extent] = []
        for extent in page:
            if keep <= 0:
                break
            if extent.length <= keep:
                out.append(extent)
                keep -= extent.length
            else:
                out.append(extent_of_view(extent.view[:keep]))
                keep = 0
        return out

    # --- the contract ------------------------------------------------------------------

    def attach(self, pool: HostPool) -> None:
        self.inner.attach(pool)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._before_call("exists")
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._before_call("get")
        results = self.inner.get(keys, pages)
        for i, page in enumerate(pages):
            if not results[i]:
                continue
            if self._hit(self.fail_rate, "get_failures"):
                results[i] = False
            elif self._hit(self.bit_flip_rate, "bit_flips"):
                self._flip(page)
        return results

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._before_call("put")
        chosen: list[int] = []
        sent: list[PageBuffers] = []
        for i, page in enumerate(pages):
            if self._hit(self.fail_rate, "put_failures"):
                continue
            chosen.append(i)
            sent.append(
                self._truncated(page) if self._hit(self.truncate_rate, "truncations") else page
            )
        results = [False] * len(keys)
        if chosen:
            stored = self.inner.put([keys[i] for i in chosen], sent)
            for i, ok in zip(chosen, stored, strict=True):
                results[i] = ok
        return results

    def delete(self, keys: Sequence[str]) -> list[bool]:
        self._before_call("delete")
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            injected = {f"injected_{kind}": n for kind, n in self.injected.items()}
        return {**self.inner.stats(), **injected}

    def close(self) -> None:
        self.inner.close()
