"""The built-in eviction and admission policies' plugin: their specs and hook implementation.

Registered through ``kvtier_register_policies`` exactly as a third-party plugin's are.
Declaring imports only the config models; each factory is named lazily.

- ``lru`` (eviction): least recently used first; what a backend's capacity uses when it is
  given no policy (:class:`kvtier.core.policy.LRUPolicy`).
- ``slru`` (eviction): segmented LRU with a ghost of evicted keys, scan-resistant
  (:mod:`kvtier.policies.slru`).
- ``prefix`` (eviction): prefix-chain-aware and reuse-levelled, for KV caches
  (:mod:`kvtier.policies.prefix`).
- ``frequency`` (admission): a page enters once seen ``min_hits`` times, counted in a
  count-min sketch (:mod:`kvtier.policies.frequency`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.specs import PolicySpec
from kvtier.plugins.hookspecs import hookimpl
from kvtier.policies.config import FrequencyConfig, LRUConfig, PrefixConfig, SLRUConfig

__all__ = ["BUILTIN_POLICIES", "FrequencyConfig", "LRUConfig", "PrefixConfig", "SLRUConfig"]

BUILTIN_POLICIES: tuple[PolicySpec, ...] = (
    PolicySpec(
        name="lru",
        kind="eviction",
        factory="kvtier.core.policy:LRUPolicy",
        config_model=LRUConfig,
        description="Least recently used first; every backend's capacity default.",
    ),
    PolicySpec(
        name="slru",
        kind="eviction",
        factory="kvtier.policies.slru:SLRUPolicy",
        config_model=SLRUConfig,
        description="Segmented LRU: probation, then protected once reused; a ghost of "
        "evicted keys; scan-resistant.",
    ),
    PolicySpec(
        name="prefix",
        kind="eviction",
        factory="kvtier.policies.prefix:PrefixPolicy",
        config_model=PrefixConfig,
        description="KV prefix chains leave leaf first, orphans first; reuse lifts a page "
        "through levels; a ghost remembers evicted pages' levels.",
    ),
    PolicySpec(
        name="frequency",
        kind="admission",
        factory="kvtier.policies.frequency:FrequencyAdmission",
        config_model=FrequencyConfig,
        description="Admit a page once seen min_hits times (a count-min sketch).",
    ),
)


@hookimpl
def kvtier_register_policies(register: Callable[[PolicySpec], None]) -> None:
    """Declare the built-in policies."""
    for spec in BUILTIN_POLICIES:
        register(spec)
