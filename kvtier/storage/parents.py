"""Each page's parent, as the chain tells its tiers' policies: the page before it in its
own sequence (the ``prefix`` policy links a page to it).

A put's caller gives them (``parents``) when its batch may hold several sequences' pages
(the vLLM writer merges requests' saves; SGLang's chain of page hashes); without them a
page's parent is the key before it in the put (:func:`batch_parents`), right only for
one sequence's consecutive pages. The chain remembers the parents it was told
(:class:`ParentMemo`), so a page written back or promoted into another tier later is
described there with its real parent too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.errors import PageError

__all__ = ["PARENTS_KEPT", "ParentMemo", "batch_parents", "checked_parents"]

#: Pages whose parent the chain remembers for their later write-backs and promotions.
PARENTS_KEPT = 1 << 16


def batch_parents(keys: Sequence[str]) -> list[str | None]:
    """Each key's parent when ``keys`` are one sequence's consecutive pages: the key
    before it (None for the first). The fallback of a put given no ``parents``."""
    return [None, *keys[:-1]] if keys else []


def checked_parents(keys: Sequence[str], parents: Sequence[str | None] | None) -> list[str | None]:
    """``parents`` as a list, one per key (:func:`batch_parents` when None); a
    :class:`~kvtier.core.errors.PageError` when the counts differ."""
    if parents is None:
        return batch_parents(keys)
    out = list(parents)
    if len(out) != len(keys):
        raise PageError(
            f"got {len(keys)} keys and {len(out)} parents; pass one parent (or None) per "
            "key, or no parents for one sequence's consecutive pages",
            value=len(out),
        )
    return out


class ParentMemo:
    """The parent each recently described page was described with (the most recent
    ``keep``), for its later moves between tiers."""

    def __init__(self, keep: int = PARENTS_KEPT) -> None:
        self._keep = keep
        self._parents: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, keys: Sequence[str], parents: Sequence[str | None]) -> None:
        """``keys`` were described with ``parents`` (aligned)."""
        known = self._parents
        with self._lock:
            for key, parent in zip(keys, parents, strict=True):
                known[key] = parent
                known.move_to_end(key)
            while len(known) > self._keep:
                known.popitem(last=False)

    def parents_of(self, keys: Sequence[str]) -> list[str | None]:
        """The parent each key was last described with (None: not remembered)."""
        known = self._parents
        with self._lock:
            return [known.get(key) for key in keys]
