"""Shared fixtures: every test starts with plugin autoload off and no blocked plugins."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry-point plugins installed on the machine stay out unless a test opts in."""
    monkeypatch.setenv("KVTIER_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("KVTIER_DISABLE_PLUGINS", raising=False)
