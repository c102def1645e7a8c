"""Eviction and admission policies replayed on a request trace, beside LRU and the optimum.

Usage: ``python benchmarks/policies.py [--trace FILE] [--capacities 0.02,0.05,0.1,0.2]
[--policies lru,slru,...] [--requests START:END] [--reps N] [--merged N] [--quick]``. The
default trace is ``../shared/traces/mooncake_fast25_synthetic_trace.jsonl`` relative to
the repository (one JSON object a line: ``hash_ids``, one id per 512-token block, and
``input_length``).

Every block id is a page. A request hits the longest prefix of its blocks that the cache
holds; the hit ratio is prefix-hit tokens over all tokens (a request's last block holds
``input_length - 512 * (n - 1)`` tokens). Then each of its blocks is touched when resident
(``record_access``) or, when not, described (``PageInfo(parent=the block before, tokens,
tenant=None)``) and inserted, through the admission policy where a row has one (which
sees every block with ``record_access``); when the cache holds more than its capacity,
the policy's victims are removed at once. Capacity in blocks is the fraction times the
trace's distinct blocks; every page counts as the same number of bytes. The policies are
the registered built-ins, built through their ``PolicySpec`` exactly as a tier builds
them; LRU (the ``lru`` policy) and Belady's offline optimum (OPT: evict the block whose
next use is farthest, computed here on the same sequence) stand beside each as the floor
and the ceiling. Between them stands ``reuse_oracle_hit_ratio``: LRU that admits only the
blocks the trace uses again (it knows *whether* a block comes back, not *when*), the
best an admission filter could ever do in front of LRU.

``--requests START:END`` replays a slice of the trace (Python slice bounds, either may be
left out), capacities then being fractions of the slice's distinct blocks: the second
half of a trace alone is a held-out trace for a policy designed on the whole.

``ns_per_access`` is the policy's own cost: every call a replay makes to the policies is
recorded, then made again to fresh policies and to idle ones (methods that do nothing),
in turn, ``--reps`` times each (5; 1 with ``--quick``; 0 measures no cost and prints
``null``); the fastest CPU time of the first less the fastest of the second, over the
trace's block accesses. ``loop_ns_per_access`` is the idle side: the loop and the calls
themselves.

**In a chain.** Each row without an admission policy (a first tier takes none) is also
replayed through a real :class:`~kvtier.storage.StorageChain` tier: ``open_store`` over a
memory backend of the same capacity in pages with the row's policy as the tier's
eviction (a small page geometry; unbounded calls, in this thread). Each request asks
``exists`` of its blocks (the prefix hit), ``get`` of those held (the backend records the
accesses) and ``put`` of the others, with each page's true parent (``parents``); the
tier's backend evicts through the policy as it fills. The calls the chain and its backend
make to the policy are recorded and made again, as for ``ns_per_access``, to a fresh
policy behind the chain's own wrapper (``ObservedEviction``: pins, the choices it
watches) and to idle ones: ``chain_ns_per_access`` is what the policy costs in a chain,
beside ``ns_per_access`` bare. ``replay_us_per_access`` is the whole replay through the
chain (envelopes, the backend) per block access, for scale.

**False parents.** The vLLM writer merges several requests' saves into one ``put``; a
chain given no ``parents`` takes the key before each page in the put as its parent, so
a request's first stored page gets the page stored before it, another request's. Each
row is also replayed with those parents: ``--merged`` requests (default 4) a put, each
stored page's parent the page stored just before it in its put (None at a put's start),
beside the same replay with the true parents.

Output: one JSON object a line per (policy, capacity) on stdout, in the repository's
benchmark form (``ours`` the policy's hit ratio, ``baseline`` LRU's, ``ratio`` ours /
LRU, ``target`` 1.5 at capacities up to 5 %) with ``policy``, ``capacity_fraction``,
``capacity_blocks``, ``hit_ratio``, ``lru_hit_ratio``, ``opt_hit_ratio``, ``opt_ratio``,
``reuse_oracle_hit_ratio`` and ``ns_per_access`` (its target ``ns_target``); then a line
per (row, capacity) in a chain (``case`` "... in a chain tier ...": ``ours`` the
``chain_ns_per_access``, ``baseline`` the bare ``ns_per_access``, ``ratio`` bare /
chain, with the chain's ``hit_ratio`` and ``bare_hit_ratio``) and a line per (row,
capacity) with false parents (``case`` "... with false parents ...": ``ours`` that hit
ratio, ``baseline`` the hit ratio with true parents, with ``lru_hit_ratio`` and
``merged_requests``); the tables on stderr. ``--quick`` replays the first 1500 requests.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.adapters import build_host_pool, open_store, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.policy import AdmissionPolicy, EvictionPolicy, PageInfo, never_pinned
from kvtier.plugins.manager import load_registry
from kvtier.storage.observed import ObservedEviction
from kvtier.storage.pins import PinSet

BLOCK_TOKENS = 512
#: Bytes a page stands for; every page is the same size, so capacity is in pages.
PAGE_BYTES = 1 << 20
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared"
    / "traces"
    / "mooncake_fast25_synthetic_trace.jsonl"
)
#: Policy rows: ``eviction`` or ``eviction+admission``, each a registered built-in.
DEFAULT_POLICIES = ("lru", "slru", "lru+frequency", "prefix", "prefix+frequency")
TARGET_RATIO = 1.5
TARGET_NS = 2000.0
QUICK_REQUESTS = 1500
#: Requests whose saves one put merges, for the replay with false parents.
DEFAULT_MERGED = 4
#: The page geometry of the chain replay (small: the policy is what is measured).
CHAIN_GEOMETRY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"}
CHAIN_PAGE_TOKENS = 16


@dataclass(frozen=True)
class Request:
    """One request of the trace: its block keys, each block's tokens and page info."""

    keys: tuple[str, ...]
    tokens: tuple[int, ...]
    infos: tuple[PageInfo, ...]


@dataclass(frozen=True)
class Trace:
    """The requests, the distinct block count and the token total."""

    requests: tuple[Request, ...]
    distinct: int
    tokens: int
    accesses: int


def load_trace(path: Path, limit: int | None = None, start: int = 0) -> Trace:
    """Read a JSON-lines trace; each line's ``hash_ids`` become page keys. Requests
    ``start`` to ``limit`` (counted from the first, as a slice) only, when given."""
    requests: list[Request] = []
    seen: set[str] = set()
    skipped = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if limit is not None and skipped + len(requests) >= limit:
                break
            try:
                row = json.loads(line)
                ids = [str(int(h)) for h in row["hash_ids"]]
                length = int(row["input_length"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}:{number}: not a trace row ({exc!r})") from exc
            if not ids:
                continue
            if skipped < start:
                skipped += 1
                continue
            last = max(0, min(BLOCK_TOKENS, length - BLOCK_TOKENS * (len(ids) - 1)))
            tokens = (BLOCK_TOKENS,) * (len(ids) - 1) + (last,)
            infos = tuple(
                PageInfo(parent=ids[i - 1] if i else None, tokens=tokens[i], tenant=None)
                for i in range(len(ids))
            )
            requests.append(Request(tuple(ids), tokens, infos))
            seen.update(ids)
    if not requests:
        raise SystemExit(f"{path}: no requests")
    total = sum(sum(r.tokens) for r in requests)
    accesses = sum(len(r.keys) for r in requests)
    return Trace(tuple(requests), len(seen), total, accesses)


@dataclass(frozen=True)
class Result:
    """One replay: the prefix-hit ratio and how often the capacity was left exceeded."""

    hit_ratio: float
    overflows: int


#: The calls a replay makes, as recorded for :func:`drive`: (call, argument, argument).
CONTAINS, DESCRIBE, INSERT, ACCESS, NBYTES, VICTIMS, REMOVE = range(7)
SEEN, OFFER, ADMIT = range(7, 10)
Call = tuple[int, Any, Any]


def leading_hits(keys: Sequence[str], cache: Container[str]) -> int:
    """How many of ``keys``, from the first, ``cache`` holds: a request's prefix hit ends
    at its first missing block."""
    k = 0
    n = len(keys)
    while k < n and keys[k] in cache:
        k += 1
    return k


def replay(
    trace: Trace,
    capacity_blocks: int,
    eviction: EvictionPolicy,
    admission: AdmissionPolicy | None = None,
    calls: list[Call] | None = None,
    merged: int = 0,
) -> Result:
    """Replay ``trace`` through the policies (see the module docstring for the rules);
    every call made to them is appended to ``calls`` when given. ``merged`` above 1
    describes each stored page with a false parent: the page stored before it in a put of
    ``merged`` requests' pages (see the module docstring)."""
    capacity = capacity_blocks * PAGE_BYTES
    log = calls.append if calls is not None else None
    hit_tokens = 0
    overflows = 0
    stored_before: str | None = None  # the page stored last in this put (false parents)
    for number, request in enumerate(trace.requests):
        if merged > 1 and number % merged == 0:
            stored_before = None
        keys = request.keys
        k = leading_hits(keys, eviction)
        if log is not None:
            for key in keys[: k + 1]:
                log((CONTAINS, key, None))
        hit_tokens += sum(request.tokens[:k])
        for key, info in zip(keys, request.infos, strict=True):
            if admission is not None:
                admission.record_access(key)
            resident = key in eviction
            if log is not None:
                if admission is not None:
                    log((SEEN, key, None))
                log((CONTAINS, key, None))
            if resident:
                eviction.record_access(key)
                if log is not None:
                    log((ACCESS, key, None))
                continue
            if merged > 1:
                info = PageInfo(parent=stored_before, tokens=info.tokens, tenant=info.tenant)
            if admission is not None:
                admission.describe(key, info)
                admitted = admission.admit(key, PAGE_BYTES)
                if log is not None:
                    log((OFFER, key, info))
                    log((ADMIT, key, PAGE_BYTES))
                if not admitted:
                    continue
            stored_before = key
            eviction.describe(key, info)
            eviction.record_insert(key, PAGE_BYTES)
            excess = eviction.nbytes - capacity
            if log is not None:
                log((DESCRIBE, key, info))
                log((INSERT, key, PAGE_BYTES))
                log((NBYTES, None, None))
            if excess > 0:
                victims = eviction.choose_victims(excess)
                if log is not None:
                    log((VICTIMS, excess, None))
                for victim in victims:
                    eviction.record_remove(victim)
                    if log is not None:
                        log((REMOVE, victim, None))
                if eviction.nbytes > capacity:
                    overflows += 1
    return Result(hit_tokens / trace.tokens, overflows)


def drive(calls: Sequence[Call], eviction: Any, admission: Any) -> float:
    """Make ``calls`` (recorded by :func:`replay`) to fresh policies; the CPU seconds.

    The same calls to :class:`Idle` policies time the loop alone, so the difference is
    what the policy's own code costs.
    """
    contains, describe = eviction.__contains__, eviction.describe
    insert, access = eviction.record_insert, eviction.record_access
    victims, remove = eviction.choose_victims, eviction.record_remove
    seen = admission.record_access if admission is not None else None
    offer = admission.describe if admission is not None else None
    admit = admission.admit if admission is not None else None
    start = time.process_time()
    for call, a, b in calls:
        if call == CONTAINS:
            contains(a)
        elif call == ACCESS:
            access(a)
        elif call == DESCRIBE:
            describe(a, b)
        elif call == INSERT:
            insert(a, b)
        elif call == NBYTES:
            eviction.nbytes  # noqa: B018 - the property is what is timed
        elif call == VICTIMS:
            victims(a)
        elif call == REMOVE:
            remove(a)
        elif call == SEEN:
            seen(a)  # type: ignore[misc]
        elif call == OFFER:
            offer(a, b)  # type: ignore[misc]
        else:
            admit(a, b)  # type: ignore[misc]
    return time.process_time() - start


class Idle:
    """A policy that does nothing, to time :func:`drive`'s loop and dispatch alone."""

    nbytes = 0

    def __contains__(self, key: object) -> bool:
        return False

    def describe(self, key: str, info: PageInfo) -> None:
        pass

    def record_insert(self, key: str, nbytes: int) -> None:
        pass

    def record_access(self, key: str) -> None:
        pass

    def choose_victims(self, nbytes: int) -> list[str]:
        return []

    def record_remove(self, key: str) -> None:
        pass

    def admit(self, key: str, nbytes: int) -> bool:
        return True


class Recorded(EvictionPolicy):
    """A tier's policy inside a chain, forwarding every call and recording it for
    :func:`drive` (the calls the chain and the tier's backend make)."""

    def __init__(self, inner: EvictionPolicy, calls: list[Call]) -> None:
        self.inner = inner
        self.log = calls.append

    def describe(self, key: str, info: PageInfo) -> None:
        self.log((DESCRIBE, key, info))
        self.inner.describe(key, info)

    def record_insert(self, key: str, nbytes: int) -> None:
        self.log((INSERT, key, nbytes))
        self.inner.record_insert(key, nbytes)

    def record_access(self, key: str) -> None:
        self.log((ACCESS, key, None))
        self.inner.record_access(key)

    def record_remove(self, key: str) -> None:
        self.log((REMOVE, key, None))
        self.inner.record_remove(key)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        self.log((VICTIMS, nbytes, None))
        return self.inner.choose_victims(nbytes, pinned=pinned, tenant=tenant)

    def __contains__(self, key: object) -> bool:
        self.log((CONTAINS, key, None))
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def nbytes(self) -> int:
        self.log((NBYTES, None, None))
        return self.inner.nbytes

    def tenant_bytes(self, tenant: str | None) -> int:
        return self.inner.tenant_bytes(tenant)


@dataclass(frozen=True)
class ChainResult:
    """One replay through a chain tier: its hit ratio, the calls its policy got, and the
    CPU seconds of the whole replay."""

    hit_ratio: float
    calls: list[Call]
    seconds: float


def replay_chain(trace: Trace, capacity_blocks: int, eviction: str, registry: Any) -> ChainResult:
    """Replay ``trace`` through a real chain tier with ``eviction`` (see the module
    docstring): ``exists``, ``get`` of the held blocks, ``put`` of the others with their
    true parents."""
    geometry = {**CHAIN_GEOMETRY, "page_size": CHAIN_PAGE_TOKENS}
    page_bytes = load_engine_config(geometry).geometry().bytes_per_page + ENVELOPE_BYTES
    tier = {
        "backend": "memory",
        "eviction": eviction,
        "extra_config": {"capacity_bytes": capacity_blocks * page_bytes},
    }
    config = load_engine_config({**geometry, "tiers": [tier]})
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    widest = max(len(request.keys) for request in trace.requests)
    pool = build_host_pool(plan, num_pages=widest, pin_memory=False)
    chain = open_store(plan, pool, backend_call_timeout_s=None)
    calls: list[Call] = []
    observed = chain.tiers[0].eviction
    assert observed is not None
    observed.inner = Recorded(observed.inner, calls)
    hit_tokens = 0
    try:
        start = time.process_time()
        for request in trace.requests:
            keys = request.keys
            held = chain.exists(keys)
            hit_tokens += sum(request.tokens[: held.leading()])
            resident = [key for key, ok in zip(keys, held, strict=True) if ok]
            if resident:
                chain.get(resident, range(len(resident)))
            missing = [i for i, ok in enumerate(held) if not ok]
            if missing:
                chain.put(
                    [keys[i] for i in missing],
                    range(len(missing)),
                    parents=[request.infos[i].parent for i in missing],
                )
        seconds = time.process_time() - start
    finally:
        chain.close()
    return ChainResult(hit_tokens / trace.tokens, calls, seconds)


def chain_cost_ns(
    trace: Trace, calls: Sequence[Call], make: Callable[[], EvictionPolicy], reps: int
) -> float:
    """The policy's cost in a chain, in ns per block access: the chain's recorded calls
    made to a fresh policy behind the chain's wrapper, less the same to an idle one (the
    fastest of ``reps`` each, in turn; see :func:`cost_ns`)."""
    spent: list[float] = []
    idle: list[float] = []
    for _ in range(reps):
        watched = ObservedEviction(make(), lambda key, evicted: None, pins=PinSet())
        spent.append(drive(calls, watched, None))
        idle.append(drive(calls, Idle(), None))
    return max(0.0, min(spent) - min(idle)) * 1e9 / trace.accesses


def optimum(trace: Trace, capacity_blocks: int) -> float:
    """Belady's OPT on the block sequence: on a miss over capacity, drop the block (the
    new one included) whose next use is farthest; the prefix-hit ratio it reaches."""
    sequence = [key for request in trace.requests for key in request.keys]
    never = len(sequence)
    following = [never] * len(sequence)
    last: dict[str, int] = {}
    for position in range(len(sequence) - 1, -1, -1):
        key = sequence[position]
        following[position] = last.get(key, never)
        last[key] = position
    resident: dict[str, int] = {}  # key -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, key), stale entries skipped
    hit_tokens = 0
    position = 0
    for request in trace.requests:
        hit_tokens += sum(request.tokens[: leading_hits(request.keys, resident)])
        for key in request.keys:
            upcoming = following[position]
            position += 1
            resident[key] = upcoming
            heapq.heappush(heap, (-upcoming, key))
            while len(resident) > capacity_blocks:
                negative, victim = heapq.heappop(heap)
                if resident.get(victim) == -negative:
                    del resident[victim]
    return hit_tokens / trace.tokens


def reuse_oracle(trace: Trace, capacity_blocks: int) -> float:
    """LRU that admits a missing block only when the trace uses it again later (an
    oracle of *whether*, not *when*); the prefix-hit ratio it reaches."""
    sequence = [key for request in trace.requests for key in request.keys]
    again = [False] * len(sequence)
    seen: set[str] = set()
    for position in range(len(sequence) - 1, -1, -1):
        key = sequence[position]
        again[position] = key in seen
        seen.add(key)
    resident: OrderedDict[str, None] = OrderedDict()
    hit_tokens = 0
    position = 0
    for request in trace.requests:
        hit_tokens += sum(request.tokens[: leading_hits(request.keys, resident)])
        for key in request.keys:
            if key in resident:
                resident.move_to_end(key)
            elif again[position]:
                resident[key] = None
                if len(resident) > capacity_blocks:
                    resident.popitem(last=False)
            position += 1
    return hit_tokens / trace.tokens


def build_row(registry: Any, row: str) -> tuple[EvictionPolicy, AdmissionPolicy | None]:
    """The policies of a row ``eviction[+admission]``, built through their specs."""
    eviction_name, _, admission_name = row.partition("+")
    eviction = registry.policies[eviction_name].build(None)
    admission = registry.policies[admission_name].build(None) if admission_name else None
    if not isinstance(eviction, EvictionPolicy):
        raise SystemExit(f"{eviction_name!r} is not an eviction policy")
    if admission is not None and not isinstance(admission, AdmissionPolicy):
        raise SystemExit(f"{admission_name!r} is not an admission policy")
    return eviction, admission


def cost_ns(
    trace: Trace,
    calls: Sequence[Call],
    make: Callable[[], tuple[EvictionPolicy, AdmissionPolicy | None]],
    reps: int,
) -> tuple[float, float]:
    """The policy's own cost and the loop's, in ns per block access: the fastest of
    ``reps`` drives of ``calls`` through fresh policies, less the fastest through idle
    ones, taken in turn (the fastest: what other work on the machine disturbed least)."""
    spent: list[float] = []
    idle: list[float] = []
    for _ in range(reps):
        eviction, admission = make()
        spent.append(drive(calls, eviction, admission))
        idle.append(drive(calls, Idle(), Idle() if admission is not None else None))
    scale = 1e9 / trace.accesses
    return max(0.0, min(spent) - min(idle)) * scale, min(idle) * scale


def chain_line(
    trace: Trace,
    registry: Any,
    row: str,
    fraction: float,
    blocks: int,
    bare: tuple[float, float | None],
    reps: int,
) -> dict[str, Any]:
    """The line of ``row`` replayed through a chain tier (``bare``: the row's hit ratio
    and ns per access bare)."""
    result = replay_chain(trace, blocks, row, registry)
    chain_ns: float | None = None
    if reps:
        make = lambda: build_row(registry, row)[0]  # noqa: E731
        chain_ns = chain_cost_ns(trace, result.calls, make, reps)
    bare_hit, bare_ns = bare
    ratio = bare_ns / chain_ns if chain_ns and bare_ns is not None else None
    return {
        "bench": "policies",
        "case": f"{row} in a chain tier at {fraction:g} of {trace.distinct} blocks",
        "ours": None if chain_ns is None else round(chain_ns),
        "baseline": None if bare_ns is None else round(bare_ns),
        "baseline_name": "the bare policy",
        "unit": "ns per access",
        "ratio": None if ratio is None else round(ratio, 3),
        "target": None,
        "policy": row,
        "capacity_fraction": fraction,
        "capacity_blocks": blocks,
        "hit_ratio": round(result.hit_ratio, 4),
        "bare_hit_ratio": round(bare_hit, 4),
        "chain_ns_per_access": None if chain_ns is None else round(chain_ns),
        "ns_per_access": None if bare_ns is None else round(bare_ns),
        "replay_us_per_access": round(result.seconds * 1e6 / trace.accesses, 2),
    }


def false_parents_line(
    trace: Trace,
    registry: Any,
    row: str,
    fraction: float,
    blocks: int,
    true_hit: float,
    lru: float,
    merged: int,
) -> dict[str, Any]:
    """The line of ``row`` replayed with false parents (``merged`` requests a put),
    beside its hit ratio with the true ones."""
    false_hit = replay(trace, blocks, *build_row(registry, row), merged=merged).hit_ratio
    return {
        "bench": "policies",
        "case": f"{row} with false parents at {fraction:g} of {trace.distinct} blocks",
        "ours": round(false_hit, 4),
        "baseline": round(true_hit, 4),
        "baseline_name": "true parents",
        "unit": "prefix-hit token ratio",
        "ratio": round(false_hit / true_hit, 3) if true_hit else None,
        "target": None,
        "policy": row,
        "capacity_fraction": fraction,
        "capacity_blocks": blocks,
        "hit_ratio": round(false_hit, 4),
        "true_parents_hit_ratio": round(true_hit, 4),
        "lru_hit_ratio": round(lru, 4),
        "merged_requests": merged,
    }


def run(
    trace: Trace,
    fractions: Sequence[float],
    rows: Sequence[str],
    reps: int = 5,
    merged: int = DEFAULT_MERGED,
) -> list[dict[str, Any]]:
    """Every row at every capacity, bare, in a chain tier and with false parents; the
    JSON lines printed and returned."""
    registry = load_registry()  # installed plugins' policies too (KVTIER_DISABLE_* apply)
    unknown = [part for row in rows for part in row.split("+") if part not in registry.policies]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; registered: {sorted(registry.policies)}")
    out: list[dict[str, Any]] = []
    extra: list[dict[str, Any]] = []
    print(
        f"{'policy':<18} {'capacity':>8} {'blocks':>6} {'hit':>7} {'LRU':>7} {'OPT':>7} "
        f"{'xLRU':>5} {'xOPT':>5} {'ns/acc':>6}",
        file=sys.stderr,
    )
    for fraction in fractions:
        blocks = max(1, int(fraction * trace.distinct))
        opt = optimum(trace, blocks)
        oracle = reuse_oracle(trace, blocks)
        lru = replay(trace, blocks, *build_row(registry, "lru")).hit_ratio
        for row in rows:
            calls: list[Call] = []
            result = replay(trace, blocks, *build_row(registry, row), calls=calls if reps else None)
            own_ns: float | None = None
            loop_ns: float | None = None
            if reps:
                make = lambda row=row: build_row(registry, row)  # noqa: E731
                own_ns, loop_ns = cost_ns(trace, calls, make, reps)
            del calls
            ratio = result.hit_ratio / lru if lru else None
            line = {
                "bench": "policies",
                "case": f"{row} at {fraction:g} of {trace.distinct} blocks",
                "ours": round(result.hit_ratio, 4),
                "baseline": round(lru, 4),
                "baseline_name": "lru",
                "unit": "prefix-hit token ratio",
                "ratio": None if ratio is None else round(ratio, 3),
                "target": TARGET_RATIO if fraction <= 0.05 and row != "lru" else None,
                "policy": row,
                "capacity_fraction": fraction,
                "capacity_blocks": blocks,
                "hit_ratio": round(result.hit_ratio, 4),
                "lru_hit_ratio": round(lru, 4),
                "opt_hit_ratio": round(opt, 4),
                "opt_ratio": round(result.hit_ratio / opt, 3) if opt else None,
                "reuse_oracle_hit_ratio": round(oracle, 4),
                "ns_per_access": None if own_ns is None else round(own_ns),
                "ns_target": TARGET_NS,
                "loop_ns_per_access": None if loop_ns is None else round(loop_ns),
                "capacity_overflows": result.overflows,
            }
            print(json.dumps(line), flush=True)
            print(
                f"{row:<18} {fraction:>8g} {blocks:>6} {result.hit_ratio:>7.4f} {lru:>7.4f} "
                f"{opt:>7.4f} {line['ratio'] or 0:>5.2f} {line['opt_ratio'] or 0:>5.2f} "
                f"{'-' if own_ns is None else format(own_ns, '.0f'):>6}",
                file=sys.stderr,
                flush=True,
            )
            out.append(line)
            if "+" not in row:
                bare = (result.hit_ratio, own_ns)
                extra.append(chain_line(trace, registry, row, fraction, blocks, bare, reps))
            extra.append(
                false_parents_line(
                    trace, registry, row, fraction, blocks, result.hit_ratio, lru, merged
                )
            )
    chained = [line for line in extra if "in a chain" in line["case"]]
    print(
        f"\nin a chain tier: {'policy':<18} {'capacity':>8} {'hit':>7} {'bare':>7} "
        f"{'ns/acc':>7} {'bare':>7} {'us/acc':>7}",
        file=sys.stderr,
    )
    for line in chained:
        print(json.dumps(line), flush=True)
        print(
            f"{'':<16} {line['policy']:<18} {line['capacity_fraction']:>8g} "
            f"{line['hit_ratio']:>7.4f} {line['bare_hit_ratio']:>7.4f} "
            f"{'-' if line['ours'] is None else line['ours']:>7} "
            f"{'-' if line['baseline'] is None else line['baseline']:>7} "
            f"{line['replay_us_per_access']:>7.2f}",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"\nfalse parents ({merged} requests a put): {'policy':<18} {'capacity':>8} "
        f"{'false':>7} {'true':>7} {'LRU':>7}",
        file=sys.stderr,
    )
    for line in extra:
        if line in chained:
            continue
        print(json.dumps(line), flush=True)
        print(
            f"{'':<36} {line['policy']:<18} {line['capacity_fraction']:>8g} "
            f"{line['hit_ratio']:>7.4f} {line['true_parents_hit_ratio']:>7.4f} "
            f"{line['lru_hit_ratio']:>7.4f}",
            file=sys.stderr,
            flush=True,
        )
    return out + extra


def parse_slice(text: str) -> tuple[int, int | None]:
    """``START:END`` (either may be left out) as request bounds; a clear exit otherwise."""
    first, colon, last = text.partition(":")
    try:
        start = int(first) if first.strip() else 0
        end = int(last) if last.strip() else None
    except ValueError:
        start = -1
        end = None
    if not colon or start < 0 or (end is not None and end <= start):
        raise SystemExit(f"--requests: {text!r} is not START:END with 0 <= START < END")
    return start, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSON-lines trace")
    parser.add_argument(
        "--capacities",
        default="0.02,0.05,0.1,0.2",
        help="capacities as fractions of the trace's distinct blocks, comma-separated",
    )
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="rows, comma-separated: an eviction policy, or eviction+admission",
    )
    parser.add_argument(
        "--requests",
        default=":",
        help="the requests to replay, as a slice START:END (e.g. 1996: for the second half)",
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="cost measurements per row (0: none; default 5)"
    )
    parser.add_argument(
        "--merged",
        type=int,
        default=DEFAULT_MERGED,
        help="requests a put merges, for the replay with false parents (2 or more)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"replay the first {QUICK_REQUESTS} requests"
    )
    args = parser.parse_args()
    start, end = parse_slice(args.requests)
    if args.quick:
        end = min(end, start + QUICK_REQUESTS) if end is not None else start + QUICK_REQUESTS
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    if reps < 0:
        raise SystemExit("--reps: a count of 0 or more")
    if args.merged < 2:
        raise SystemExit("--merged: 2 or more requests a put")
    try:
        fractions = [float(part) for part in args.capacities.split(",") if part.strip()]
    except ValueError as exc:
        raise SystemExit(f"--capacities: {exc}") from exc
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise SystemExit("--capacities: fractions in (0, 1], comma-separated")
    rows = [part.strip() for part in args.policies.split(",") if part.strip()]
    trace = load_trace(args.trace.resolve(), end, start)
    print(
        f"policies: {len(trace.requests)} requests, {trace.accesses} block accesses, "
        f"{trace.distinct} distinct blocks, {trace.tokens} tokens",
        file=sys.stderr,
    )
    run(trace, fractions, rows, reps=reps, merged=args.merged)


if __name__ == "__main__":
    main()
