"""How a TieredCache schedules its work: write and prefetch policies, workers and bounds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.core.validation import validate_model

__all__ = ["CacheOptions", "PrefetchPolicy", "WritePolicy", "cache_options"]

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]


class CacheOptions(BaseModel):
    """How a TieredCache schedules work: write and prefetch policies, workers, bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    write_policy: WritePolicy = Field(
        default="write_through",
        description="`write_through`: every backed-up page goes to storage; "
        "`write_through_selective`: a page goes to storage once hit `write_threshold` "
        "times; `write_back`: a page goes to storage when evicted from the host pool.",
    )
    write_threshold: int = Field(
        default=2, ge=1, description="Hits before write_through_selective writes a page to storage."
    )
    prefetch_policy: PrefetchPolicy = Field(
        default="best_effort",
        description="What `load` waits for: `best_effort` loads the pages ready now; "
        "`wait_complete` waits for the whole prefetch; `timeout` waits at most "
        "`timeout_base_s + timeout_per_page_s x pages read from storage`.",
    )
    timeout_base_s: float = Field(
        default=0.05, ge=0, description="Fixed part of the timeout budget."
    )
    timeout_per_page_s: float = Field(
        default=0.002, ge=0, description="Budget per page read from storage (timeout policy)."
    )
    io_workers: int = Field(default=2, ge=1, le=64, description="Threads reading from storage.")
    write_workers: int = Field(default=1, ge=1, le=64, description="Threads writing to storage.")
    queue_size: int = Field(
        default=256, ge=1, description="Bound of each work queue; a full queue fails the operation."
    )
    batch_pages: int = Field(default=32, ge=1, description="Pages per storage get/put call.")
    tier_queue_pages: int = Field(
        default=1024,
        ge=1,
        description="Pages the storage chain's queue holds waiting to cascade into lower "
        "tiers, be written back or promoted; beyond it pages are dropped (counted as the "
        "tier's `drops`), never waited for.",
    )
    alloc_wait_s: float = Field(
        default=0.5,
        ge=0,
        description="How long a backup waits for host pages held by in-flight work "
        "before it fails with host_exhausted.",
    )
    max_load_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="Upper bound on any wait inside load (wait_complete, or load(keys)); "
        "after it, load takes the pages that are ready, so a stuck backend cannot hang it.",
    )
    close_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Bound on close(): drain this long, then cancel; the backend's own "
        "close() then gets at most this long again.",
    )
    backend_call_timeout_s: float | None = Field(
        default=30.0,
        gt=0,
        description="Bound on each storage backend call (exists, get, put of one batch, "
        "stats at most 2 s). A call past it fails its operation like a backend error "
        "(counted as backend_timeout) and its thread is abandoned; None: unbounded, "
        "calls run in the worker's own thread.",
    )
    max_abandoned_calls: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Backend calls that may be stuck past their bound at once; beyond "
        "it every backend call fails at once (backend_refused) until one returns.",
    )


def cache_options(options: CacheOptions | Mapping[str, Any] | None) -> CacheOptions:
    """``options`` as validated CacheOptions (None: the defaults; a mapping is checked)."""
    if options is None:
        return CacheOptions()
    if isinstance(options, CacheOptions):
        return options
    return validate_model(CacheOptions, options, where="cache_options", label="cache options")
