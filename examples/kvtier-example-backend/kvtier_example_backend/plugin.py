"""The plugin module named by the entry point: it declares, and imports nothing heavy.

The factory is a lazy ``"module:attribute"`` string, so ``kvtier backends`` can list this
backend without importing its implementation.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

import kvtier.plugins


class SqliteConfig(BaseModel):
    """Options of the ``example_sqlite`` backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="SQLite database file; created 0600 if missing.")
    synchronous: bool = Field(default=False, description="fsync every commit (slow, durable).")


@kvtier.hookimpl
def kvtier_register_backends(register: Callable[[kvtier.plugins.BackendSpec], None]) -> None:
    """Declare the ``example_sqlite`` backend."""
    register(
        kvtier.plugins.BackendSpec(
            name="example_sqlite",
            factory="kvtier_example_backend.backend:SqliteBackend",
            config_model=SqliteConfig,
            description="Example plugin: pages as rows of one SQLite file.",
            requires=("sqlite3",),
            install_hint="SQLite ships with CPython; rebuild Python with sqlite3 support",
            # Declarations are conservative: list what the backend supports. It stores
            # opaque bytes, so every layout, attention kind and operation works.
            layouts=kvtier.plugins.ALL_LAYOUTS,
            attention=kvtier.plugins.ALL_ATTENTION,
            operations=kvtier.plugins.ALL_OPERATIONS,
            features=frozenset(
                {kvtier.plugins.Feature.PERSISTENT, kvtier.plugins.Feature.SHARED_PROCESSES}
            ),
        )
    )
