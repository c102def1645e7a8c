"""Options of the built-in policies, one pydantic model each (unknown keys are errors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FrequencyConfig", "LRUConfig", "PrefixConfig", "SLRUConfig"]


class LRUConfig(BaseModel):
    """Options of the ``lru`` eviction policy: none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SLRUConfig(BaseModel):
    """Options of the ``slru`` eviction policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protected_fraction: float = Field(
        default=0.9,
        gt=0,
        lt=1,
        description="Most of the resident bytes the protected segment (pages used twice) "
        "holds; beyond it its least recently used pages go back to probation.",
    )
    ghost_factor: float = Field(
        default=4.0,
        ge=0,
        description="Evicted keys remembered, as a multiple of the resident page count "
        "(plus 16); a remembered key that comes back enters the protected segment at once.",
    )


class FrequencyConfig(BaseModel):
    """Options of the ``frequency`` admission policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_hits: int = Field(
        default=2,
        ge=1,
        le=15,
        description="Times a page must have been seen (looked up or offered) to be admitted.",
    )
    width: int = Field(
        default=1 << 16,
        ge=64,
        le=1 << 26,
        description="Counters per row of the count-min sketch; memory is depth x width "
        "bytes. Size it to a few times the distinct pages seen between two halvings.",
    )
    depth: int = Field(default=4, ge=1, le=8, description="Rows (hash functions) of the sketch.")
    halve_every: int | None = Field(
        default=None,
        ge=1,
        description="Accesses between two halvings of every counter, so old popularity "
        "fades; default 8 x width.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the sketch's hash functions.")


class PrefixConfig(BaseModel):
    """Options of the ``prefix`` eviction policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    levels: int = Field(
        default=1,
        ge=1,
        le=8,
        description="Protected levels above probation: a page reused n times sits at level "
        "min(n, levels); lower levels are evicted first.",
    )
    protected_fraction: float = Field(
        default=0.9,
        gt=0,
        lt=1,
        description="Most of the resident bytes the protected levels hold together, split "
        "evenly between them; an overfull level hands its least recent pages down.",
    )
    ghost_factor: float = Field(
        default=4.0,
        ge=0,
        description="Evicted keys remembered with their level, as a multiple of the "
        "resident page count (plus 16); a remembered key that comes back enters one level "
        "higher.",
    )
    orphans_first: bool = Field(
        default=True,
        description="Evict first the pages whose parent was removed from this tier: a "
        "prefix look-up can no longer reach them here.",
    )
