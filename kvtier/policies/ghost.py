"""The ghost of the scan-resistant built-ins: keys of recently evicted pages.

``slru`` and ``prefix`` treat a page that comes back soon after its eviction as one used
twice (it was evicted too early). Remembering those keys must cost no work per key, so
the ghost keeps them in two generations of dicts: keys go into the newer; when it is full
it becomes the older and the older is forgotten whole.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Ghost", "GhostOptions"]


class GhostOptions(Protocol):
    """What a ghost reads of its policy's options."""

    @property
    def ghost_factor(self) -> float:
        """Evicted keys remembered, about this multiple of the resident page count."""
        ...


class Ghost:
    """Keys of evicted pages, each with a small int its policy chooses, in two generations.

    Each generation holds 2/3 of ``ghost_factor`` x the resident pages (counted when the
    previous one closed), plus 8, so the ghost remembers between 2/3 and 4/3 of
    ``ghost_factor`` x the resident page count of the most recently evicted keys (plus up
    to 16), about that many on average, at no cost per key. ``options`` (the policy's)
    are read only when a generation closes. Not locked: its policy calls it under its own
    lock.

    The two steps every insert or eviction takes stay in the policy, on its hot path, as
    plain dict operations on :attr:`newer` and :attr:`older` (a method call would cost
    more than they do): remembering is ``ghost.newer[key] = value`` followed, once
    ``len(ghost.newer) >= ghost.half``, by :meth:`close`; asking is ``key in ghost.newer or
    key in ghost.older``, followed, for a remembered key, by :meth:`pop`.
    """

    __slots__ = ("_options", "half", "newer", "older")

    def __init__(self, options: GhostOptions) -> None:
        self._options = options
        #: The newer generation: where evicted keys go.
        self.newer: dict[str, int] = {}
        #: The older generation, forgotten whole when the newer one closes.
        self.older: dict[str, int] = {}
        #: Keys the newer generation holds before it closes (recomputed as each one closes).
        self.half = 8

    def close(self, resident: int) -> None:
        """Close the full newer generation: it becomes the older one, the older one is
        forgotten whole, and the next holds 2/3 of ``ghost_factor`` x ``resident`` (the
        policy's resident page count now), plus 8."""
        self.older = self.newer
        self.newer = {}
        self.half = int(self._options.ghost_factor * resident * 2 / 3) + 8

    def pop(self, key: str) -> int | None:
        """Forget ``key``: its value (the newer generation's where both hold it), or None
        when the ghost does not remember it."""
        value = self.newer.pop(key, None)
        if self.older:
            older = self.older.pop(key, None)
            if value is None:
                value = older
        return value

    def __len__(self) -> int:
        return len(self.newer) + len(self.older)
