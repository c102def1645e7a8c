"""``frequency``: admit a page once it has been seen ``min_hits`` times (a count-min sketch).

Every look-up or offer of a key at the boundary (``record_access``) adds one to its
counters; ``admit`` says yes once the key's estimate reaches ``min_hits``. The counts
live in a count-min sketch of ``depth`` rows of ``width`` one-byte counters (256 KiB by
default), so memory is fixed whatever the number of keys. Collisions only over-count, so
a page seen ``min_hits`` times since the last halving is never refused, and a rare page
is admitted early only when the sketch is too small for the keys it sees. Every
``halve_every`` accesses each counter is halved, so that old popularity fades (the
TinyLFU reset). The hashes are CRC-32 of the key's bytes from seeded start values, the
same in every process.
"""

from __future__ import annotations

import threading
import zlib

from kvtier.core.policy import AdmissionPolicy
from kvtier.policies.config import FrequencyConfig

__all__ = ["FrequencyAdmission"]

#: Counters saturate here (one byte each).
_CEILING = 255
#: Each counter value halved, as a bytes.translate table.
_HALVED = bytes(value >> 1 for value in range(256))


def _lowest(table: bytearray, slots: tuple[int, ...]) -> int:
    """The smallest of ``table``'s counters at ``slots``: a key's count as the sketch
    estimates it (collisions only add to a counter, so the smallest is the closest)."""
    low = _CEILING
    for slot in slots:
        if table[slot] < low:
            low = table[slot]
    return low


class FrequencyAdmission(AdmissionPolicy):
    """Admission by access count, counted in a bounded count-min sketch.

    One lock per call. Memory: ``depth`` x ``width`` bytes, whatever the number of keys.
    """

    def __init__(self, config: FrequencyConfig | None = None) -> None:
        self.config = config or FrequencyConfig()
        cfg = self.config
        self._width = cfg.width
        self._depth = cfg.depth
        self._table = bytearray(cfg.depth * cfg.width)  # row r's counter c at r*width + c
        self._offsets = range(0, cfg.depth * cfg.width, cfg.width)
        self._min_hits = cfg.min_hits
        self._halve_every = cfg.halve_every or 8 * cfg.width
        self._seed_a = zlib.crc32(f"kvtier-frequency-a-{cfg.seed}".encode())
        self._seed_b = zlib.crc32(f"kvtier-frequency-b-{cfg.seed}".encode())
        self._since_halving = 0
        self._last: tuple[str | None, tuple[int, ...]] = (None, ())
        self._lock = threading.Lock()
        # acquire()/release() in try/finally: half what a `with` costs on each call
        self._acquire, self._release = self._lock.acquire, self._lock.release

    @property
    def memory_bytes(self) -> int:
        """Bytes of the sketch's counters."""
        return len(self._table)

    def _slots(self, key: str) -> tuple[int, ...]:
        """The counters of ``key``, one per row (double hashing: first + row * step)."""
        last = self._last  # one tuple, read at once: safe without the lock
        if last[0] == key:  # admit() usually asks of the key record_access just counted
            return last[1]
        data = key.encode()
        where = zlib.crc32(data, self._seed_a)
        step = zlib.crc32(data, self._seed_b) | 1
        width = self._width
        out = []
        for offset in self._offsets:
            out.append(offset + where % width)
            where += step
        slots = tuple(out)
        self._last = (key, slots)
        return slots

    def record_access(self, key: str) -> None:
        slots = self._slots(key)
        self._acquire()
        try:
            table = self._table
            low = _lowest(table, slots)
            if low < _CEILING:
                for slot in slots:
                    if table[slot] == low:  # conservative update: only the smallest counters
                        table[slot] = low + 1
            self._since_halving += 1
            if self._since_halving >= self._halve_every:
                self._since_halving = 0
                self._table = table.translate(_HALVED)
        finally:
            self._release()

    def estimate(self, key: str) -> int:
        """How many times ``key`` was seen, as the sketch estimates it (never fewer since
        the last halving)."""
        slots = self._slots(key)
        self._acquire()
        try:
            return _lowest(self._table, slots)
        finally:
            self._release()

    def admit(self, key: str, nbytes: int) -> bool:
        return self.estimate(key) >= self._min_hits

    def __repr__(self) -> str:
        return f"FrequencyAdmission(min_hits={self._min_hits}, sketch={self._depth}x{self._width})"
