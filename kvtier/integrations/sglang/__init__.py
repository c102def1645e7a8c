"""SGLang's HiCache storage (L3) on any kvtier backend, through SGLang's ``dynamic`` loader.

SGLang loads it with (``docs/sglang.md`` has the full command line)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
      "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
      "kvtier": {"backend": "file", "extra_config": {"root": "/mnt/nvme/kvtier"}}}'

SGLang's loader checks that :class:`KvtierHiCacheStorage` subclasses its ``HiCacheStorage``
and calls ``KvtierHiCacheStorage(storage_config, kwargs)``. The ``kvtier`` section is
validated there, with kvtier's parser and errors (unknown keys, types, the backend's own
options, attention kind). SGLang then hands over its host pool (``register_mem_pool_host``),
where the pool's geometry and layout are checked against the backend and the backend is
built. Both steps run inside SGLang's ``attach_storage_backend``, before any storage thread
starts, so a bad configuration stops the server at start-up.

Data path: with ``"interface_v1": 1`` SGLang calls ``batch_exists``, ``batch_get_v1`` and
``batch_set_v1``. A page reaches the backend as its envelope slot (one 4096-byte slot per
host page, in a slab kept here because SGLang's pool has no header room) followed by the
page's contiguous runs inside SGLang's own ``kv_buffer``; backends read and write those
regions in place, with no fresh tensor and no gather or scatter; backends that move only
registered memory (Mooncake) get the whole ``kv_buffer`` and the slab registered once, when
SGLang hands over its pool (:meth:`SGLangPages.memory_regions`). The core's
:class:`~kvtier.core.pagestore.PageStore` writes and verifies the envelopes, so a truncated,
bit-flipped or foreign page is a counted miss, never data. The legacy tensor API
(``get``/``set``/``batch_get``/``batch_set``/``exists``) stores the same bytes in the same
format, so both paths read each other's pages.

Hybrid models (SGLang's v2 calls): the extra host pools SGLang registers with
``register_mem_host_pool_v2`` (Mamba state, SWA KV, ...) each get a plan and page store of
their own, built the same way (:mod:`kvtier.integrations.sglang.pools`); ``batch_exists_v2``
counts a prefix only where every pool's hit policy allows it, and ``batch_get_v2`` ends a
pool's run at its first missing or invalid page.

Keys: SGLang's page hashes are used as given, prefixed by kvtier's namespace (model,
host-pool layout, geometry fingerprint, tenant) and, for MHA under tensor parallelism,
suffixed by the rank. MLA pages are identical on every rank, so they are shared and written
only by the rank SGLang names the storage writer (``HiCacheStorageConfig.is_storage_writer``).

The real SGLang host pools this reads are ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost``; the attributes used are ``kv_buffer``, ``layout``, ``page_size``,
``size``, ``dtype``, ``layer_num``, ``head_num``/``head_dim`` (MHA), ``kv_cache_dim`` and
``qk_rope_head_dim`` (MLA), ``dcp_size`` and the view method
``get_data_page(index, flat=False)``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field, field_validator

from kvtier.core.capabilities import ResolvedPlan, check_backend, open_page_store, resolve
from kvtier.core.config import (
    EngineConfig,
    load_engine_config,
    validate_model,
)
from kvtier.core.errors import (
    InvalidFieldError,
    MissingFieldError,
    StorageError,
    TransferError,
    UnsupportedCombinationError,
)
from kvtier.core.geometry import AttentionKind, dtype_from_name, dtype_name
from kvtier.core.keys import external_key
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import Counters
from kvtier.integrations.identity import weights_digest
from kvtier.integrations.section import OPTIONS_AT, SECTION, EngineSection, find_section
from kvtier.integrations.sglang.pages import (
    SGLangPages,
    SlotPages,
    StatePages,
    in_place_refusal,
    pool_geometry_fields,
    pool_layout,
    unsupported_pool,
)
from kvtier.integrations.sglang.pools import (
    ExtraPool,
    is_kv_shaped,
    is_per_rank,
    leading_run,
    restorable_prefixes,
    state_geometry_fields,
)
from kvtier.plugins.manager import default_registry

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        "kvtier.integrations.sglang needs SGLang's HiCache storage module "
        f"(sglang.srt.mem_cache.hicache_storage), which failed to import: {exc}. "
        "Install the extra with `pip install 'kvtier[sglang]'`, or load this class from "
        "inside the SGLang server (--hicache-storage-backend dynamic)"
    ) from exc

__all__ = [
    "SECTION",
    "KvtierHiCacheStorage",
    "SGLangPages",
    "SGLangSection",
    "pool_geometry_fields",
    "pool_layout",
]

log = logging.getLogger(__name__)

#: How parser errors name kvtier's section of SGLang's storage extra-config.
_LABEL = "extra-config 'kvtier' section"
#: Where the backend's options sit in SGLang's extra-config, as errors name them.
_OPTIONS_AT = OPTIONS_AT
_DOCS = "docs/sglang.md"


class SGLangSection(EngineSection):
    """The ``kvtier`` section of SGLang's ``--hicache-storage-backend-extra-config``."""

    model: str | None = Field(
        None,
        min_length=1,
        description="Model id for the key namespace; default: SGLang's model name.",
    )
    dtype: str | None = Field(
        None,
        description="The KV dtype, only for host pools that store KV as raw bytes "
        "(fp8 KV kept as uint8): 'float8_e4m3fn' or 'float8_e5m2'.",
    )
    checksum_workers: int = Field(
        4,
        strict=True,
        ge=1,
        le=64,
        description="Threads that checksum the pages of one batch in parallel (a SGLang "
        "host has cores to spare, and prefetch latency is on the request's path).",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return dtype_name(dtype_from_name(value.strip()))
        except InvalidFieldError as exc:
            raise ValueError(str(exc).removeprefix("dtype: ")) from None


# --- the storage class SGLang loads --------------------------------------------------------


def _section(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``kvtier`` section, parsed; a clear error when it is missing or misspelt."""
    return find_section(
        extra,
        where="extra-config",
        label=_LABEL,
        example='{"backend": "file"}',
        docs=_DOCS,
    )


@dataclass
class _Attached:
    """Everything built once SGLang registered its host pool."""

    pages: SGLangPages
    store: PageStore
    plan: ResolvedPlan
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.store.close()
        self.store.backend.close()


@dataclass
class _Window:
    """Per-direction metrics since SGLang last asked (its StorageMetrics shape)."""

    pages: list[int] = field(default_factory=list)
    bandwidth: list[float] = field(default_factory=list)


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang HiCache storage on a kvtier backend; load it with the ``dynamic`` backend."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.storage_config = storage_config
        extra = storage_config.extra_config
        section = _section(extra)
        self._registry = default_registry()
        if "backend" not in section:
            names = ", ".join(repr(name) for name in sorted(self._registry.backends))
            raise MissingFieldError(
                f"{SECTION}.backend",
                hint=f"; name the kvtier storage backend, one of {names} (see {_DOCS})",
            )
        self.settings = validate_model(SGLangSection, section, where=SECTION, label=_LABEL)
        self.attention = AttentionKind.MLA if storage_config.is_mla_model else AttentionKind.MHA
        self._model_id = self._model_id_for(storage_config)
        # What needs no host pool is checked now, as resolve() checks it: SGLang constructs
        # the storage first and hands its host pool over in register_mem_pool_host.
        self.spec, _ = check_backend(
            self._engine_config(),
            self._registry.backends,
            self._registry.io_backends,
            options_at=_OPTIONS_AT,
        )
        self._check_parallelism(storage_config)
        writer = getattr(storage_config, "is_storage_writer", None)
        #: Whether this rank writes: every MHA rank, one rank for MLA (SGLang decides).
        self.is_writer = bool(
            writer
            if writer is not None
            else not storage_config.is_mla_model or storage_config.tp_rank == 0
        )
        self.zero_copy = bool((extra or {}).get("interface_v1"))
        if not self.zero_copy:
            log.warning(
                'kvtier: the SGLang extra-config has no "interface_v1": 1, so SGLang uses '
                "its generic path (a fresh tensor per page and copies in and out of the "
                'host pool); add "interface_v1": 1 for the zero-copy path (%s). Pages '
                "moved this way are counted as generic_path_pages.",
                _DOCS,
            )
        self._counters = Counters()
        self._lock = threading.Lock()
        self._prefetch = _Window()
        self._backup = _Window()
        self._state: _Attached | None = None
        #: The extra host pools of a hybrid model, by SGLang's pool name (v2 interface).
        self._extra: dict[str, ExtraPool] = {}
        self._warned: set[str] = set()

    # --- set-up ---------------------------------------------------------------------------

    @staticmethod
    def _check_parallelism(config: HiCacheStorageConfig) -> None:
        if getattr(config, "should_split_heads", False):
            raise UnsupportedCombinationError(
                "SGLang asks storage to split heads across heterogeneous TP sizes "
                "(tp_lcm_size); kvtier keys whole pages per rank",
                value="tp_lcm_size",
                supported=[
                    "the same --tp-size on every instance sharing the store "
                    "(remove tp_lcm_size from the extra-config)"
                ],
            )
        if getattr(config, "dcp_size", 1) != 1:
            raise UnsupportedCombinationError(
                "SGLang decode context parallelism (DCP) splits each page across ranks; "
                "kvtier stores whole pages",
                value=config.dcp_size,
                supported=["decode context parallel size 1"],
            )

    def _engine_config(self, **plan: Any) -> EngineConfig:
        """kvtier's engine config for this SGLang rank; ``plan`` adds layout and geometry."""
        config = self.storage_config
        return load_engine_config(
            {
                "backend": self.settings.backend,
                "extra_config": self.settings.extra_config,
                "attention": self.attention.value,
                "model": self._model_id,
                "tenant": self.settings.tenant,
                "verify": self.settings.verify,
                "tp_rank": int(config.tp_rank),
                "tp_size": int(config.tp_size),
                **plan,
            },
            source=_LABEL,
        )

    def _model_id_for(self, config: HiCacheStorageConfig) -> str:
        """The model's part of the namespace: the declared ``kvtier.model``, else SGLang's
        model name with a digest of its weight files where it names a local path."""
        parts = [self.settings.model or config.model_name or "default"]
        weights = None if self.settings.model else weights_digest(config.model_name or "")
        if weights is not None:
            parts[0] = f"{parts[0]}#{weights}"
        if getattr(config, "pp_size", 1) > 1:
            parts.append(f"pp{config.pp_rank}of{config.pp_size}")
        if getattr(config, "attn_cp_size", 1) > 1:
            parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
        return "|".join(parts)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check SGLang's host pool against the backend, then build the backend over it."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        if getattr(pool, "kv_buffer", None) is None:
            raise unsupported_pool(pool, "it has no kv_buffer (a logical-only anchor pool)")
        if getattr(pool, "dcp_size", 1) != 1:
            raise unsupported_pool(pool, "its pages are split by decode context parallelism")
        layout = pool_layout(pool, self.attention)
        fields = pool_geometry_fields(pool, self.attention, self.settings.dtype)
        plan = resolve(
            self._engine_config(layout=layout.value, **fields),
            self._registry.backends,
            self._registry.io_backends,
            options_at=_OPTIONS_AT,
        )
        pages = SGLangPages(pool, plan.layout, plan.geometry)
        pages.extents(0)  # the pool's memory matches the geometry: checked now, not later
        store = open_page_store(plan, pages, checksum_workers=self.settings.checksum_workers)
        with self._lock:
            old, self._state = self._state, _Attached(pages, store, plan)
        if old is not None:
            old.close()
        log.info(
            "kvtier: SGLang HiCache storage on backend %r, layout %s, %s, namespace %s, "
            "%s, zero-copy %s",
            self.spec.name,
            plan.layout.value,
            plan.geometry.describe(),
            plan.context.namespace,
            "writer" if self.is_writer else "reader (another rank writes)",
            "on" if self.zero_copy else "off",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Accept the KV pool again under its v2 name; build an extra pool's own store.

        A hybrid model's extra pool (Mamba state, SWA KV) gets a plan of its own through
        ``resolve()`` and ``open_page_store()``: its namespace names the pool, its geometry
        describes its pages, and its pages carry the same verified envelope.
        """
        name = str(host_pool_name)
        state = self._state
        same_pool = state is not None and host_pool is state.pages.host_pool
        if name == "kv" or same_pool:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        if state is None or state.closed:
            raise StorageError(
                f"SGLang registered the extra host pool {name!r} before the KV pool: "
                "register_mem_pool_host(kv_pool) comes first (SGLang's controller does so)",
                value=name,
            )
        extra = self._extra_pool(name, host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        with self._lock:
            old, self._extra[name] = self._extra.get(name), extra
        if old is not None:
            old.close()
        log.info(
            "kvtier: SGLang extra host pool %r (%s) on backend %r, %s, %s, namespace %s",
            name,
            type(host_pool).__name__,
            self.spec.name,
            "in place" if extra.in_place else "by value (copied through SGLang's page calls)",
            extra.plan.geometry.describe(),
            extra.plan.context.namespace,
        )

    def _extra_pool(self, name: str, pool: Any) -> ExtraPool:
        """Check an extra host pool and build its page store (the KV pool's path)."""
        per_rank = is_per_rank(name, self.attention)
        model = f"{self._model_id}|pool={name}"
        tp_size = int(self.storage_config.tp_size)
        if per_rank and self.attention is AttentionKind.MLA and tp_size > 1:
            model += f"|tp{int(self.storage_config.tp_rank)}of{tp_size}"
        pages: SGLangPages | SlotPages | StatePages
        if is_kv_shaped(pool):
            layout = pool_layout(pool, self.attention)
            fields = pool_geometry_fields(pool, self.attention, self.settings.dtype)
            plan = resolve(
                self._engine_config(layout=layout.value, model=model, **fields),
                self._registry.backends,
                self._registry.io_backends,
                options_at=_OPTIONS_AT,
            )
            pages = SGLangPages(pool, plan.layout, plan.geometry)
            pages.extents(0)
        else:
            missing = [
                attr
                for attr in (
                    "page_size",
                    "get_data_page",
                    "get_dummy_flat_data_page",
                    "set_from_flat_data_page",
                )
                if not hasattr(pool, attr)
            ]
            if missing:
                raise UnsupportedCombinationError(
                    f"SGLang registered the extra host pool {name!r} "
                    f"({type(pool).__name__}), which has no {', '.join(missing)}; kvtier "
                    "stores extra pools that are KV-shaped (kv_buffer with heads, as SWA "
                    "pools) or that page their state (as MambaPoolHost)",
                    value=name,
                    supported=["a Mamba or SWA host pool of SGLang's HostKVCache shape"],
                )
            dummy = pool.get_dummy_flat_data_page()
            page_bytes = int(dummy.numel() * dummy.element_size())
            fields = state_geometry_fields(name, pool, page_bytes, self.attention)
            refusal = in_place_refusal(pool, page_bytes)
            if refusal is not None:
                # by value the bytes are SGLang's flat data page; a namespace of their own
                # keeps them apart from pages served in place, whatever either's order
                model += "|by-value"
                self._counters.add("state_pools_by_value")
                log.warning(
                    "kvtier: SGLang state pool %r (%s) cannot be served in place (%s); its "
                    "pages are copied through SGLang's get_data_page / "
                    "set_from_flat_data_page (counted as state_pages_copied)",
                    name,
                    type(pool).__name__,
                    refusal,
                )
            plan = resolve(
                self._engine_config(layout="page_first", model=model, **fields),
                self._registry.backends,
                self._registry.io_backends,
                options_at=_OPTIONS_AT,
            )
            pages = SlotPages(pool, page_bytes) if refusal is None else StatePages(pool, page_bytes)
        store = open_page_store(plan, pages, checksum_workers=self.settings.checksum_workers)
        return ExtraPool(name, pages, store, plan, writes=self.is_writer or per_rank)

    def _pool(self, name: Any) -> ExtraPool:
        found = self._extra.get(str(name))
        if found is None or found.closed:
            raise StorageError(
                f"SGLang asked for host pool {str(name)!r}, which was never registered "
                f"(registered: 'kv'{''.join(', ' + repr(n) for n in self._extra)}); "
                "SGLang registers each pool with register_mem_host_pool_v2 first",
                value=str(name),
            )
        return found

    def _require(self) -> _Attached:
        state = self._state
        if state is None or state.closed:
            raise StorageError(
                "kvtier SGLang storage has no host pool: SGLang calls "
                "register_mem_pool_host(pool) right after construction; call it before any "
                "transfer (and do not use the object after close())",
                value=None,
            )
        return state

    def _keys(self, state: _Attached, keys: Sequence[str]) -> list[str]:
        return [external_key(state.plan.namespace, key, state.plan.rank_suffix) for key in keys]

    # --- zero-copy (v1) path ----------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored (SGLang's prefix-hit query)."""
        state = self._require()
        return state.store.prefix_hits(self._keys(state, keys))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Fill the host pages at ``host_indices`` in place; False for a miss or a bad page."""
        state = self._require()
        names = self._keys(state, keys)
        pages = state.pages.pages_of(host_indices, len(names))
        if not names:
            return []
        start = time.perf_counter()
        results = state.store.get(names, pages)
        self._record(self._prefetch, state, sum(results), time.perf_counter() - start)
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices`` from their memory; True where stored."""
        state = self._require()
        names = self._keys(state, keys)
        pages = state.pages.pages_of(host_indices, len(names))
        if not names:
            return []
        if not self.is_writer:
            self._counters.add("skipped_not_writer", len(names))
            return [True] * len(names)
        start = time.perf_counter()
        results = state.store.put(names, pages)
        self._record(self._backup, state, sum(results), time.perf_counter() - start)
        return results

    def _record(self, window: _Window, state: _Attached, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        nbytes = pages * state.pages.geometry.bytes_per_page
        with self._lock:
            window.pages.append(pages)
            window.bandwidth.append(nbytes / max(seconds, 1e-9) / 1e9)

    # --- v2 (hybrid models: KV plus extra pools) ------------------------------------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The usable prefix: KV pages, cut where a needed pool's pages are missing.

        Each transfer's pool is checked over the KV hit by its hit policy (``all_pages``:
        every page; ``trailing_pages``: the last ``len(transfer.keys)``); a prefix length
        counts only when every pool allows it.
        """
        state = self._require()
        kv_pages = state.store.prefix_hits(self._keys(state, keys))
        hits: dict[Any, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if str(transfer.name) == "kv":
                continue
            pool = self._pool(transfer.name)
            wanted = keys[:kv_pages] if restorable else []
            present = pool.store.exists(pool.keys(wanted)) if wanted else []
            policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
            allowed, boundary = restorable_prefixes(present, str(policy), len(transfer.keys or []))
            if boundary:
                hits[transfer.name] = boundary
            restorable &= allowed
        lengths = sorted(restorable)
        return PoolTransferResult(lengths[-1] if lengths else 0, hits, lengths)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Fill each transfer's host pages; a missing or invalid page ends its pool's run."""
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if str(transfer.name) == "kv":
                got = self.batch_get_v1(keys, transfer.host_indices, extra_info)
                results[transfer.name] = leading_run(got)
                continue
            pool = self._pool(transfer.name)
            indices = self._v2_indices(pool, transfer, len(keys))
            if indices is None:
                results[transfer.name] = [False] * len(keys)
                continue
            moved = self._pool_io(pool, "get", keys, indices, transfer.host_indices)
            results[transfer.name] = leading_run(moved)
        return results

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's host pages under its pool's keys; True where stored."""
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if str(transfer.name) == "kv":
                results[transfer.name] = self.batch_set_v1(keys, transfer.host_indices, extra_info)
                continue
            pool = self._pool(transfer.name)
            indices = self._v2_indices(pool, transfer, len(keys))
            if indices is None:
                results[transfer.name] = [False] * len(keys)
            elif not pool.writes:
                self._counters.add("skipped_not_writer", len(keys))
                results[transfer.name] = [True] * len(keys)
            else:
                moved = self._pool_io(pool, "put", keys, indices, transfer.host_indices)
                results[transfer.name] = moved
        return results

    def _v2_indices(self, pool: ExtraPool, transfer: Any, count: int) -> list[int] | None:
        """The first host index of each page, or None (counted, one WARNING) on a mismatch."""
        page_size = pool.pages.page_size
        indices = transfer.host_indices
        got = 0 if indices is None else int(torch.as_tensor(indices).numel())
        if got != count * page_size:
            self._counters.add("v2_index_mismatch")
            if "v2_index_mismatch" not in self._warned:
                self._warned.add("v2_index_mismatch")
                log.warning(
                    "kvtier: SGLang passed %d host indices for %d %r pages of page_size %d; "
                    "those pages are reported not moved (SGLang's v2 contract; counted as "
                    "v2_index_mismatch)",
                    got,
                    count,
                    pool.name,
                    page_size,
                )
            return None
        flat = torch.as_tensor(indices).reshape(-1).to(device="cpu", dtype=torch.int64)
        return [int(i) for i in flat[::page_size].tolist()] if count else []

    def _pool_io(
        self, pool: ExtraPool, op: str, keys: list[str], firsts: list[int], indices: Any
    ) -> list[bool]:
        """Move an extra pool's pages: in place for KV-shaped pools, by value for state."""
        if not keys:
            return []
        names = pool.keys(keys)
        pages = pool.pages
        if not isinstance(pages, StatePages):
            ids = pages.pages_of(indices, len(keys))
            return pool.store.get(names, ids) if op == "get" else pool.store.put(names, ids)
        host = pages.host_pool
        if op == "put":
            tensors = [
                host.get_data_page(first, flat=True).contiguous().view(torch.uint8)
                for first in firsts
            ]
        else:
            tensors = [host.get_dummy_flat_data_page().view(torch.uint8) for _ in firsts]
        ids = pages.add(tensors)
        try:
            if op == "put":
                results = pool.store.put(names, ids)
            else:
                results = leading_run(pool.store.get(names, ids))
        finally:
            pages.drop(ids)
        if op == "get":
            for first, tensor, ok in zip(firsts, tensors, results, strict=True):
                if ok:
                    host.set_from_flat_data_page(first, tensor)
        self._counters.add("state_pages_copied", len(keys) if op == "put" else sum(results))
        return results

    # --- legacy (generic) path --------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether one key is stored."""
        state = self._require()
        return state.store.exists(self._keys(state, [key]))[0]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Read one page into ``target_location`` (a flat page tensor); None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read pages into the given flat page tensors; None for a miss or a bad page."""
        state = self._require()
        names = self._keys(state, keys)
        if target_locations is None or len(target_locations) != len(names):
            raise TransferError(
                "kvtier's legacy get reads into the caller's tensors: pass one flat page "
                "tensor per key (SGLang passes host_pool.get_dummy_flat_data_page())",
                value=None if target_locations is None else len(target_locations),
            )
        tensors = [self._flat_page(state, t, writable=True) for t in target_locations]
        results = self._generic(state, "get", names, tensors)
        return [t if ok else None for t, ok in zip(target_locations, results, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one flat page tensor."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors; True only if every page was stored."""
        state = self._require()
        names = self._keys(state, keys)
        if values is None or len(values) != len(names):
            raise TransferError(
                "kvtier's legacy set stores the given tensors: pass one flat page tensor "
                "per key (SGLang passes host_pool.get_data_page(index))",
                value=None if values is None else len(values),
            )
        if not self.is_writer:
            self._counters.add("skipped_not_writer", len(names))
            return True
        tensors = [self._flat_page(state, v, writable=False) for v in values]
        return all(self._generic(state, "put", names, tensors))

    def _flat_page(self, state: _Attached, tensor: Any, *, writable: bool) -> torch.Tensor:
        expected = state.pages.geometry.bytes_per_page
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise TransferError(
                f"expected a CPU tensor holding one page, got {type(tensor).__name__}",
                value=type(tensor).__name__,
            )
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != expected:
            raise TransferError(
                f"a page tensor of {nbytes} bytes cannot hold a page of "
                f"{state.pages.geometry.describe()}; it takes {expected} bytes",
                value=nbytes,
            )
        if tensor.is_contiguous():
            return tensor
        if writable:
            raise TransferError(
                "legacy get fills the target tensor in place, so it must be contiguous",
                value=tuple(tensor.stride()),
            )
        return tensor.contiguous()

    def _generic(
        self, state: _Attached, op: str, names: list[str], tensors: list[torch.Tensor]
    ) -> list[bool]:
        self._counters.add("generic_path_pages", len(names))
        ids = state.pages.add_scratch(tensors)
        try:
            return state.store.get(names, ids) if op == "get" else state.store.put(names, ids)
        finally:
            state.pages.drop_scratch(ids)

    # --- housekeeping -----------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this model's (and, for MHA, this rank's) pages; MLA: the writer only."""
        state = self._state
        if state is None or state.closed:
            return
        stores = [("kv", state.store)] if self.is_writer else []
        stores += [(p.name, p.store) for p in self._extra.values() if p.writes and not p.closed]
        if not self.is_writer:
            log.info("kvtier: clear() left to the storage writer rank (MLA pages are shared)")
        for name, store in stores:
            try:
                store.backend.clear()
            except Exception as exc:
                self._counters.add("clear_failures")
                log.warning(
                    "kvtier: backend %r failed to clear pool %r: %r", self.spec.name, name, exc
                )

    def get_stats(self) -> Any:
        """Pages and GB/s per transfer since the last call, as SGLang's StorageMetrics."""
        metrics = _storage_metrics()
        with self._lock:
            metrics.prefetch_pgs.extend(self._prefetch.pages)
            metrics.prefetch_bandwidth.extend(self._prefetch.bandwidth)
            metrics.backup_pgs.extend(self._backup.pages)
            metrics.backup_bandwidth.extend(self._backup.bandwidth)
            self._prefetch, self._backup = _Window(), _Window()
        return metrics

    def kvtier_stats(self) -> dict[str, int | float]:
        """kvtier's counters: the page store's, the backend's (``backend_*``) and ours.

        An extra pool's counters carry its name: ``mamba_invalid``, ``mamba_backend_puts``.
        """
        stats: dict[str, int | float] = {
            "generic_path_pages": 0,
            "skipped_not_writer": 0,
            "metrics_fallback": int(_storage_metrics_class() is _StorageMetricsShape),
        }
        stats.update(self._counters.snapshot())
        state = self._state
        if state is not None:
            stats.update(state.store.stats())
            stats.update({f"backend_{k}": v for k, v in state.store.backend.stats().items()})
        for pool in list(self._extra.values()):
            stats.update({f"{pool.name}_{k}": v for k, v in pool.store.stats().items()})
            backend = pool.store.backend.stats()
            stats.update({f"{pool.name}_backend_{k}": v for k, v in backend.items()})
        return stats

    def close(self) -> None:
        """Stop the checksum threads and close the backend. Idempotent."""
        with self._lock:
            state = self._state
            extra = list(self._extra.values())
        for pool in extra:
            pool.close()
        if state is not None:
            state.close()


@dataclass
class _StorageMetricsShape:
    """SGLang's StorageMetrics fields, for SGLang builds whose metrics module is absent."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


@functools.lru_cache(maxsize=1)
def _storage_metrics_class() -> Any:
    """SGLang's StorageMetrics, or the same fields in our class (one WARNING) without it."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception as exc:  # SGLang without its serving stack: same fields, our class
        log.warning(
            "kvtier: SGLang's metrics module (sglang.srt.observability.metrics_collector) "
            "failed to import (%r), so get_stats() returns kvtier's class with the same "
            "fields; SGLang's StorageMetricsCollector would refuse it. A full SGLang "
            "install has the module (%s)",
            exc,
            _DOCS,
        )
        return _StorageMetricsShape
    return StorageMetrics


def _storage_metrics() -> Any:
    """A fresh SGLang StorageMetrics (its collector asserts that exact class)."""
    return _storage_metrics_class()()
