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

import ctypes
import functools
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtier.core.capabilities import ResolvedPlan, check_backend, open_page_store, resolve
from kvtier.core.config import (
    EngineConfig,
    load_engine_config,
    parse_extra_config,
    validate_model,
)
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import (
    InvalidFieldError,
    MissingFieldError,
    NotAnObjectError,
    PageError,
    StorageError,
    TransferError,
    UnsupportedCombinationError,
    did_you_mean,
)
from kvtier.core.extents import Extent
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_from_name, dtype_name
from kvtier.core.host_pool import aligned_empty
from kvtier.core.keys import external_key
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import Counters
from kvtier.plugins.manager import default_registry

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
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

#: The key of kvtier's own section in SGLang's storage extra-config.
SECTION = "kvtier"
_LABEL = "extra-config 'kvtier' section"
#: Where the backend's options sit in SGLang's extra-config, as errors name them.
_OPTIONS_AT = f"{SECTION}.extra_config"
_DOCS = "docs/sglang.md"


class SGLangSection(BaseModel):
    """The ``kvtier`` section of SGLang's ``--hicache-storage-backend-extra-config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        description="kvtier storage backend: 'file', 'uring', 'memory', 'mooncake' or a "
        "plugin's (`kvtier backends` lists them)."
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own options: a JSON object, a JSON object string, or "
        "'@file.json' / '@file.toml'.",
    )
    verify: Literal["full", "header"] = Field(
        "full",
        description="Page verification on load: 'full' checksums the payload, 'header' "
        "checks the envelope header only.",
    )
    tenant: str | None = Field(
        None, description="Tenant salt for the key namespace, so tenants never share pages."
    )
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

    @field_validator("extra_config", mode="before")
    @classmethod
    def _parse_extra(cls, value: Any) -> dict[str, Any]:
        return parse_extra_config(value, source="kvtier.extra_config")

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty backend name (`kvtier backends` lists them)")
        return value.strip()

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return dtype_name(dtype_from_name(value.strip()))
        except InvalidFieldError as exc:
            raise ValueError(str(exc).removeprefix("dtype: ")) from None


# --- the host pool, seen as kvtier pages ---------------------------------------------------


def _extent_at(address: int, length: int) -> Extent:
    """A writable extent over ``length`` bytes of process memory at ``address``."""
    view = memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
    return Extent(view, address, length)


def _runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """``(address, bytes)`` of the contiguous runs of a strided view, in C order."""
    shape, stride = list(view.shape), list(view.stride())
    k, block = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == block):
        block *= shape[k - 1]
        k -= 1
    item = view.element_size()
    base = view.data_ptr()
    return [
        (base + item * sum(i * s for i, s in zip(index, stride[:k], strict=True)), block * item)
        for index in itertools.product(*(range(n) for n in shape[:k]))
    ]


def _unsupported_pool(pool: Any, what: str) -> UnsupportedCombinationError:
    return UnsupportedCombinationError(
        f"SGLang host pool {type(pool).__name__}: {what}; kvtier stores the KV pages of "
        "materialized MHA/MLA host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost)",
        value=type(pool).__name__,
        supported=[
            f"--hicache-mem-layout {layout.value} with a plain MHA/GQA or MLA model"
            for layout in Layout
        ],
    )


def pool_layout(pool: Any, attention: AttentionKind) -> Layout:
    """The kvtier layout of an SGLang host pool, or an error listing the ones that work."""
    name = getattr(pool, "layout", None)
    allowed = layouts_for(attention)
    try:
        layout = Layout(name)
    except ValueError:
        layout = None
    if layout is None or layout not in allowed:
        raise UnsupportedCombinationError(
            f"SGLang host-pool layout {name!r} has no kvtier equivalent for "
            f"{attention.value.upper()}",
            value=name,
            supported=[f"--hicache-mem-layout {item.value}" for item in allowed],
        )
    return layout


def _pool_dtype(pool: Any, override: str | None) -> torch.dtype:
    stored = pool.dtype
    try:
        native: torch.dtype | None = dtype_from_name(stored)
    except InvalidFieldError:
        native = None
    if override is None:
        if native is None:
            raise InvalidFieldError(
                "kvtier.dtype",
                f"SGLang's host pool stores KV as {stored}, which names no KV dtype; set "
                '"dtype" in the kvtier section to the KV cache dtype (for fp8 KV: '
                '"float8_e4m3fn" or "float8_e5m2")',
                value=str(stored),
            )
        return native
    wanted = dtype_from_name(override)
    if native is not None and native != wanted:
        raise InvalidFieldError(
            "kvtier.dtype",
            f"is {override!r} but SGLang's host pool holds {dtype_name(native)}; "
            "leave dtype out (it is only for pools that store raw bytes)",
            value=override,
        )
    itemsize = torch.empty((), dtype=stored).element_size()
    if torch.empty((), dtype=wanted).element_size() != itemsize:
        raise InvalidFieldError(
            "kvtier.dtype",
            f"{override!r} is not {itemsize} byte(s) per element like the pool's {stored}",
            value=override,
        )
    return wanted


def pool_geometry_fields(
    pool: Any, attention: AttentionKind, dtype_override: str | None = None
) -> dict[str, Any]:
    """The engine-config geometry fields of an SGLang MHA or MLA host pool (this rank's share).

    MLA: kvtier's geometry keeps only the latent's width (``kv_cache_dim``, which SGLang
    may override, e.g. for fp8 NSA); it is split as SGLang splits it when the pool says
    so, and any split names the same pages.
    """
    try:
        dtype = dtype_name(_pool_dtype(pool, dtype_override))
        fields: dict[str, Any] = {
            "dtype": dtype,
            "num_layers": int(pool.layer_num),
            "page_size": int(pool.page_size),
        }
        if attention is AttentionKind.MLA:
            rope = int(getattr(pool, "qk_rope_head_dim", 0) or 0)
            dim = int(getattr(pool, "kv_cache_dim", None) or (int(pool.kv_lora_rank) + rope))
            if not 0 < rope < dim:
                rope = dim // 2
            return {**fields, "kv_lora_rank": dim - rope, "qk_rope_head_dim": rope}
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
    except AttributeError as exc:
        raise _unsupported_pool(pool, f"it has no attribute {exc.name!r}") from None
    v_head_dim = int(getattr(pool, "v_head_dim", head_dim))
    if v_head_dim != head_dim:
        raise _unsupported_pool(pool, f"K and V head sizes differ ({head_dim} and {v_head_dim})")
    return {**fields, "num_kv_heads": heads, "head_dim": head_dim}


class SGLangPages:
    """kvtier's page view of an SGLang host pool: envelope slots here, payload in place.

    Page ``p`` is host tokens ``[p * page_size, (p + 1) * page_size)``. Its payload extents
    are the contiguous runs of SGLang's ``get_data_page(p * page_size, flat=False)`` view
    inside ``kv_buffer`` (the same bytes, in the same order, as SGLang's flat data page),
    checked to lie inside that buffer and cached, since the pool never moves. Ids from
    ``num_pages`` up are scratch pages: caller tensors of the legacy API.
    """

    def __init__(self, pool: Any, layout: Layout, geometry: KVGeometry) -> None:
        self.host_pool = pool
        self.geometry = geometry
        self._layout = layout
        self.page_size = int(pool.page_size)
        self.num_pages = int(pool.size) // self.page_size
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise _unsupported_pool(pool, "its kv_buffer is not a CPU tensor")
        storage = buffer.untyped_storage()
        self._low = storage.data_ptr()
        self._high = self._low + storage.nbytes()
        #: One ENVELOPE_BYTES slot per host page; untouched slots cost no memory.
        self._headers = aligned_empty(self.num_pages * ENVELOPE_BYTES)[1]
        self._header_cache: dict[int, Extent] = {}
        self._extent_cache: dict[int, tuple[Extent, ...]] = {}
        self._scratch: dict[int, tuple[Extent, ...]] = {}
        self._scratch_keep: dict[int, torch.Tensor] = {}
        self._scratch_ids = itertools.count(self.num_pages)
        self._lock = threading.Lock()

    @property
    def layout(self) -> Layout:
        return self._layout

    def memory_regions(self) -> list[Extent]:
        """SGLang's whole ``kv_buffer`` and the envelope slab: registered once by backends
        that need registered memory (Mooncake), so every page moves zero-copy."""
        return [
            _extent_at(self._low, self._high - self._low),
            _extent_at(self._headers.data_ptr(), self._headers.numel()),
        ]

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageError(
                f"host page {page} is out of range: the SGLang host pool has pages "
                f"0..{self.num_pages - 1}",
                value=page,
            )

    def extents(self, page: int) -> list[Extent]:
        """The page's payload regions inside SGLang's kv_buffer, in flat-data-page order."""
        scratch = self._scratch.get(page)
        if scratch is not None:
            return list(scratch[1:])
        cached = self._extent_cache.get(page)
        if cached is None:
            self._check_page(page)
            view = self.host_pool.get_data_page(page * self.page_size, flat=False)
            runs = _runs(view)
            total = sum(length for _, length in runs)
            outside = [a for a, n in runs if a < self._low or a + n > self._high]
            if outside or total != self.geometry.bytes_per_page:
                raise TransferError(
                    f"SGLang host page {page} is {total} bytes in {len(runs)} runs"
                    f"{' partly outside kv_buffer' if outside else ''}; the pool's geometry "
                    f"({self.geometry.describe()}) says {self.geometry.bytes_per_page}: "
                    "this host pool is not one kvtier understands",
                    value=page,
                )
            cached = tuple(_extent_at(address, length) for address, length in runs)
            self._extent_cache[page] = cached
        return list(cached)

    def header_extent(self, page: int) -> Extent:
        """The page's 4096-aligned envelope slot."""
        scratch = self._scratch.get(page)
        if scratch is not None:
            return scratch[0]
        cached = self._header_cache.get(page)
        if cached is None:
            self._check_page(page)
            start = self._headers.data_ptr() + page * ENVELOPE_BYTES
            cached = self._header_cache[page] = _extent_at(start, ENVELOPE_BYTES)
        return cached

    def page_buffers(self, page: int) -> list[Extent]:
        """``[header_extent(page), *extents(page)]``: what the backend stores."""
        return [self.header_extent(page), *self.extents(page)]

    def pages_of(self, host_indices: Any, count: int) -> list[int]:
        """Host page ids of ``count`` pages from SGLang's token indices (page_size per key)."""
        ps = self.page_size
        idx = torch.as_tensor(host_indices).reshape(-1)
        if idx.numel() != count * ps:
            raise PageError(
                f"got {idx.numel()} host indices for {count} keys; SGLang passes "
                f"page_size ({ps}) token indices per key",
                value=idx.numel(),
            )
        if count == 0:
            return []
        rows = idx.to(device="cpu", dtype=torch.int64).reshape(count, ps)
        first = rows[:, 0]
        bad = (first % ps != 0) | (first < 0) | (first + ps > self.num_pages * ps)
        if ps > 1:
            bad |= (rows - first[:, None] != torch.arange(ps)).any(dim=1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise PageError(
                f"host indices of key {row} ({rows[row, :4].tolist()}...) are not one whole "
                f"page: page_size ({ps}) consecutive tokens starting at a multiple of "
                f"{ps} below {self.num_pages * ps}",
                value=rows[row].tolist(),
            )
        return (first // ps).tolist()

    def add_scratch(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """Register caller tensors (one flat page each) as scratch pages; returns their ids."""
        slab = aligned_empty(len(tensors) * ENVELOPE_BYTES)[1]
        ids = []
        with self._lock:
            for i, tensor in enumerate(tensors):
                page = next(self._scratch_ids)
                header = _extent_at(slab.data_ptr() + i * ENVELOPE_BYTES, ENVELOPE_BYTES)
                length = tensor.numel() * tensor.element_size()
                self._scratch[page] = (header, _extent_at(tensor.data_ptr(), length))
                self._scratch_keep[page] = slab
                ids.append(page)
        return ids

    def drop_scratch(self, ids: Sequence[int]) -> None:
        """Forget scratch pages once their call returned."""
        with self._lock:
            for page in ids:
                self._scratch.pop(page, None)
                self._scratch_keep.pop(page, None)


# --- the storage class SGLang loads --------------------------------------------------------


def _section(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``kvtier`` section, parsed; a clear error when it is missing or misspelt."""
    if extra is not None and not isinstance(extra, Mapping):
        raise NotAnObjectError(
            f"SGLang's storage extra-config must be a JSON object, got {type(extra).__name__}",
            value=extra,
        )
    if not extra or SECTION not in extra:
        present = [str(key) for key in (extra or {})]
        close = [key for key in present if did_you_mean(SECTION, [key])]
        found = f" (found {close[0]!r}: did you mean {SECTION!r}?)" if close else ""
        raise MissingFieldError(
            f"extra-config.{SECTION}",
            hint=f'{found}; kvtier reads its settings from a "{SECTION}" object, e.g. '
            f'"{SECTION}": {{"backend": "file"}} (see {_DOCS})',
        )
    return parse_extra_config(extra[SECTION], source=_LABEL)


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
        parts = [self.settings.model or config.model_name or "default"]
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
            raise _unsupported_pool(pool, "it has no kv_buffer (a logical-only anchor pool)")
        if getattr(pool, "dcp_size", 1) != 1:
            raise _unsupported_pool(pool, "its pages are split by decode context parallelism")
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
        """Accept the KV pool again under its v2 name; refuse sidecar pools clearly."""
        state = self._state
        same_pool = state is not None and host_pool is state.pages.host_pool
        if str(host_pool_name) == "kv" or same_pool:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise UnsupportedCombinationError(
            f"SGLang registered the extra host pool {str(host_pool_name)!r} "
            f"({type(host_pool).__name__}); kvtier's SGLang adapter stores the KV pool only, "
            "not Mamba, SWA or indexer sidecar pools",
            value=str(host_pool_name),
            supported=["a plain MHA/GQA or MLA model (KV pool only)"],
        )

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
        if not self.is_writer:
            log.info("kvtier: clear() left to the storage writer rank (MLA pages are shared)")
            return
        try:
            state.store.backend.clear()
        except Exception as exc:
            self._counters.add("clear_failures")
            log.warning("kvtier: backend %r failed to clear: %r", self.spec.name, exc)

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
        """kvtier's counters: the page store's, the backend's (``backend_*``) and ours."""
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
        return stats

    def close(self) -> None:
        """Stop the checksum threads and close the backend. Idempotent."""
        with self._lock:
            state = self._state
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
