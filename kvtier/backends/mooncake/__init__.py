"""The ``mooncake`` backend's plugin: its spec and hook implementation.

Pages go to a Mooncake distributed store (a ``mooncake_master`` plus the memory segments
that clients contribute), shared by every process and node that points at the same
master. Importing this package imports nothing from Mooncake: the client lives in
:mod:`kvtier.backends.mooncake.backend`, loaded only when the backend is built.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backends.mooncake.config import MooncakeConfig, parse_master_address
from kvtier.backends.mooncake.probe import INSTALL_HINT, probe_mooncake
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["MOONCAKE_SPEC", "MooncakeConfig", "parse_master_address", "probe_mooncake"]

MOONCAKE_SPEC = BackendSpec(
    name="mooncake",
    factory="kvtier.backends.mooncake.backend:MooncakeBackend",
    config_model=MooncakeConfig,
    description="Mooncake distributed store: pages shared by every process and node of one "
    "master; zero-copy multi-buffer puts and gets from registered host-pool memory.",
    requires=("mooncake",),
    install_hint=INSTALL_HINT,
    probe=probe_mooncake,
    layouts=ALL_LAYOUTS,
    attention=ALL_ATTENTION,
    operations=ALL_OPERATIONS,
    features=frozenset(
        {Feature.SHARED_PROCESSES, Feature.SHARED_NODES, Feature.ZERO_COPY, Feature.REPORTS_SPACE}
    ),
)


@hookimpl
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the ``mooncake`` backend (nothing from Mooncake is imported here)."""
    register(MOONCAKE_SPEC)
