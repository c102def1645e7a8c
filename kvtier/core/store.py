"""What a store of pages is: the page API that a single tier's
:class:`~kvtier.core.pagestore.PageStore` and a chain of tiers
(:class:`~kvtier.storage.StorageChain`) both offer, so callers take either without a cast.

Pages are named by index in the store's page memory; every batch call answers one
:class:`~kvtier.core.pagestore.BatchResult` (a list of bools with the call's outcome).
A scheduler that only asks which pages are stored takes an :class:`ExistsLookup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvtier.core.pagestore import BatchResult, PageMemory
    from kvtier.core.saveguard import SaveGuard
    from kvtier.core.storage import StorageBackend

__all__ = ["ExistsLookup", "Store"]


class ExistsLookup(Protocol):
    """What may be asked of storage that holds no page memory: which keys are stored."""

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Whether each key is stored (one batched call per tier)."""
        ...

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored."""
        ...

    def close(self, timeout: float | None = None) -> bool:
        """Close the backends; False if one did not close within ``timeout``."""
        ...


class Store(ExistsLookup, Protocol):
    """The page API of a page store and of a chain of them (see the module docstring)."""

    @property
    def backend(self) -> StorageBackend:
        """The (first tier's) backend."""
        ...

    @property
    def closed(self) -> bool: ...

    @property
    def pool(self) -> PageMemory:
        """The page memory ``pages`` index into."""
        ...

    def get(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        verdicts: dict[int, str] | None = None,
    ) -> BatchResult:
        """Fill ``pages`` with the keys' verified bytes; True where it did."""
        ...

    def put(
        self,
        keys: Sequence[str],
        pages: Sequence[int],
        *,
        on_late: Callable[[Any], None] | None = None,
        guards: Sequence[SaveGuard | None] | None = None,
        parents: Sequence[str | None] | None = None,
    ) -> BatchResult:
        """Store ``pages`` under ``keys`` (enveloped); True where stored.

        ``parents`` (one per key, or None) is each page's real parent: the key of the page
        before it in its own sequence (None: a sequence's first page, or not known). A
        chain describes the pages to its tiers' policies with them (the ``prefix`` policy
        links a page to its parent); without them each page's parent is the key before it
        in ``keys``, right only for one sequence's consecutive pages, so a caller that
        merges several sequences' pages into one put passes them.
        """
        ...

    def delete(self, keys: Sequence[str]) -> BatchResult:
        """Remove each key; True where removed."""
        ...

    def clear(self) -> bool:
        """Remove every page; False if the backend failed."""
        ...

    def stats(self) -> dict[str, int | float]:
        """The page store counters (summed over tiers for a chain)."""
        ...

    def backend_stats(self, timeout: float = ...) -> dict[str, Any]:
        """The backends' own figures, within ``timeout``."""
        ...

    def call_counts(self) -> dict[str, Any]:
        """The bounded calls: made, timed out, stuck, abandoned."""
        ...

    def abandon_in_flight(self) -> int:
        """Stop waiting for calls still running (at shutdown); how many were."""
        ...
