"""``prefix``: eviction that knows a KV cache's pages form prefix chains.

What a generic cache does not know and this policy uses (from :meth:`describe`):

- **A child page is useless without its parent.** A prefix look-up reaches a page only
  through every page before it, so within each level a page is queued just before its
  parent (when the parent sits in the same level): a chain leaves the tier from its leaf
  up, never from its root down, which would leave the rest of the chain resident but
  unreachable. And when a parent is removed anyway (deleted, found invalid, or evicted
  from a lower level while its children were protected), its resident descendants are
  *orphans*: the dead subtree is evicted before anything else. An orphan that is hit
  after all (its parent lives in another tier of the chain) goes back to its level, and
  so do the orphans below it; a parent that comes back takes its orphans back too.
- **Most pages are never used again; a page used before is likely to be used again.**
  A page enters level 0 (probation); each reuse lifts it one level, up to ``levels``
  (default 1: probation and protected, as in segmented LRU). Victims come from the
  lowest level first, oldest first; when victims are chosen, the protected levels share
  ``protected_fraction`` of the resident bytes evenly, an overfull level handing its
  oldest pages down one level. Keys of evicted pages are remembered with their level (a
  ghost of about ``ghost_factor`` x the resident page count, in two generations of dicts,
  the older forgotten whole when the newer fills, so that remembering costs no trim per
  key): a page evicted too soon comes back one level higher, so a conversation that
  returns after a long gap is protected at once instead of starting again from probation.
- **How much to protect depends on the workload, so it is measured, not assumed.** When
  pages come back soon after their first use (a conversation whose turns are a few
  minutes apart, in a tier big enough to hold them that long), plain recency keeps them
  and a small probation loses them; when most pages are used once and the reused ones
  come back late, protection wins. With ``adaptive`` (the default) the policy plays a
  duel with LRU on a sample of its pages (one new page in ``duel_sample``, the choice
  remembered in the page's node and in the ghost, so a key stays in the sample while
  either remembers it):
  the sampled keys also live in an LRU *shadow* holding the tier's bytes over
  ``duel_sample``, and each use of a sampled page counts a hit here when the page is
  resident and a hit for LRU when the shadow holds it. Each time the two counts add up
  to the resident page count over ``duel_sample`` (evidence in proportion to the tier,
  not to time), the protected share moves a tenth towards whichever hit more, between 0
  (probation only: recency, still leaf first and orphans first) and
  ``protected_fraction``. Nothing in it is fitted to a trace: the sample, the shadow and
  the decision interval are fractions of what the tier holds.
- **Tenants.** ``choose_victims(tenant=...)`` only ever names that tenant's pages, and
  ``tenant_bytes`` counts each tenant's resident bytes, for per-tenant quotas.

Every call is O(1) but ``choose_victims``, which walks the queues from the oldest page
past pinned pages and other tenants' pages, and the removal or return of a page with
resident descendants, which moves them (a sampled page's use also costs the shadow one
``OrderedDict`` step, and an eviction from it). One lock per call (a description of a
page not resident yet is stored without it, as
:meth:`kvtier.core.policy.PageBook.hold_unlocked` explains). The queues are linked
lists of small node lists (``collections.OrderedDict`` can move a key only to an end;
a child goes just before its parent); a page's node also holds its resident children,
so that finding a page's parent and its children costs no extra look-up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvtier.core.policy import LockedEviction, PageInfo, never_pinned
from kvtier.policies.config import PrefixConfig
from kvtier.policies.ghost import Ghost

__all__ = ["PrefixPolicy"]

#: A queue node: [older node, newer node, key, queue, the level it had (orphans only),
#: its parent's key, its resident children, its bytes, its tenant, 1 when the duel with
#: LRU samples its page (else 0)].
_OLDER, _NEWER, _KEY, _QUEUE, _WAS, _PARENT, _CHILDREN, _SIZE, _TENANT, _SAMPLED = range(10)
#: How far the protected share moves each time the duel with LRU is decided.
_DUEL_STEP = 0.1
#: Descriptions of pages not resident yet kept for their insert, the most recent only.
_PENDING = 4096

#: Resident children: None, one key (most pages have one child), or a set of keys.
Children = str | set[str] | None


def _with(children: Children, key: str) -> Children:
    """``children`` with ``key`` added."""
    if children is None:
        return key
    if isinstance(children, str):
        return children if children == key else {children, key}
    children.add(key)
    return children


def _without(children: Children, key: str) -> Children:
    """``children`` with ``key`` taken out."""
    if children is None or isinstance(children, str):
        return None if children == key else children
    children.discard(key)
    if len(children) > 1:
        return children
    return next(iter(children)) if children else None


def _each(children: Children) -> tuple[str, ...] | set[str]:
    if children is None:
        return ()
    return (children,) if isinstance(children, str) else set(children)


def _sentinel() -> list[Any]:
    node: list[Any] = [None, None, None, -1, -1, None, None, 0, None, 0]
    node[_OLDER] = node[_NEWER] = node
    return node


class PrefixPolicy(LockedEviction):
    """Prefix-chain-aware, reuse-levelled eviction (see the module docstring).

    Memory: per resident page one node of ten slots (its links, level, parent,
    children, size, tenant and whether the duel samples it); plus one entry per
    remembered evicted key (at most 4/3 of ``ghost_factor`` x the resident page count,
    plus 16), one per parent key that is not resident but has resident children, one per
    sampled key in the LRU shadow (about the resident pages over ``duel_sample``), and the
    descriptions of at most 4096 pages not inserted yet.
    """

    def __init__(self, config: PrefixConfig | None = None) -> None:
        super().__init__()
        self.config = config or PrefixConfig()
        self._top = self.config.levels
        #: The protected levels' share now: ``protected_fraction``, or where the duel with
        #: LRU moved it (between 0 and ``protected_fraction``), split evenly between them.
        self._fraction = self.config.protected_fraction
        self._share = self._fraction / self._top
        #: The duel with LRU: one new page in ``_sample`` (0: no duel) is sampled; the
        #: sampled pages' keys in LRU order with their bytes (the shadow, holding the
        #: tier's bytes over ``_sample``); the hits on sampled pages here and there.
        self._sample = self.config.duel_sample if self.config.adaptive else 0
        self._new_keys = 0
        self._shadow: OrderedDict[str, int] = OrderedDict()
        self._shadow_bytes = 0
        self._duel_ours = 0
        self._duel_lru = 0
        self._orphans_first = self.config.orphans_first
        #: Queue i < top + 1 holds level i; queue ``_orphans`` (the last) the orphans.
        self._orphans = self._top + 1
        #: The order victims are taken in: orphans, then level 0 up.
        self._order = (self._orphans, *range(self._top + 1))
        self._heads = [_sentinel() for _ in range(self._top + 2)]
        self._order_heads = [self._heads[q] for q in self._order]
        self._queue_bytes = [0] * (self._top + 2)
        self._nodes: dict[str, list[Any]] = {}  # resident key -> its node
        self._total = 0  # bytes of the resident pages
        self._by_tenant: dict[str, int] = {}  # tenant -> its resident bytes (None apart)
        self._pending: dict[str, PageInfo] = {}  # described, not resident yet; oldest first
        #: A parent that is not resident -> its resident children (for when it comes).
        self._waiting: dict[str, Children] = {}
        #: Evicted key -> its level << 1 | whether the duel samples it.
        self._ghost = Ghost(self.config)
        self._promoted = False  # a page went up a level since the last _balance

    # --- what the tier tells -------------------------------------------------------

    def describe(self, key: str, info: PageInfo) -> None:
        if key not in self._nodes:  # the usual case: described just before its insert
            # Kept for the insert without the lock (one dict store, atomic); an insert
            # makes the page resident before it takes the description, so either it finds
            # this one, or the check after storing it sees the page resident and it is
            # applied under the lock.
            pending = self._pending
            pending[key] = info
            if key not in self._nodes:
                if len(pending) > _PENDING:
                    self._trim_pending()
                return
        self._acquire()
        try:
            self._pending.pop(key, None)
            node = self._nodes.get(key)
            if node is None:  # removed meanwhile: it waits for its insert
                self._pending[key] = info
                return
            if node[_TENANT] != info.tenant:
                self._count(node, -1)
                node[_TENANT] = info.tenant
                self._count(node, 1)
            parent = info.parent if info.parent != key else None
            if node[_PARENT] != parent:
                self._detach(node)
                node[_PARENT] = parent
                self._attach(node)
        finally:
            self._release()

    def _trim_pending(self) -> None:
        """Forget the oldest descriptions beyond the most recent 4096."""
        self._acquire()
        try:
            pending = self._pending
            while len(pending) > _PENDING:
                pending.pop(next(iter(pending)), None)
        finally:
            self._release()

    def record_insert(self, key: str, nbytes: int) -> None:
        self._acquire()
        try:
            nodes = self._nodes
            node = nodes.get(key)
            if node is not None:  # re-written: a new size, and just used
                self._unlink(node)
                self._count(node, -1)
                node[_SIZE] = nbytes
                self._count(node, 1)
                self._link(node, node[_QUEUE])  # its level's share is a soft cap
                return
            # resident before its description is taken, for describe() without the lock
            node = [None, None, key, 0, -1, None, None, nbytes, None, 0]
            nodes[key] = node
            info = self._pending.pop(key, None)
            parent = tenant = None
            if info is not None:
                tenant = info.tenant
                if info.parent != key:
                    parent = info.parent
            ghost = self._ghost
            remembered = ghost.pop(key) if key in ghost.newer or key in ghost.older else None
            level = 0
            if remembered is not None:  # its level, and whether the duel samples it
                level = min(self._top, (remembered >> 1) + 1)
                self._promoted = True
                if remembered & 1:
                    node[_SAMPLED] = 1
                    self._duel(key, nbytes, False)
            elif self._sample:  # a new page: one in every duel_sample is sampled
                self._new_keys += 1
                if self._new_keys >= self._sample:
                    self._new_keys = 0
                    node[_SAMPLED] = 1
                    self._duel(key, nbytes, False)
            waiting = self._waiting.pop(key, None) if self._waiting else None
            node[_QUEUE], node[_PARENT], node[_CHILDREN], node[_TENANT] = (
                level,
                parent,
                waiting,
                tenant,
            )
            if tenant is None:
                self._total += nbytes
            else:
                self._count(node, 1)
            newer = self._heads[level]
            if parent is not None:
                found = nodes.get(parent)
                if found is None:
                    self._waiting[parent] = _with(self._waiting.get(parent), key)
                else:
                    siblings = found[_CHILDREN]
                    found[_CHILDREN] = key if siblings is None else _with(siblings, key)
                    if found[_QUEUE] == level:
                        newer = found  # just before its parent: the chain leaves leaf first
            older = newer[_OLDER]  # linked here, as in _link: the hot path
            older[_NEWER] = node
            node[_OLDER] = older
            node[_NEWER] = newer
            newer[_OLDER] = node
            self._queue_bytes[level] += nbytes
            if waiting is not None:  # its orphans are reachable again
                self._adopt(waiting)
        finally:
            self._release()

    def record_access(self, key: str) -> None:
        self._acquire()
        try:
            nodes = self._nodes
            node = nodes.get(key)
            if node is None:
                return
            size = node[_SIZE]
            if node[_SAMPLED]:
                self._duel(key, size, True)
            older, newer = node[_OLDER], node[_NEWER]  # unlinked here: the hot path
            older[_NEWER] = newer
            newer[_OLDER] = older
            level = node[_QUEUE]
            queue_bytes = self._queue_bytes
            queue_bytes[level] -= size
            orphan = level == self._orphans
            if orphan:  # hit after all: its parent lives in another tier
                level = node[_WAS]
            if level < self._top:
                level += 1
                self._promoted = True
            newer = self._heads[level]  # linked here, as in _link
            parent = node[_PARENT]
            if parent is not None:
                found = nodes.get(parent)
                if found is not None and found[_QUEUE] == level:
                    newer = found  # just before its parent: the chain leaves leaf first
            older = newer[_OLDER]
            older[_NEWER] = node
            node[_OLDER] = older
            node[_NEWER] = newer
            newer[_OLDER] = node
            node[_QUEUE] = level
            queue_bytes[level] += size
            if orphan and node[_CHILDREN] is not None:
                self._adopt(node[_CHILDREN])  # reachable through it, then
        finally:
            self._release()

    def record_remove(self, key: str) -> None:
        self._acquire()
        try:
            node = self._nodes.pop(key, None)
            if node is None:
                return
            older, newer = node[_OLDER], node[_NEWER]  # unlinked here: the hot path
            older[_NEWER] = newer
            newer[_OLDER] = older
            level = node[_QUEUE]
            size = node[_SIZE]
            self._queue_bytes[level] -= size
            if node[_TENANT] is None:
                self._total -= size
            else:
                self._count(node, -1)
            if level == self._orphans:
                level = node[_WAS]
            parent = node[_PARENT]
            if parent is not None:
                found = self._nodes.get(parent)
                if found is not None and found[_CHILDREN] == key:  # its only child
                    found[_CHILDREN] = None
                else:
                    self._detach(node)
            children = node[_CHILDREN]
            if children is not None:  # they wait for it; meanwhile they are orphans
                self._waiting[key] = children
                if self._orphans_first:
                    self._orphan(children)
            ghost = self._ghost
            ghost.newer[key] = level << 1 | node[_SAMPLED]  # never a resident key in it
            if len(ghost.newer) >= ghost.half:
                ghost.close(len(self._nodes))
        finally:
            self._release()

    # --- the answer ----------------------------------------------------------------

    def _victims(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        if self._promoted:
            self._balance()
        victims: list[str] = []
        if nbytes <= 0:
            return victims
        freed = 0
        if tenant is None and pinned is never_pinned:  # the usual call: oldest first
            for head in self._order_heads:
                node = head[_NEWER]
                while node is not head:
                    victims.append(node[_KEY])
                    freed += node[_SIZE]
                    if freed >= nbytes:
                        return victims
                    node = node[_NEWER]
            return victims
        for head in self._order_heads:
            node = head[_NEWER]
            while node is not head:
                if freed >= nbytes:
                    return victims
                if (tenant is None or node[_TENANT] == tenant) and not pinned(node[_KEY]):
                    victims.append(node[_KEY])
                    freed += node[_SIZE]
                node = node[_NEWER]
        return victims

    # --- bookkeeping (under the lock) ----------------------------------------------

    def _count(self, node: list[Any], sign: int) -> None:
        """Add (``sign`` 1) or take off (-1) ``node``'s bytes to the total and its tenant's."""
        size = sign * node[_SIZE]
        self._total += size
        tenant = node[_TENANT]
        if tenant is not None:
            left = self._by_tenant.get(tenant, 0) + size
            if left:
                self._by_tenant[tenant] = left
            else:
                self._by_tenant.pop(tenant, None)

    def _link(self, node: list[Any], queue: int) -> None:
        """Queue ``node`` as the newest of ``queue``, or just before its parent's when
        the parent is in that queue too (so a chain leaves from its leaf up)."""
        newer = self._heads[queue]
        parent = node[_PARENT]
        if parent is not None:
            found = self._nodes.get(parent)
            if found is not None and found[_QUEUE] == queue:
                newer = found
        older = newer[_OLDER]
        older[_NEWER] = node
        node[_OLDER] = older
        node[_NEWER] = newer
        newer[_OLDER] = node
        node[_QUEUE] = queue
        self._queue_bytes[queue] += node[_SIZE]

    def _unlink(self, node: list[Any]) -> None:
        """Take ``node`` out of its queue (it keeps its ``_QUEUE``)."""
        older, newer = node[_OLDER], node[_NEWER]
        older[_NEWER] = newer
        newer[_OLDER] = older
        self._queue_bytes[node[_QUEUE]] -= node[_SIZE]

    def _attach(self, node: list[Any]) -> None:
        """Count ``node``'s page among its parent's children (resident or waiting)."""
        parent = node[_PARENT]
        if parent is None:
            return
        found = self._nodes.get(parent)
        if found is None:
            self._waiting[parent] = _with(self._waiting.get(parent), node[_KEY])
        else:
            found[_CHILDREN] = _with(found[_CHILDREN], node[_KEY])

    def _detach(self, node: list[Any]) -> None:
        """Take ``node``'s page out of its parent's children."""
        parent = node[_PARENT]
        if parent is None:
            return
        found = self._nodes.get(parent)
        if found is not None:
            found[_CHILDREN] = _without(found[_CHILDREN], node[_KEY])
            return
        left = _without(self._waiting.get(parent), node[_KEY])
        if left is None:
            self._waiting.pop(parent, None)
        else:
            self._waiting[parent] = left

    def _orphan(self, children: Children) -> None:
        """Move the resident descendants of a removed page (``children``, theirs, ...)
        to the orphans: no prefix look-up reaches them here any more."""
        nodes, orphans = self._nodes, self._orphans
        stack = list(_each(children))
        while stack:
            node = nodes[stack.pop()]
            if node[_QUEUE] == orphans:
                continue  # and so are its own descendants
            self._unlink(node)
            node[_WAS] = node[_QUEUE]
            self._link(node, orphans)
            stack.extend(_each(node[_CHILDREN]))

    def _adopt(self, children: Children) -> None:
        """Put the orphans among ``children`` (their parent is back), and the orphans
        among theirs, back in their levels."""
        nodes, orphans = self._nodes, self._orphans
        stack = list(_each(children))
        while stack:
            node = nodes[stack.pop()]
            if node[_QUEUE] != orphans:
                continue
            self._unlink(node)
            self._link(node, node[_WAS])
            stack.extend(_each(node[_CHILDREN]))

    def _balance(self) -> None:
        """Hand each overfull protected level's oldest pages down one level, from the top.

        Done when victims are chosen after a page went up a level: the tier is full then,
        so each share is of its capacity, not of a tier still filling up.
        """
        self._promoted = False
        limit = self._share * self._total
        queue_bytes, heads = self._queue_bytes, self._heads
        for level in range(self._top, 0, -1):
            while queue_bytes[level] > limit:
                node = heads[level][_NEWER]
                self._unlink(node)
                self._link(node, level - 1)

    def _duel(self, key: str, nbytes: int, hit: bool) -> None:
        """Play a use of a sampled page (``hit``: resident here) against the LRU shadow,
        and when the sample has seen as many hits as the tier holds pages, over the
        sampling rate, move the protected share a step towards whichever hit more."""
        shadow = self._shadow
        if hit:
            self._duel_ours += 1
        if key in shadow:
            self._duel_lru += 1
            shadow.move_to_end(key)
        else:
            shadow[key] = nbytes
            self._shadow_bytes += nbytes
            room = self._total // self._sample + nbytes  # the tier's bytes, sampled alike
            while self._shadow_bytes > room:
                _, size = shadow.popitem(last=False)
                self._shadow_bytes -= size
        ours, lru = self._duel_ours, self._duel_lru
        if (ours + lru) * self._sample < max(64, len(self._nodes)):
            return
        self._duel_ours = self._duel_lru = 0
        if lru > ours:  # recency would have done better: less protection
            self._fraction = max(0.0, self._fraction - _DUEL_STEP)
        elif ours > lru:
            self._fraction = min(self.config.protected_fraction, self._fraction + _DUEL_STEP)
        self._share = self._fraction / self._top
        self._promoted = True  # the next choice of victims balances the levels to it

    # --- what the tier asks ----------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def nbytes(self) -> int:
        return self._total

    def _tenant_bytes(self, tenant: str | None) -> int:
        if tenant is None:
            return self._total - sum(self._by_tenant.values())
        return self._by_tenant.get(tenant, 0)

    def remembered(self) -> int:
        """How many evicted keys the ghost remembers now (its memory, for tests and stats)."""
        with self._lock:
            return len(self._ghost)

    @property
    def protected_fraction(self) -> float:
        """The share of the resident bytes the protected levels may hold now."""
        return self._fraction

    def levels(self) -> dict[str, int]:
        """Resident pages per level, and orphans, for tests and stats."""
        self._acquire()
        try:
            counts = [0] * (self._top + 2)
            for node in self._nodes.values():
                counts[node[_QUEUE]] += 1
        finally:
            self._release()
        out = {f"level{i}": n for i, n in enumerate(counts[:-1])}
        out["orphans"] = counts[-1]
        return out

    def __repr__(self) -> str:
        return (
            f"PrefixPolicy(pages={len(self)}, ghost={len(self._ghost)}, "
            f"nbytes={self.nbytes}, levels={self._top})"
        )
