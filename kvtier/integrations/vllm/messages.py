"""What the scheduler-side and worker-side connectors tell each other, as plain data.

vLLM carries a :class:`StepWork` from the scheduler to every worker each step (inside the
connector's metadata object) and a :class:`Report` back from each worker (summed over the
workers with :meth:`Report.merged`). Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PageOp", "RankEvent", "Report", "StepWork"]


@dataclass
class PageOp:
    """Pages of one request to load or store: base keys and vLLM block ids, in order.

    Under vLLM's hybrid allocator a request has one op per KV cache group (``group``),
    each with that group's keys and block ids; ``stage`` marks a store whose blocks vLLM
    may free while the request runs (a sliding-window group's), copied aside at once.
    ``parent`` is the base key of the page before the first one in the same request and
    group (None: the op starts at the request's first page): a worker that merges several
    requests' stores into one put tells the storage chain each page's real parent.
    """

    req_id: str
    keys: list[str]
    blocks: list[int]
    #: The index in the request of the first page (saves restart there after a bad load).
    first: int
    group: int = 0
    stage: bool = False
    parent: str | None = None


@dataclass
class StepWork:
    """One step's work for the workers: loads, stores, and the requests just preempted."""

    loads: list[PageOp] = field(default_factory=list)
    saves: list[PageOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


#: One page event of a rank's storage chain: (rank, the tier holds the page now, tier
#: index, base key). "Holds" is a store or a promotion into the tier, else an eviction
#: or a removal from it.
RankEvent = tuple[int, bool, int, str]


@dataclass
class Report:
    """What workers stored and failed to load since their last report.

    ``stored`` and ``failed`` map a base key to the number of ranks reporting it (a page
    is stored once every rank stored its share); ``failed_from`` maps a request to the
    index of its first page that failed to load. ``events`` are the ranks' storage-chain
    events in the order each rank saw them (stores, promotions, evictions and removals,
    per tier), from which the scheduler learns what the tiers hold and forget;
    ``promoting`` the base keys whose promotion into a faster tier a rank's load queued
    (a lookup of them answers "ask again" until they are there).
    """

    stored: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    failed_from: dict[str, int] = field(default_factory=dict)
    events: list[RankEvent] = field(default_factory=list)
    promoting: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.failed or self.events or self.promoting)

    def merged(self, other: Report) -> Report:
        """The sum of two ranks' reports (events: each rank's, in its order)."""
        merged = Report(
            dict(self.stored),
            dict(self.failed),
            dict(self.failed_from),
            list(self.events),
            list(self.promoting),
        )
        for source, target in ((other.stored, merged.stored), (other.failed, merged.failed)):
            for key, count in source.items():
                target[key] = target.get(key, 0) + count
        for req_id, first in other.failed_from.items():
            merged.failed_from[req_id] = min(first, merged.failed_from.get(req_id, first))
        merged.events.extend(other.events)
        merged.promoting.extend(other.promoting)
        return merged
