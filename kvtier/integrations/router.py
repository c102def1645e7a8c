"""A reference KV-aware router: each request goes to the engine whose tiers hold the
longest prefix of it, by the engines' own KV events.

Engines publish what their caches hold as KV events (vLLM's and SGLang's ZMQ publishers):
their device cache's blocks under their own medium (``GPU``), and kvtier's tiers' pages
under ``KVTIER:<index>:<backend>`` (vLLM) or SGLang's medium names. The router keeps one
index of all of it (:class:`PrefixIndex`):

- a block is named by the router itself, from the tokens the event carries, chained to its
  parent (:func:`block_ids`), so engines that hash blocks differently (each vLLM process
  seeds its own hashes) still agree on a block; an event without tokens is placed through
  the engine's earlier events of the same block hash, or left out and counted;
- a page in a tier that other hosts share (a backend declaring ``shared_nodes``: Mooncake;
  vLLM's events of it say ``locality`` ``REMOTE``) counts for every engine; a page in an
  engine's own tier or device cache counts for that engine alone.

:class:`PrefixRouter` then scores each engine by the leading blocks of a request it could
skip (held anywhere it reads from), prefers the one holding more of them in its own
memory or tiers, and breaks ties by load (requests in flight), round-robin among equals.
So a hot prefix is not piled onto one engine, an engine more than ``balance_slack``
requests busier than the least busy one is passed over for it. Requests whose blocks are
keyed by more than their tokens (a LoRA adapter, multimodal inputs, a cache salt) are not
matched by this reference router: their events are counted as ``keyed_events`` and left
out, and such a request is routed by load alone. With ``work_weight`` the router weighs
prefill work (tokens to compute, here and queued) instead of the prefix alone.

:class:`EventFeed` subscribes to one engine's ZMQ publisher on a thread and hands each
decoded event to the router; :func:`decode_batch` reads vLLM's and SGLang's batches alike
(both encode an event as a map of its field names tagged with its class name), so the
router needs neither engine installed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.errors import InvalidFieldError
from kvtier.core.specs import Feature

__all__ = [
    "Cleared",
    "EventFeed",
    "PrefixIndex",
    "PrefixRouter",
    "Removed",
    "Route",
    "Stored",
    "block_ids",
    "decode_batch",
    "normalized_events",
    "shared_medium",
]

log = logging.getLogger(__name__)

#: The parent of a request's first block.
ROOT = b"\x00" * 16


@dataclass(frozen=True)
class Stored:
    """An engine's cache now holds these blocks (vLLM's and SGLang's ``BlockStored``)."""

    block_hashes: Sequence[Hashable]
    parent: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None
    keyed: bool = False  # the blocks are keyed by more than their tokens
    #: vLLM's ``locality``: ``REMOTE`` marks a store other engines read too
    locality: str | None = None


@dataclass(frozen=True)
class Removed:
    """An engine's cache no longer holds these blocks (``BlockRemoved``)."""

    block_hashes: Sequence[Hashable]
    medium: str | None


@dataclass(frozen=True)
class Cleared:
    """An engine emptied its device cache (``AllBlocksCleared``)."""


Event = Stored | Removed | Cleared


def block_ids(tokens: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The router's name of each whole block of ``tokens``, each chained to the one before
    (the first to ``parent``): equal names mean equal prefixes."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(
            b"".join(int(t).to_bytes(4, "little") for t in tokens[start : start + block_size])
        )
        parent = digest.digest()
        out.append(parent)
    return out


def shared_medium(medium: str | None) -> bool:
    """Whether ``medium`` names a kvtier tier other hosts share: ``KVTIER:<index>:<backend>``
    (vLLM) whose backend declares ``shared_nodes``, or SGLang's ``EXTERNAL``."""
    if medium == "EXTERNAL":
        return True
    if not medium or not medium.startswith("KVTIER:"):
        return False
    from kvtier.plugins.manager import default_registry

    backend = medium.rsplit(":", 1)[-1]
    spec = default_registry().backends.get(backend)
    return spec is not None and Feature.SHARED_NODES in spec.features


def _device(medium: str | None) -> str:
    return medium or "GPU"


@dataclass
class _Engine:
    #: the engine's block hash -> the router's block name (the oldest forgotten)
    names: OrderedDict[Hashable, bytes] = field(default_factory=OrderedDict)
    #: the router's block name -> the engine's own media holding it
    held: dict[bytes, set[str]] = field(default_factory=dict)


class PrefixIndex:
    """Which engine holds which blocks in which medium, from their KV events.

    Thread-safe (feeds apply events on their threads while the router reads). Each
    engine's hash-to-name table keeps at most ``names_limit`` entries (the oldest are
    forgotten: their later events without tokens are left out and counted).
    """

    def __init__(
        self,
        engines: Iterable[str],
        *,
        shared: Callable[[str | None], bool] = shared_medium,
        names_limit: int = 1 << 20,
    ) -> None:
        self._engines = {name: _Engine() for name in engines}
        if not self._engines:
            raise InvalidFieldError("engines", "no engine given; name at least one", value=[])
        self._shared_of = shared
        self._shared_cache: dict[str | None, bool] = {}
        #: the router's block name -> shared media holding it (for every engine)
        self._shared: dict[bytes, set[str]] = {}
        self._limit = max(1, names_limit)
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {
            "events": 0,
            "stored_blocks": 0,
            "removed_blocks": 0,
            "unplaced_blocks": 0,
            "keyed_events": 0,
        }

    @property
    def engines(self) -> list[str]:
        """The engines' names, in the order given."""
        return list(self._engines)

    def _is_shared(self, medium: str | None) -> bool:
        known = self._shared_cache.get(medium)
        if known is None:
            known = self._shared_cache[medium] = bool(self._shared_of(medium))
        return known

    def _engine(self, engine: str) -> _Engine:
        state = self._engines.get(engine)
        if state is None:
            raise InvalidFieldError(
                "engine", f"{engine!r} is not one of {sorted(self._engines)}", value=engine
            )
        return state

    def apply(self, engine: str, event: Event) -> None:
        """Record one of ``engine``'s events."""
        state = self._engine(engine)
        with self._lock:
            self.counters["events"] += 1
            if isinstance(event, Stored):
                self._stored(state, event)
            elif isinstance(event, Removed):
                self._removed(state, event)
            else:
                for media in state.held.values():
                    media.discard("GPU")
                state.held = {name: media for name, media in state.held.items() if media}

    def _name(self, state: _Engine, block_hash: Hashable, name: bytes) -> None:
        state.names[block_hash] = name
        state.names.move_to_end(block_hash)
        while len(state.names) > self._limit:
            state.names.popitem(last=False)

    def _stored(self, state: _Engine, event: Stored) -> None:
        hashes = list(event.block_hashes)
        if event.keyed:
            self.counters["keyed_events"] += 1
            return
        size = event.block_size
        if size > 0 and len(event.token_ids) == size * len(hashes):
            parent = ROOT if event.parent is None else state.names.get(event.parent)
            if parent is None:
                self.counters["unplaced_blocks"] += len(hashes)
                return
            names: list[bytes | None] = list(block_ids(event.token_ids, size, parent))
            for block_hash, name in zip(hashes, names, strict=True):
                assert name is not None
                self._name(state, block_hash, name)
        else:  # no tokens: blocks this engine described before
            names = [state.names.get(block_hash) for block_hash in hashes]
        medium = _device(event.medium)
        if event.locality == "REMOTE" and not self._is_shared(medium):
            self._shared_cache[medium] = True  # the engine says its store is shared
        shared = self._is_shared(medium)
        for name in names:
            if name is None:
                self.counters["unplaced_blocks"] += 1
                continue
            self.counters["stored_blocks"] += 1
            if shared:
                self._shared.setdefault(name, set()).add(medium)
            else:
                state.held.setdefault(name, set()).add(medium)

    def _removed(self, state: _Engine, event: Removed) -> None:
        medium = _device(event.medium)
        table = self._shared if self._is_shared(medium) else state.held
        for block_hash in event.block_hashes:
            name = state.names.get(block_hash)
            media = table.get(name) if name is not None else None
            if media is None:
                continue
            self.counters["removed_blocks"] += 1
            media.discard(medium)
            if not media:
                del table[name]  # type: ignore[arg-type]

    def matched(self, names: Sequence[bytes]) -> dict[str, tuple[int, int]]:
        """Per engine, (leading blocks of ``names`` it holds or reads from a shared tier,
        how many of those it holds itself)."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for engine, state in self._engines.items():
                count = own = 0
                for name in names:
                    if name in state.held:
                        own += 1
                    elif name not in self._shared:
                        break
                    count += 1
                out[engine] = (count, own)
        return out


@dataclass(frozen=True)
class Route:
    """Where a request goes, and why: each engine's (matched blocks, blocks held itself)."""

    engine: str
    matched: dict[str, tuple[int, int]]
    loads: dict[str, int]


class PrefixRouter:
    """Sends each request to the engine whose tiers hold its longest prefix (see the module
    docstring); :meth:`started` and :meth:`finished` keep each engine's load.

    With ``work_weight`` > 0 it weighs the prefill work instead: an engine's cost is the
    tokens this request would compute there plus ``work_weight`` times the tokens of the
    requests routed there and not finished yet, and the cheapest engine wins (then the one
    holding more of the prefix itself, the less busy, round-robin): a hot prefix then
    spreads once its engine's queue costs more than recomputing it elsewhere.
    """

    def __init__(
        self,
        engines: Sequence[str],
        *,
        block_size: int,
        shared: Callable[[str | None], bool] = shared_medium,
        balance_slack: int = 4,
        work_weight: float = 0.0,
        index: PrefixIndex | None = None,
    ) -> None:
        if block_size <= 0:
            raise InvalidFieldError(
                "block_size", f"{block_size} is not the engines' block size (> 0)", value=block_size
            )
        if balance_slack < 0:
            raise InvalidFieldError(
                "balance_slack",
                f"{balance_slack} is not a count of requests (>= 0)",
                value=balance_slack,
            )
        if not work_weight >= 0:
            raise InvalidFieldError(
                "work_weight", f"{work_weight} is not a weight (>= 0)", value=work_weight
            )
        #: what the engines hold (``index``: one another router keeps too, fed once)
        self.index = index if index is not None else PrefixIndex(engines, shared=shared)
        if self.index.engines != list(engines):
            raise InvalidFieldError(
                "index", f"holds engines {self.index.engines}, not {list(engines)}", value=engines
            )
        self.block_size = block_size
        self.balance_slack = balance_slack
        self.work_weight = work_weight
        self._loads = dict.fromkeys(self.index.engines, 0)
        #: tokens to compute of the requests routed to each engine, not finished yet
        self._work = dict.fromkeys(self.index.engines, 0)
        self._routed: dict[str, tuple[str, int]] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def apply(self, engine: str, event: Event) -> None:
        """Record one of ``engine``'s KV events."""
        self.index.apply(engine, event)

    def route(
        self, tokens: Sequence[int], *, keyed: bool = False, request_id: str | None = None
    ) -> Route:
        """The engine for a request of ``tokens`` (``keyed``: its blocks are keyed by more
        than its tokens, so it goes by load alone). Counts the request as started there
        (``request_id``: :meth:`finished` then also takes back its work)."""
        names = [] if keyed else block_ids(tokens, self.block_size)
        matched = self.index.matched(names)
        work = {
            e: max(1, len(tokens) - count * self.block_size) for e, (count, _) in matched.items()
        }
        with self._lock:
            loads = dict(self._loads)
            least = min(loads.values())
            engines = self.index.engines
            rotated = engines[self._turn % len(engines) :] + engines[: self._turn % len(engines)]
            self._turn += 1
            fair = [e for e in rotated if loads[e] - least <= self.balance_slack]
            if self.work_weight > 0:
                weight = self.work_weight
                best = min(
                    fair,
                    key=lambda e: (work[e] + weight * self._work[e], -matched[e][1], loads[e]),
                )
            else:
                best = max(fair, key=lambda e: (matched[e][0], matched[e][1], -loads[e]))
            self._loads[best] += 1
            if request_id is not None:
                self._work[best] += work[best]
                self._routed[request_id] = (best, work[best])
        return Route(best, matched, loads)

    def started(self, engine: str) -> None:
        """A request was sent to ``engine`` without :meth:`route`."""
        with self._lock:
            self._loads[engine] += 1

    def finished(self, engine: str, request_id: str | None = None) -> None:
        """A request sent to ``engine`` finished (``request_id``: the one given to
        :meth:`route`, whose work it takes back)."""
        with self._lock:
            self._loads[engine] = max(0, self._loads[engine] - 1)
            routed = self._routed.pop(request_id, None) if request_id is not None else None
            if routed is not None:
                self._work[routed[0]] = max(0, self._work[routed[0]] - routed[1])


# --- engines' ZMQ publishers ------------------------------------------------------------------

Decoder = Callable[[bytes], list[Event]]
#: Fields of vLLM's and SGLang's ``BlockStored`` that key a block by more than its tokens.
_KEYING_FIELDS = ("lora_id", "lora_name", "cache_salt")


def normalized_events(events: Iterable[Mapping[str, Any]]) -> list[Event]:
    """vLLM's or SGLang's KV events, as their publishers encode them (a map of field names
    tagged ``type``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), as the
    router's. Fields either engine left out read as None; other types are skipped."""
    out: list[Event] = []
    for event in events:
        kind = event.get("type")
        if kind == "BlockStored":
            extra = event.get("extra_keys")
            keyed = any(event.get(name) for name in _KEYING_FIELDS)
            keyed = keyed or bool(extra and any(e for e in extra))
            out.append(
                Stored(
                    list(event.get("block_hashes") or ()),
                    event.get("parent_block_hash"),
                    list(event.get("token_ids") or ()),
                    int(event.get("block_size") or 0),
                    event.get("medium"),
                    keyed,
                    event.get("locality"),
                )
            )
        elif kind == "BlockRemoved":
            out.append(Removed(list(event.get("block_hashes") or ()), event.get("medium")))
        elif kind == "AllBlocksCleared":
            out.append(Cleared())
    return out


def decode_batch(payload: bytes) -> list[Event]:
    """One batch from a vLLM or SGLang KV event publisher (msgpack: ``[ts, events, rank]``),
    as the router's events; needs neither engine installed, only ``msgspec``."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"not a KV event batch: {type(batch).__name__}")
    return normalized_events(e for e in batch[1] if isinstance(e, Mapping))


class EventFeed:
    """One engine's ZMQ KV event publisher, subscribed on a thread, each event handed to
    ``router``; ``decode`` reads a batch (:func:`decode_batch`: vLLM's and SGLang's). A
    batch that fails to decode is counted as ``bad_batches`` and skipped."""

    def __init__(
        self, endpoint: str, engine: str, router: PrefixRouter, decode: Decoder = decode_batch
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self.engine = engine
        self.batches = 0
        self.bad_batches = 0
        self._router = router
        self._decode = decode
        self._socket: Any = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvtier-router-{engine}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if not self._socket.poll(50, zmq.POLLIN):
                continue
            frames = self._socket.recv_multipart()
            try:
                events = self._decode(frames[-1])
            except Exception as exc:  # a publisher of another version: skip, count
                self.bad_batches += 1
                log.warning("kvtier router: a batch from %s failed to decode: %s", self.engine, exc)
                continue
            self.batches += 1
            for event in events:
                self._router.apply(self.engine, event)

    def close(self) -> None:
        """Stop receiving (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
