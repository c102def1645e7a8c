"""The example plugin proves itself with kvtier's conformance kit: one class, no more."""

from __future__ import annotations

from kvtier.testing import BackendKit, ConformanceTests


class TestExampleSqlite(BackendKit, ConformanceTests):
    backend_name = "example_sqlite"
    extra_config = {"path": "{tmp}/pages.db"}
