"""What an engine-adapter author needs: one resolved plan, and the one path from it to objects.

An adapter that drives its own pools (the SGLang and vLLM adapters do) resolves its
engine's settings once with :func:`resolve` (or :func:`check_backend` before the pools
exist), then builds from the plan: :func:`open_store` opens the plan's storage tiers
over the engine's page memory, each behind a :class:`PageStore` (envelopes, verification,
bounded backend calls, counters), with the chain in front (a :class:`Store`; a single
backend is a chain of one); :func:`open_lookup` opens them for ``exists`` only (a
scheduler, with no page memory); :func:`build_host_pool` and :func:`build_io_backend`
build the rest; ``TieredCache.open(plan, ...)`` takes the plan too. An adapter never
builds a backend another way, nor talks to one around its store.
"""

from __future__ import annotations

from kvtier.cache.metrics import identity_of, store_collector
from kvtier.core.bounded import Outcome
from kvtier.core.capabilities import (
    ForeignPageMemory,
    ResolvedPlan,
    build_backend,
    build_host_pool,
    build_io_backend,
    check_backend,
    resolve,
)
from kvtier.core.extents import Extent
from kvtier.core.extra_config import parse_extra_config
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer, external_key, layout_namespace, rank_suffix
from kvtier.core.metrics import COUNTERS, Cause, zeroed
from kvtier.core.pagestore import BatchResult, PageMemory, PageStore
from kvtier.core.store import ExistsLookup, Store
from kvtier.core.validation import validate_model
from kvtier.integrations.section import SECTION, EngineSection, find_section
from kvtier.storage import open_lookup, open_store

__all__ = [  # noqa: RUF022 - grouped by step, as the docstring says
    # resolve once
    "resolve",
    "check_backend",
    "ResolvedPlan",
    # build from the plan
    "open_store",
    "open_lookup",
    "build_host_pool",
    "build_io_backend",
    "build_backend",
    "Store",
    "ExistsLookup",
    "PageStore",
    "BatchResult",
    "Outcome",
    "PageMemory",
    "ForeignPageMemory",
    "HostPool",
    "Extent",
    # keys
    "Namespace",
    "PageKeyer",
    "external_key",
    "layout_namespace",
    "rank_suffix",
    # the engine's `kvtier` section and its parsing
    "SECTION",
    "EngineSection",
    "find_section",
    "parse_extra_config",
    "validate_model",
    # metrics: the one vocabulary, and a page store's Prometheus families
    "COUNTERS",
    "Cause",
    "zeroed",
    "identity_of",
    "store_collector",
]
