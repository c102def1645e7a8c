"""The storage chain an engine config describes: tiers, their policies, tenants' quotas.

A config names one storage backend (``backend`` + ``extra_config``: a chain of one) or a
list of ``tiers``, fastest first; each tier is a backend with its options, the eviction
policy its capacity goes through, the admission policy that decides which pages enter
it, how pages reach it (``write``: through, as soon as the tier above stored them, or
back, only when the tier above evicts them) and whether a hit in it is copied up into
the tiers above (``promote``). ``tenants`` gives per-tenant byte quotas. Everything here
is validated like any config (unknown keys refused, paths such as ``tiers[1].write``);
the policies' own options are checked against their plugins at resolution.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from kvtier.core.extra_config import parse_extra_config

__all__ = ["PolicyChoice", "TenantConfig", "TierConfig", "policy_choice"]

#: A policy as a config names it: its name, and its options beside (``{"policy": "frequency",
#: "min_hits": 2}``), or the name alone.
PolicyChoice = str | dict[str, Any]


def policy_choice(value: PolicyChoice | None) -> tuple[str, dict[str, Any]] | None:
    """``(name, options)`` of a policy choice (None when none is chosen)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value, {}
    options = dict(value)
    return str(options.pop("policy")), options


def _check_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not value.strip():
            raise ValueError("must name a policy (`kvtier backends` lists them)")
        return value.strip() if isinstance(value, str) else value
    if not isinstance(value, dict):
        raise ValueError(
            'must be a policy name or an object {"policy": NAME, ...its options}, '
            f"got {type(value).__name__}"
        )
    name = value.get("policy")
    if not isinstance(name, str) or not name.strip():
        raise ValueError('an object naming a policy needs "policy": NAME beside its options')
    return {**value, "policy": name.strip()}


class TierConfig(BaseModel):
    """One storage tier: a backend, its options, and its policies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(description="Storage backend name (`kvtier backends` lists them).")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own options: JSON object string, `@file.json`, "
        "`@file.toml` or a mapping.",
    )
    eviction: PolicyChoice | None = Field(
        default=None,
        description="The eviction policy the backend's capacity goes through (`lru`, a "
        "plugin's); default: the backend's own LRU.",
    )
    admission: PolicyChoice | None = Field(
        default=None,
        description="The admission policy of pages entering this tier from the one above "
        '(`{"policy": "frequency", "min_hits": 2}`); default: every page is admitted.',
    )
    write: Literal["through", "back"] = Field(
        default="through",
        description="How pages reach this tier: `through` as soon as the tier above "
        "stored them, `back` only when the tier above evicts them (every eviction the chain "
        "makes there hands the page down; the tier above needs a `capacity_bytes`). "
        "Ignored on the first tier.",
    )
    promote: bool = Field(
        default=True,
        description="Copy a page found here into the tiers above (those that admit it).",
    )

    @field_validator("extra_config", mode="before")
    @classmethod
    def _parse_extra(cls, value: Any) -> dict[str, Any]:
        return parse_extra_config(value, source="extra_config")

    @field_validator("backend")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty name (`kvtier backends` lists them)")
        return value.strip()

    @field_validator("eviction", "admission", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return _check_choice(value)


class TenantConfig(BaseModel):
    """What one tenant may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quota_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Most bytes of this tenant's pages in each tier; over it, the "
        "tenant's own pages are evicted first, never another tenant's.",
    )
