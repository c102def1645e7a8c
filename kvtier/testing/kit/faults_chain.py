"""The kit over a chain of storage tiers: ``ChainKit``, a fixture class like ``BackendKit``.

A test module lists the tiers (as an engine config's ``tiers`` gives them) and runs the
fault campaign against the chain kvtier opens from them::

    class TestMemoryOverFile(ChainKit, FaultCampaignTests):
        tiers = [
            {"backend": "memory", "extra_config": {"capacity_bytes": 1 << 26}},
            {"backend": "file", "extra_config": {"root": "{tmp}/slow", "min_free_bytes": 0}},
        ]

The chain is built through kvtier's one path (``resolve`` -> ``open_store``); the mixins
reach it through the same :class:`~kvtier.testing.kit.harness.Harness` (its ``store`` is
the chain). The chain declares what every tier declares (a feature one tier lacks, the
chain lacks), so a mixin gated on a feature runs only where every tier has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtier.core.bounded import DEFAULT_CALL_TIMEOUT_S
from kvtier.core.capabilities import ResolvedPlan, build_host_pool, resolve
from kvtier.core.config import EngineConfig
from kvtier.core.errors import PluginError
from kvtier.core.geometry import AttentionKind
from kvtier.core.host_pool import HostPool
from kvtier.core.layout import Layout
from kvtier.core.pagestore import VerifyMode
from kvtier.core.specs import BackendSpec, IOBackendSpec
from kvtier.testing.kit.harness import (
    BackendKit,
    Harness,
    KitEnv,
    expand_tmp,
    geometry_fields,
    load_kit_registry,
    whole_page_operations,
)

__all__ = ["ChainKit", "ChainKitEnv", "expand_tiers", "open_chain_child"]


def _takes(field: Any, value: Any) -> bool:
    """Whether a config field exists and takes ``value`` (a ``Literal`` field: one of its
    values), so one option given to a chain goes only to the tiers that accept it."""
    if field is None:
        return False
    choices = typing.get_args(field.annotation)
    origin = typing.get_origin(field.annotation)
    return origin is not typing.Literal or value in choices


def _chain_spec(specs: Sequence[BackendSpec]) -> BackendSpec:
    """The first tier's spec, named for the chain and declaring only what every tier
    declares."""
    first = specs[0]
    features, layouts, attention = first.features, first.layouts, first.attention
    for spec in specs[1:]:
        features &= spec.features
        layouts &= spec.layouts
        attention &= spec.attention
    name = "-over-".join(spec.name for spec in specs)  # as skips and failures name it
    return dataclasses.replace(
        first, name=name, features=features, layouts=layouts, attention=attention
    )


class ChainKitEnv(KitEnv):
    """Builds chains of the given tiers for one test; closes them at teardown."""

    def __init__(
        self,
        tiers: Sequence[Mapping[str, Any]],
        backends: Mapping[str, BackendSpec],
        plugins: Sequence[tuple[str, object]],
        tmp: Path,
        io_backends: Mapping[str, IOBackendSpec] | None = None,
    ) -> None:
        self.tiers = [dict(tier) for tier in tiers]
        self.backends = dict(backends)
        specs = [self.backends[tier["backend"]] for tier in self.tiers]
        super().__init__(_chain_spec(specs), {}, plugins, tmp, io_backends)
        self._chains: list[Any] = []
        #: The installed eviction and admission policies, by name: a tier's default
        #: policy comes from them, as kvtier's own opening resolves it.
        self.policies = load_kit_registry(plugins).policies

    def plan(
        self, attention: AttentionKind, layout: Layout, *, verify: VerifyMode = "full"
    ) -> ResolvedPlan:
        """The plan kvtier resolves for these tiers, ``attention`` and ``layout``."""
        specs = [self.backends[tier["backend"]] for tier in self.tiers]
        config = EngineConfig.from_mapping(
            {
                "tiers": self.tiers,
                "layout": Layout(layout).value,
                **geometry_fields(attention),
                "operations": [op.value for op in whole_page_operations(specs)],
                "model": self.model,
                "verify": verify,
            }
        )
        return resolve(config, self.backends, self.io_backends, policies=self.policies)

    def open(
        self,
        *,
        attention: AttentionKind | None = None,
        layout: Layout | None = None,
        num_pages: int = 16,
        verify: VerifyMode = "full",
        seed: int = 0,
    ) -> Harness:
        """A fresh chain over a host pool of ``num_pages`` (the default call bound)."""
        return self._open_chain(attention, layout, num_pages, verify, seed, DEFAULT_CALL_TIMEOUT_S)

    def open_bounded(self, bound_s: float, *, num_pages: int = 16) -> Harness:
        """A fresh chain whose every tier bounds its backend calls by ``bound_s``."""
        return self._open_chain(None, None, num_pages, "full", 0, bound_s)

    def _open_chain(
        self,
        attention: AttentionKind | None,
        layout: Layout | None,
        num_pages: int,
        verify: VerifyMode,
        seed: int,
        bound_s: float,
    ) -> Harness:
        from kvtier.storage import open_store

        attention = attention or self.default_attention()
        layout = layout or self.default_layout(attention)
        try:
            plan = self.plan(attention, layout, verify=verify)
            pool: HostPool = build_host_pool(plan, num_pages=num_pages, pin_memory=False)
            chain = open_store(plan, pool, backend_call_timeout_s=bound_s)
        except PluginError as exc:
            raise AssertionError(f"chain {self.tiers} fails the kit: {exc}") from exc
        self._chains.append(chain)
        # a chain is a Store, as a page store is: the mixins use only that API
        return Harness(chain.backend, pool, chain, plan.keyer(), plan.geometry, plan.layout, seed)

    def with_options(self, **overrides: Any) -> ChainKitEnv:
        """The same chain with ``overrides`` in the options of every tier that takes them
        (a mode a tier does not declare leaves that tier's option as it was)."""
        tiers = []
        for tier in self.tiers:
            fields = self.backends[tier["backend"]].config_model.model_fields
            options = dict(tier.get("extra_config", {}))
            options.update({k: v for k, v in overrides.items() if _takes(fields.get(k), v)})
            tiers.append({**tier, "extra_config": options})
        env = ChainKitEnv(tiers, self.backends, self.plugins, self.tmp, self.io_backends)
        env.model = self.model
        return env

    def child_extra(self) -> dict[str, Any]:
        """What a child process needs beyond the kit's job to open this chain."""
        return {"opener": "kvtier.testing.kit.faults_chain:open_chain_child", "tiers": self.tiers}

    def close_all(self) -> None:
        for chain in reversed(self._chains):
            # a tier that fails to close must not hide the test's verdict
            with contextlib.suppress(Exception):
                chain.close()
        self._chains.clear()
        super().close_all()


def expand_tiers(tiers: Sequence[Mapping[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """``tiers`` with ``"{tmp}"`` in every string replaced by ``tmp``."""
    expanded = expand_tmp([dict(tier) for tier in tiers], tmp)
    assert isinstance(expanded, list)
    return expanded


def open_chain_child(job: dict[str, Any], *, num_pages: int = 16) -> tuple[KitEnv, Harness]:
    """A child process's side: the chain the job names (see :meth:`ChainKitEnv.child_extra`)."""
    plugins = [(name, importlib.import_module(module)) for name, module in job["plugins"]]
    registry = load_kit_registry(plugins)
    env = ChainKitEnv(job["tiers"], registry.backends, plugins, Path("."), registry.io_backends)
    env.model = job["model"]
    attention = AttentionKind(job["geometry"]["attention"])
    h = env.open(attention=attention, layout=Layout(job["layout"]), num_pages=num_pages)
    return env, h


class ChainKit(BackendKit):
    """The fixture class of a chain's test module: set ``tiers`` (``"{tmp}"`` in a string
    becomes a fresh per-test directory), as an engine config's ``tiers`` lists them."""

    tiers: ClassVar[Sequence[Mapping[str, Any]]] = ()

    def chain_tiers(self, tmp: Path) -> list[dict[str, Any]]:
        """The tiers for one test; ``tmp`` is a fresh private directory (override to build
        options at run time, such as a server's address)."""
        return expand_tiers(self.tiers, tmp)

    @pytest.fixture
    def kit_spec(self, tmp_path: Path) -> BackendSpec:
        tiers = self.chain_tiers(tmp_path)
        if not tiers:
            pytest.fail(f"{type(self).__name__} must set tiers")
        registry = load_kit_registry(self.plugins)
        return _chain_spec([registry.backend(tier["backend"]) for tier in tiers])

    @pytest.fixture
    def kit(self, kit_spec: BackendSpec, tmp_path: Path) -> Iterator[KitEnv]:
        tmp = tmp_path / "kit"
        tmp.mkdir(mode=0o700)
        registry = load_kit_registry(self.plugins)
        tiers = self.chain_tiers(tmp)
        env = ChainKitEnv(tiers, registry.backends, self.plugins, tmp, registry.io_backends)
        try:
            yield env
        finally:
            env.close_all()
