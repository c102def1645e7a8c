"""The ``kvtier`` section of vLLM's ``kv_connector_extra_config``, read and validated.

Nothing here imports vLLM: the section is parsed with kvtier's one extra-config parser
(an object, JSON text or ``@file``) and validated with kvtier's pydantic path, so a typo
fails with kvtier's own error (line and column, unknown key with "did you mean").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from kvtier.core.config import ChecksumWorkers, ModelId, TenantLimits, TierChain
from kvtier.core.errors import InvalidFieldError, MissingFieldError
from kvtier.core.validation import validate_model
from kvtier.integrations.section import (
    OPTIONS_AT,
    SECTION,
    EngineSection,
    backend_of_tiers,
    find_section,
)

__all__ = ["DOCS", "LABEL", "OPTIONS_AT", "SECTION", "VLLMSection", "read_section", "tenant_of"]

LABEL = "kv_connector_extra_config 'kvtier' section"
DOCS = "docs/vllm.md"


class VLLMSection(EngineSection):
    """The ``kvtier`` section of vLLM's ``--kv-transfer-config`` extra config."""

    tenant: str | None = Field(
        None,
        description="Tenant salt for the key namespace; a request's cache_salt is added to it.",
    )
    model: ModelId | None = Field(
        None,
        description="Model id for the key namespace, declared by the operator: it replaces "
        "vLLM's model name, revision and weight-file digest (see docs/vllm.md, keys).",
    )
    checksum_workers: ChecksumWorkers = Field(
        1,
        description="Threads that checksum the pages of one batch (the engine's cores run "
        "the model, so one by default).",
    )
    io_backend: str = Field(
        "auto",
        description="Accelerator KV caches only: the kvtier IO backend between vLLM's "
        "blocks and the host pool ('direct', 'kernel', a plugin's, or 'auto').",
    )
    host_pages: int | None = Field(
        None,
        strict=True,
        ge=1,
        description="Accelerator KV caches only: host-pool (L2) size in pages; default: "
        "kvtier's (1 GiB).",
    )
    operations: tuple[Literal["load_layer", "load_all", "backup_layer", "backup_all"], ...] = Field(
        ("load_layer", "backup_layer"),
        min_length=1,
        description="Accelerator KV caches only: the transfers to run. 'load_layer' / "
        "'backup_layer' move one layer per vLLM call, overlapping compute; without "
        "them all layers move at the first layer's load and at the step's end.",
    )
    device_loads: Literal["auto", "layerwise", "async"] = Field(
        "auto",
        description="Accelerator KV caches only: when pages load. 'layerwise': inside the "
        "step, every layer's copy queued at the first layer and each layer waited for just "
        "before it runs, so copies overlap compute. 'async': between steps (vLLM's "
        "load_async); the request waits until its pages are on the device, so the forward "
        "never waits for storage, and a failed load is recomputed. 'auto': layerwise for one "
        "KV cache group, async for hybrid models (vLLM takes their failed loads only from "
        "asynchronous loads, so 'layerwise' is refused there).",
    )
    known_keys: int = Field(
        1 << 18,
        strict=True,
        ge=0,
        description="Stored pages the scheduler remembers from the workers' reports, so "
        "that a page stored in this process is a hit before the backend's own index sees it.",
    )
    lookup_wait_s: float = Field(
        0.002,
        ge=0,
        le=1,
        description="How long the scheduler waits for a lookup's `exists` before answering "
        "vLLM 'ask again' (the request waits a step; the scheduler thread does not).",
    )
    lookup_timeout_s: float = Field(
        2.0,
        gt=0,
        description="A lookup still unanswered after this long is a miss: the request is "
        "computed without kvtier's pages (counted as lookup_timeouts).",
    )
    handoff_timeout_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="How long, from its first lookup, a request handed off by a producer "
        "engine (`kv_transfer_params` `kvtier_pages`) waits for the pages the producer "
        "announced while its stores land; past it what is found is loaded and the rest "
        "recomputed (counted as handoff_timeouts); 0: never waits.",
    )
    max_save_pages: int = Field(
        2048,
        strict=True,
        ge=1,
        description="Pages a worker queues for storage at most; a save beyond it is dropped "
        "(counted as save_dropped_pages), so a finished request's blocks are never held "
        "behind a slow backend.",
    )
    preempt_wait_s: float = Field(
        5.0,
        ge=0,
        description="How long a preemption waits for a store of the request in flight "
        "before vLLM reuses its blocks; past it the store is dropped (deleted once the call "
        "returns, never reported stored).",
    )
    staging_pages: int = Field(
        256,
        strict=True,
        ge=0,
        description="Hybrid models: pages of sliding-window groups copied aside at the end "
        "of their step, since vLLM frees such blocks while the request runs; beyond it a "
        "save is dropped.",
    )
    storage_nice: int = Field(
        0,
        strict=True,
        ge=0,
        le=19,
        description="vLLM's CPU engine: how much lower than the engine's the CPU priority "
        "(nice) of a worker's storage threads is (its loads and stores, and the backend "
        "threads they start), so they take the cores the model leaves idle rather than "
        "slow its steps; loads then wait longer too (docs/vllm.md, storage threads); 0: "
        "the same priority.",
    )
    tiers: TierChain = Field(
        description="A chain of storage tiers, fastest first (docs/tiers.md), instead of "
        "`backend` and `extra_config` (`backend` then reads as the first tier's); each "
        "worker stores into the first, cascades down and promotes hits up.",
    )
    tenants: TenantLimits = Field(
        description="Per-tenant `quota_bytes` in each tier. A request's tenant is its "
        "`cache_salt` where that names one of these, else `tenant` for a request without a "
        "salt (docs/vllm.md, tiers and tenants).",
    )
    events_buffer: int = Field(
        65536,
        strict=True,
        ge=0,
        description="Storage-tier events (stored, promoted, evicted, removed) a worker keeps "
        "for the scheduler between two steps, which vLLM's KV events and the scheduler's "
        "memory of stored pages are made from; beyond it the oldest are dropped (counted as "
        "tier_events_dropped); 0: none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _backend_of_tiers(cls, data: Any) -> Any:
        return backend_of_tiers(data)

    def async_device_loads(self, groups: int) -> bool:
        """Whether the accelerator path loads between steps, for a model of ``groups``
        KV cache groups (``device_loads``); 'layerwise' with several groups is refused."""
        if self.device_loads == "layerwise" and groups > 1:
            raise InvalidFieldError(
                f"{SECTION}.device_loads",
                f"'layerwise' loads a model of {groups} KV cache groups inside the step, where "
                "vLLM cannot be told that a load failed (it would compute over the block's old "
                "contents); use 'async' or 'auto'",
                value=self.device_loads,
            )
        return self.device_loads == "async" or (self.device_loads == "auto" and groups > 1)


def read_section(extra: Mapping[str, Any] | None, backends: Mapping[str, Any]) -> VLLMSection:
    """The validated ``kvtier`` section of ``kv_connector_extra_config``; a clear error if not.

    ``backends`` (the registry's) are named when the backend is missing.
    """
    section = find_section(
        extra,
        where="kv_connector_extra_config",
        label=LABEL,
        example='{"backend": "file", "extra_config": {"root": "/mnt/kv"}}',
        docs=DOCS,
    )
    if "backend" not in section and not section.get("tiers"):
        names = ", ".join(repr(name) for name in sorted(backends))
        raise MissingFieldError(
            f"{SECTION}.backend",
            hint=f"; name the kvtier storage backend, one of {names}, or give `tiers` "
            f"instead (see {DOCS})",
        )
    return validate_model(VLLMSection, section, where=SECTION, label=LABEL)


def tenant_of(configured: str | None, cache_salt: str | None) -> str | None:
    """The namespace tenant for a request: the section's tenant and the request's salt.

    Both are kept, unambiguously encoded, so two salts (or two configured tenants) never
    name the same pages.
    """
    if cache_salt is None:
        return configured
    return json.dumps([configured, cache_salt], ensure_ascii=True, separators=(",", ":"))
