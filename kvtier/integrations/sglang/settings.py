"""The ``kvtier`` section of SGLang's storage extra-config: its fields, and reading it.

One home for what an operator writes, so the docs table (generated from
:class:`SGLangSection`) and the errors of a bad section come from the same place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from kvtier.core.config import ChecksumWorkers, ModelId, TenantLimits, TierChain
from kvtier.core.errors import InvalidFieldError, MissingFieldError
from kvtier.core.geometry import dtype_from_name, dtype_name
from kvtier.core.validation import validate_model
from kvtier.integrations.section import (
    OPTIONS_AT,
    SECTION,
    EngineSection,
    backend_of_tiers,
    find_section,
)
from kvtier.plugins.registry import Registry

__all__ = ["DOCS", "LABEL", "OPTIONS_AT", "SECTION", "SGLangSection", "read_section"]

#: How parser errors name kvtier's section of SGLang's storage extra-config.
LABEL = "extra-config 'kvtier' section"
#: The page that documents the adapter, as errors and warnings point to it.
DOCS = "docs/sglang.md"
#: The endpoints SGLang's ZmqEventPublisher binds or connects (its own heuristic).
_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")


class SGLangSection(EngineSection):
    """The ``kvtier`` section of SGLang's ``--hicache-storage-backend-extra-config``."""

    model: ModelId | None = Field(
        None,
        description="Model id for the key namespace, declared by the operator: it replaces "
        "SGLang's model name and the weights' identity (quantization, dtypes, overrides and "
        "load format still count; see docs/sglang.md, what keys a page).",
    )
    dtype: str | None = Field(
        None,
        description="The KV dtype, only for host pools that store KV as raw bytes "
        "(fp8 KV kept as uint8): 'float8_e4m3fn' or 'float8_e5m2'.",
    )
    checksum_workers: ChecksumWorkers = Field(
        4,
        description="Threads that checksum the pages of one batch in parallel (a SGLang "
        "host has cores to spare, and prefetch latency is on the request's path).",
    )
    tiers: TierChain = Field(
        description="A chain of storage tiers behind SGLang's one storage backend, fastest "
        "first (docs/tiers.md), instead of `backend` and `extra_config` (`backend` then "
        "reads as the first tier's).",
    )
    tenants: TenantLimits = Field(
        description="Per-tenant `quota_bytes` in each tier. SGLang hands storage no tenant "
        "per request: every page of this server is `tenant`'s, so `tenant` must be one of "
        "these names.",
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="Publish the storage tiers' KV events (BlockStored / BlockRemoved, "
        "medium DISK or EXTERNAL) with SGLang's ZmqEventPublisher at this endpoint "
        "(`tcp://*:5558`; its port offset by the DP rank as SGLang's own), from TP rank 0; "
        "null: only `take_kv_events()`.",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="The publisher's ROUTER endpoint for replaying missed batches "
        "(SGLang's `replay_endpoint`).",
    )
    kv_events_topic: str = Field(
        "", description="The topic the KV events are published under (SGLang's `topic`)."
    )
    kv_events_buffer: int = Field(
        65536,
        strict=True,
        ge=0,
        description="KV events kept until taken (`take_kv_events()` or the publisher); "
        "beyond it the oldest are dropped, counted as kv_events_dropped; 0: no events.",
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

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not _ENDPOINT.fullmatch(value.strip()):
            raise ValueError(
                f"must be a ZeroMQ endpoint such as 'tcp://*:5558', 'ipc:///tmp/kv' or "
                f"'inproc://kv', got {value!r}"
            )
        return None if value is None else value.strip()

    @model_validator(mode="before")
    @classmethod
    def _backend_of_tiers(cls, data: Any) -> Any:
        """With ``tiers``, ``backend`` is the first tier's (and may not be given too)."""
        return backend_of_tiers(data)

    @model_validator(mode="after")
    def _cross_checks(self) -> SGLangSection:
        if self.tenants and self.tenant not in self.tenants:
            names = ", ".join(repr(name) for name in sorted(self.tenants))
            raise InvalidFieldError(
                "tenant",
                f"is {self.tenant!r}, but `tenants` names {names}: SGLang hands storage no "
                "tenant per request, so every page of this server is `tenant`'s and only "
                "its quota can apply; set `tenant` to one of them",
                value=self.tenant,
            )
        if self.kv_events_endpoint is not None and self.kv_events_buffer == 0:
            raise InvalidFieldError(
                "kv_events_buffer",
                "is 0 (no KV events), but kv_events_endpoint asks to publish them; "
                "leave kv_events_buffer at its default or drop the endpoint",
                value=0,
            )
        return self


def read_section(extra: Mapping[str, Any] | None, registry: Registry) -> SGLangSection:
    """The validated ``kvtier`` section of SGLang's extra-config.

    A missing or misspelt section, a missing backend (the error lists ``registry``'s
    backends), unknown keys and wrong types each raise kvtier's error naming the field;
    ``tiers`` and ``tenants`` are checked as the engine config checks them, as
    ``kvtier.tiers[i]...``.
    """
    section = find_section(
        extra,
        where="extra-config",
        label=LABEL,
        example='{"backend": "file"}',
        docs=DOCS,
    )
    if "backend" not in section and not section.get("tiers"):
        names = ", ".join(repr(name) for name in sorted(registry.backends))
        raise MissingFieldError(
            f"{SECTION}.backend",
            hint=f"; name the kvtier storage backend, one of {names}, or give `tiers` "
            f"instead (see {DOCS})",
        )
    return validate_model(SGLangSection, section, where=SECTION, label=LABEL)
