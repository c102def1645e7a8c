"""What a storage backend, an IO backend or a policy declares about itself.

Declarations are plain frozen dataclasses, so capability resolution needs no plugin
machinery and declaring a backend imports none of its optional dependencies: the factory
may be a lazy ``"module:attribute"`` string that is imported only when the backend is
built. Declarations are conservative: a spec supports what it lists and nothing else, so
a backend that lists no layout, attention kind or operation supports none, and an IO
backend that lists no capability executes nothing. A backend that stores any page lists
:data:`ALL_LAYOUTS`, :data:`ALL_ATTENTION` and :data:`ALL_OPERATIONS`.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from kvtier.core.errors import BackendUnavailableError, KvtierError, PluginError
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout
from kvtier.core.policy import AdmissionPolicy, EvictionPolicy
from kvtier.core.validation import validate_model

__all__ = [
    "ALL_ATTENTION",
    "ALL_LAYOUTS",
    "ALL_OPERATIONS",
    "BackendSpec",
    "Capability",
    "EmptyConfig",
    "Feature",
    "IOBackendSpec",
    "Operation",
    "PolicyKind",
    "PolicySpec",
]


class Operation(str, enum.Enum):
    """A device <-> host transfer an engine will ask for."""

    BACKUP_ALL = "backup_all"  # device -> host, every layer of some pages
    LOAD_ALL = "load_all"  # host -> device, every layer
    LOAD_LAYER = "load_layer"  # host -> device, one layer, to overlap with compute
    BACKUP_LAYER = "backup_layer"  # device -> host, one layer (layer-sharded pools)

    def __str__(self) -> str:
        return self.value


class Feature(str, enum.Enum):
    """Properties of a storage backend that an operator may rely on."""

    ZERO_COPY = "zero_copy"  # reads and writes host-pool extents in place
    PERSISTENT = "persistent"  # pages survive a process restart
    SHARED_PROCESSES = "shared_processes"  # several processes on one host see one store
    SHARED_NODES = "shared_nodes"  # several hosts see one store
    #: removes only what it is told to and what its eviction policy picks (never space it
    #: reclaims on its own), counting a page (unless it reports its space) as its envelope
    #: slot plus its payload: a storage chain can then decide alone what leaves it (needed
    #: above a ``write: back`` tier, whose pages arrive only through the chain's evictions)
    EXACT_EVICTION = "exact_eviction"
    #: reports its space and what a page costs it (:class:`kvtier.core.space.ReportsSpace`):
    #: in a storage chain, the tier's space manager alone then decides what leaves it, and
    #: the backend refuses a put that does not fit instead of evicting on its own
    REPORTS_SPACE = "reports_space"

    def __str__(self) -> str:
        return self.value


ALL_LAYOUTS: frozenset[Layout] = frozenset(Layout)
ALL_ATTENTION: frozenset[AttentionKind] = frozenset(AttentionKind)
ALL_OPERATIONS: frozenset[Operation] = frozenset(Operation)


class EmptyConfig(BaseModel):
    """The config model of a backend that takes no options."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Capability(NamedTuple):
    """One (layout, attention kind, operation) an IO backend executes."""

    layout: Layout
    attention: AttentionKind
    operation: Operation

    def __str__(self) -> str:
        return f"{self.layout.value}/{self.attention.value}/{self.operation.value}"


Factory = Callable[..., Any] | str


def _load_factory(kind: str, name: str, factory: Factory) -> Callable[..., Any]:
    if callable(factory):
        return factory
    module_name, sep, attribute = factory.partition(":")
    if not sep or not module_name or not attribute:
        raise PluginError(
            f"{kind} {name!r}: factory {factory!r} is not of the form 'package.module:Attribute'",
            value=factory,
        )
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{kind} {name!r}: factory {factory!r} is not callable", value=factory)
    return obj  # type: ignore[no-any-return]


def _missing_modules(modules: Iterable[str]) -> list[str]:
    missing = []
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                missing.append(module)
        except (ImportError, ValueError):
            missing.append(module)
    return missing


def _check_name(kind: str, name: str) -> None:
    if not name or not name.replace("_", "").replace("-", "").isalnum() or not name.isascii():
        raise PluginError(
            f"{kind} name {name!r} must be non-empty ASCII letters, digits, '_' or '-'",
            value=name,
        )


@dataclass(frozen=True)
class _SpecBase:
    name: str
    factory: Factory
    config_model: type[BaseModel] = EmptyConfig
    description: str = ""
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    #: Optional probe run by ``unavailable_reason``: returns why the backend cannot run
    #: here (a kernel feature missing, say), or None. It must be cheap and never raise.
    probe: Callable[[], str | None] | None = None

    #: What the spec declares, as errors name it ("backend", "IO backend").
    kind: ClassVar[str] = "backend"

    def unavailable_reason(self) -> str | None:
        """Why this cannot be used here (missing modules, a failed probe), or None."""
        missing = _missing_modules(self.requires)
        if missing:
            return f"missing Python module(s) {', '.join(missing)}"
        if self.probe is not None:
            try:
                return self.probe()
            except Exception as exc:  # a probe that raises still must not break listing
                return f"availability probe failed: {exc!r}"
        return None

    def ensure_available(self) -> None:
        """Raise :class:`BackendUnavailableError` with the install hint if unusable here."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(self.kind, self.name, reason, self.install_hint)

    def load_factory(self) -> Callable[..., Any]:
        """Import (if lazy) and return the factory; dependencies are checked first."""
        self.ensure_available()
        return _load_factory(self.kind, self.name, self.factory)


@dataclass(frozen=True)
class BackendSpec(_SpecBase):
    """A storage backend's declaration.

    ``factory(config, context)`` builds the backend from its validated ``config_model``
    instance and a :class:`kvtier.core.storage.BackendContext`. ``layouts``,
    ``attention`` and ``operations`` list what the backend supports; each is empty (so
    nothing is supported) unless declared. ``io_backends`` of None means the backend pairs
    with any IO backend: it only ever sees host memory, never the device side.
    """

    layouts: frozenset[Layout] = frozenset()
    attention: frozenset[AttentionKind] = frozenset()
    operations: frozenset[Operation] = frozenset()
    io_backends: frozenset[str] | None = None
    features: frozenset[Feature] = field(default_factory=frozenset)
    #: Optional plan check run during capability resolution, before anything is built:
    #: ``validate_plan(config, context)`` raises a ConfigError subclass naming what cannot
    #: work (for example O_DIRECT with extents that cannot be 4096-aligned).
    validate_plan: Callable[[Any, Any], None] | None = None

    kind: ClassVar[str] = "backend"

    def __post_init__(self) -> None:
        _check_name(self.kind, self.name)
        for attr, enum_type in (
            ("layouts", Layout),
            ("attention", AttentionKind),
            ("operations", Operation),
            ("features", Feature),
        ):
            object.__setattr__(self, attr, frozenset(enum_type(v) for v in getattr(self, attr)))
        if self.io_backends is not None:
            object.__setattr__(self, "io_backends", frozenset(self.io_backends))
        object.__setattr__(self, "requires", tuple(self.requires))


@dataclass(frozen=True)
class IOBackendSpec(_SpecBase):
    """An IO backend's declaration: exactly which capabilities it executes.

    ``factory(config, geometry, layout)`` returns an :class:`kvtier.core.io.IOBackend`.
    ``devices`` names the torch device types it runs on (``cpu``, ``cuda``, ...).
    """

    capabilities: frozenset[Capability] = field(default_factory=frozenset)
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    #: Preference when ``io_backend="auto"``: the highest priority that fits wins.
    priority: int = 0

    kind: ClassVar[str] = "IO backend"

    def __post_init__(self) -> None:
        _check_name(self.kind, self.name)
        object.__setattr__(
            self,
            "capabilities",
            frozenset(
                Capability(Layout(c[0]), AttentionKind(c[1]), Operation(c[2]))
                for c in self.capabilities
            ),
        )
        object.__setattr__(self, "devices", frozenset(self.devices))
        object.__setattr__(self, "requires", tuple(self.requires))

    def supports(self, layout: Layout, attention: AttentionKind, operation: Operation) -> bool:
        return Capability(layout, attention, operation) in self.capabilities


#: What a policy decides: which pages leave a tier, or which enter it.
PolicyKind = Literal["eviction", "admission"]
_POLICY_BASES: dict[str, type] = {"eviction": EvictionPolicy, "admission": AdmissionPolicy}


@dataclass(frozen=True)
class PolicySpec:
    """An eviction or admission policy's declaration.

    ``factory(config)`` builds a fresh policy from its validated ``config_model``
    instance: an :class:`~kvtier.core.policy.EvictionPolicy` for ``kind="eviction"``, an
    :class:`~kvtier.core.policy.AdmissionPolicy` for ``kind="admission"``. :meth:`build`
    is the one door from a name's options to an instance: it validates, imports a lazy
    factory, constructs and checks the type, so every tier and the benchmark build alike.
    """

    name: str
    kind: PolicyKind
    factory: Factory
    config_model: type[BaseModel] = EmptyConfig
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("policy", self.name)
        if self.kind not in _POLICY_BASES:
            raise PluginError(
                f"policy {self.name!r}: kind {self.kind!r} is not one of "
                f"{sorted(_POLICY_BASES)}; an eviction policy chooses victims, an admission "
                "policy admits pages",
                value=self.kind,
            )

    def validate(self, options: Mapping[str, Any] | None = None, *, where: str = "") -> BaseModel:
        """``options`` checked against ``config_model``: unknown keys and bad values are
        config errors naming the field path (under ``where``, such as ``tiers[1].eviction``)."""
        return validate_model(
            self.config_model,
            dict(options or {}),
            where=where,
            label=f"{where or 'options'} of {self.kind} policy {self.name!r}",
        )

    def build(self, options: Mapping[str, Any] | None = None, *, where: str = "") -> Any:
        """A fresh policy built from ``options`` (validated first; see :meth:`validate`).

        A factory that cannot be imported, raises something other than a kvtier error, or
        returns something other than the kind's base class, is a :class:`PluginError`
        naming the policy.
        """
        config = self.validate(options, where=where)
        try:
            factory = _load_factory("policy", self.name, self.factory)
        except (ImportError, AttributeError) as exc:
            raise PluginError(
                f"{self.kind} policy {self.name!r}: cannot import its factory "
                f"{self.factory!r}: {exc!r}; is the plugin installed whole?",
                value=self.factory,
            ) from exc
        try:
            policy = factory(config)
        except KvtierError:
            raise
        except Exception as exc:
            raise PluginError(
                f"{self.kind} policy {self.name!r}: its factory {self.factory!r} raised "
                f"{exc!r}; fix the plugin, or choose another policy",
                value=self.name,
            ) from exc
        base = _POLICY_BASES[self.kind]
        if not isinstance(policy, base):
            raise PluginError(
                f"{self.kind} policy {self.name!r}: its factory returned "
                f"{type(policy).__name__}, not a kvtier.plugins.{base.__name__}",
                value=policy,
            )
        return policy
