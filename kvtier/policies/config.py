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
        description="Evicted keys remembered, about this multiple of the resident page "
        "count (between 2/3 and 4/3 of it, plus 16: two generations, the older forgotten "
        "whole); a remembered key that comes back enters the protected segment at once.",
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
        "evenly between them; an overfull level hands its least recent pages down. With "
        "adaptive, where the share starts, and the most it grows back to.",
    )
    adaptive: bool = Field(
        default=True,
        description="Let a duel with LRU move the protected share between 0 and "
        "protected_fraction: a sample of the pages is also kept in an LRU shadow of the "
        "tier's size, and each time the sample has seen as many hits as the tier holds "
        "pages (over duel_sample), the share moves a tenth towards whichever hit more.",
    )
    duel_sample: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="One new page in this many is sampled for the duel with LRU (1: every "
        "page; the shadow then costs a dict entry per page of the tier).",
    )
    ghost_factor: float = Field(
        default=4.0,
        ge=0,
        description="Evicted keys remembered with their level, about this multiple of the "
        "resident page count (between 2/3 and 4/3 of it, plus 16: two generations, the "
        "older forgotten whole); a remembered key that comes back enters one level higher.",
    )
    orphans_first: bool = Field(
        default=True,
        description="Evict first the pages whose parent was removed from this tier: a "
        "prefix look-up can no longer reach them here.",
    )
