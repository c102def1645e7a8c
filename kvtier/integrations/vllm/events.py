"""What the storage tiers hold, as the scheduler learns it, and as vLLM's KV events say it.

Each worker reports its storage chain's page events (stored, promoted, evicted, removed,
per tier; :class:`~.messages.Report`). The scheduler keeps them in a :class:`TierLedger`:
a page is *held* by a tier once every rank that stores a share of it reported it there
(one rank for MLA), and no longer once any rank's share left. From the ledger it:

- forgets a page it remembered stored once no tier holds it, so an evicted page is never
  promised to vLLM from memory (the backend's ``exists`` is asked instead);
- answers which tier a hit will be read from (vLLM's ``get_external_cache_hit_sources``);
- hands vLLM KV events (:class:`KVEventLog`): a page becoming held by tier *t* is a
  ``BlockStored``, a page leaving it a ``BlockRemoved``, each with ``medium`` naming the
  tier (:func:`tier_medium`: ``KVTIER:<index>:<backend>``), under the block hash vLLM
  itself publishes for that block (vLLM's router knows the block by it), with the parent
  hash, token ids, LoRA and extra keys vLLM's own ``BlockStored`` carries where the
  scheduler saw the request.

Nothing here imports vLLM: events are handed out as the keyword arguments of vLLM's
``BlockStored`` / ``BlockRemoved``, which the connector builds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.capabilities import TierPlan
from kvtier.core.storage import Counters
from kvtier.integrations.kv_events import BoundedLog, tier_locality

__all__ = [
    "UNSPECIFIED",
    "BlockInfo",
    "Describer",
    "KVEventLog",
    "TierLedger",
    "event_locality",
    "hit_source",
    "tier_medium",
]

#: vLLM's ``CacheHitSource`` value for a hit whose tier is not known.
UNSPECIFIED = "external_unspecified"
#: vLLM's ``CacheHitSource`` value of a tier, by where it keeps its pages.
_SOURCES = {"host": "host", "disk": "disk", "remote": UNSPECIFIED}


def tier_medium(tier: TierPlan) -> str:
    """The ``medium`` of a tier's KV events: ``KVTIER:<index>:<backend>`` (``KVTIER:0:file``),
    the tier's name as kvtier's stats and metrics give it, apart from vLLM's own ``GPU`` /
    ``CPU`` / ``STORAGE``, so a router weights each of kvtier's tiers on its own."""
    return f"KVTIER:{tier.name}"


def event_locality(tier: TierPlan) -> str:
    """vLLM's ``locality`` of a tier's KV events: ``REMOTE`` for a store other hosts share
    (Mooncake: a router counts its pages for every engine), else ``LOCAL`` (this engine's
    alone)."""
    return "REMOTE" if tier_locality(tier.backend.features) == "remote" else "LOCAL"


def hit_source(tier: TierPlan) -> str:
    """vLLM's ``CacheHitSource`` value for a hit a tier serves: ``disk`` (a persistent local
    store: file, uring, segment), ``host`` (memory in this process) or
    ``external_unspecified`` (a store other hosts share, Mooncake: vLLM names no source for
    a remote store)."""
    return _SOURCES[tier_locality(tier.backend.features)]


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What vLLM's own ``BlockStored`` says of one block: its hash and its parent's (as vLLM
    publishes them), its token ids, LoRA adapter and untagged extra keys."""

    block_hash: Any
    parent_hash: Any | None
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


#: (request, first page, end page) -> the blocks' infos, one per page from the first (fewer
#: where vLLM has not hashed a block yet). The connector builds it from vLLM's ``Request``.
Describer = Callable[[Any, int, int], Sequence[BlockInfo]]


class TierLedger:
    """Which tiers hold which pages, from the ranks' events (bounded: oldest forgotten)."""

    def __init__(self, tiers: int, ranks: int, limit: int) -> None:
        self.tiers = tiers
        self.ranks = max(1, ranks)
        self.limit = max(1, limit)
        #: key -> tier -> bit mask of the ranks whose share the tier holds
        self._masks: OrderedDict[str, dict[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def apply(self, rank: int, held: bool, tier: int, key: str) -> bool | None:
        """Record one rank's event; the tier's new state of the page when it changed
        (True: now held whole, False: no longer), else None."""
        masks = self._masks.get(key)
        if masks is None:
            if not held:
                return None  # a page this ledger never saw held: nothing changes
            masks = self._masks[key] = {}
            while len(self._masks) > self.limit:
                self._masks.popitem(last=False)
        self._masks.move_to_end(key)
        before = masks.get(tier, 0)
        after = before | (1 << rank) if held else before & ~(1 << rank)
        if after:
            masks[tier] = after
        else:
            masks.pop(tier, None)
        was, now = self._whole(before), self._whole(after)
        return now if was != now else None

    def _whole(self, mask: int) -> bool:
        return mask.bit_count() >= self.ranks

    def held(self, key: str) -> bool | None:
        """Whether some tier holds the page whole; None where no event told of it."""
        masks = self._masks.get(key)
        if masks is None:
            return None
        return any(self._whole(mask) for mask in masks.values())

    def tier_of(self, key: str) -> int | None:
        """The fastest tier holding the page whole (a load reads it from there), or None."""
        masks = self._masks.get(key)
        if not masks:
            return None
        whole = [tier for tier, mask in masks.items() if self._whole(mask)]
        return min(whole) if whole else None

    def whole(self) -> Iterable[tuple[str, int]]:
        """Every (key, tier) held whole."""
        for key, masks in self._masks.items():
            for tier, mask in masks.items():
                if self._whole(mask):
                    yield key, tier

    def clear(self) -> None:
        self._masks.clear()


class KVEventLog:
    """vLLM KV events of the tiers' pages, kept until taken (see the module docstring).

    The scheduler tells it what it knows of a page's block (:meth:`describe`, while it
    has the request) and each change the :class:`TierLedger` found (:meth:`changed`);
    :meth:`take` hands out the events since the last call, consecutive stores of one
    chain and medium as one ``BlockStored`` (as vLLM's own block pool publishes them) and
    consecutive removals of one medium as one ``BlockRemoved``. At most ``capacity``
    events wait (beyond it the oldest are dropped, counted as ``vllm_events_dropped``); a
    change of a page whose block hash the scheduler never saw is left out (counted as
    ``vllm_events_unmapped``). Block details (tokens, extra keys) are kept for the last
    ``capacity`` pages described, block hashes for the last ``hashes`` (what a removal
    needs); a store of a page whose details were forgotten carries its hash alone.
    """

    def __init__(
        self,
        media: Sequence[str],
        page_size: int,
        *,
        capacity: int,
        hashes: int,
        counters: Counters,
    ) -> None:
        self.media = list(media)
        self.page_size = page_size
        self.capacity = max(1, capacity)
        self.counters = counters
        self._hash_limit = max(1, hashes)
        self._details: OrderedDict[str, BlockInfo] = OrderedDict()
        self._hashes: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        #: (held, tier, group, info) of each change, oldest first
        self._pending: BoundedLog[tuple[bool, int, int, BlockInfo]] = BoundedLog(
            self.capacity, counters, "vllm_events_dropped"
        )

    def describe(self, key: str, group: int, info: BlockInfo) -> None:
        """Remember what vLLM's ``BlockStored`` says of the page ``key`` (group ``group``)."""
        self._details[key] = info
        self._details.move_to_end(key)
        while len(self._details) > self.capacity:
            self._details.popitem(last=False)
        self._hashes[key] = (info.block_hash, group)
        self._hashes.move_to_end(key)
        while len(self._hashes) > self._hash_limit:
            self._hashes.popitem(last=False)

    def known(self, key: str) -> bool:
        """Whether the page's block hash is known."""
        return key in self._hashes

    def changed(self, key: str, tier: int, held: bool) -> None:
        """Tier ``tier`` now holds the page whole (``held``), or no longer does."""
        hashed = self._hashes.get(key)
        if hashed is None or not 0 <= tier < len(self.media):
            self.counters.add("vllm_events_unmapped")
            return
        block_hash, group = hashed
        info = self._details.get(key) if held else None
        if info is None or info.block_hash != block_hash:
            info = BlockInfo(block_hash, None)
        self._pending.extend([(held, tier, group, info)])

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        """The events since the last call, oldest first: ``("BlockStored", fields)`` or
        ``("BlockRemoved", fields)``, ``fields`` the keyword arguments of vLLM's class."""
        rows = self._pending.take()
        out: list[tuple[str, dict[str, Any]]] = []
        for held, tier, group, info in rows:
            medium = self.media[tier]
            kind, fields = out[-1] if out else ("", {})
            same = bool(out) and fields["medium"] == medium and fields["group_idx"] == group
            if not held:
                if same and kind == "BlockRemoved":
                    fields["block_hashes"].append(info.block_hash)
                else:
                    removed = {"block_hashes": [info.block_hash], "medium": medium}
                    out.append(("BlockRemoved", {**removed, "group_idx": group}))
                continue
            if (
                same
                and kind == "BlockStored"
                and info.parent_hash is not None
                and fields["block_hashes"][-1] == info.parent_hash
                and (fields["lora_id"], fields["lora_name"]) == (info.lora_id, info.lora_name)
                and bool(fields["token_ids"]) == bool(info.token_ids)
            ):
                fields["block_hashes"].append(info.block_hash)
                fields["token_ids"].extend(info.token_ids)
                fields["extra_keys"].append(info.extra_keys)
                continue
            out.append(
                (
                    "BlockStored",
                    {
                        "block_hashes": [info.block_hash],
                        "parent_block_hash": info.parent_hash,
                        "token_ids": list(info.token_ids),
                        "block_size": self.page_size,
                        "lora_id": info.lora_id,
                        "medium": medium,
                        "lora_name": info.lora_name,
                        "extra_keys": [info.extra_keys],
                        "group_idx": group,
                    },
                )
            )
        for kind, fields in out:
            if kind == "BlockStored" and not any(fields["extra_keys"]):
                fields["extra_keys"] = None
        self.counters.add("vllm_events_emitted", len(rows))
        return out

    def forget(self) -> None:
        """Drop what is known of blocks (their pages are no longer served: a reset)."""
        self._details.clear()
        self._hashes.clear()
