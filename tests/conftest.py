"""Shared fixtures: every test starts with plugin autoload off and no blocked plugins; one
Mooncake master for the modules that share one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.testing import require
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry-point plugins installed on the machine stay out unless a test opts in."""
    monkeypatch.setenv("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("KVTIER_DISABLE_PLUGINS", raising=False)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """One master plus a 256 MiB storage node on loopback for the whole session."""
    require("mooncake", mooncake_unavailable_reason())
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=256 << 20)
    master.start()
    try:
        yield master
    finally:
        master.close()
