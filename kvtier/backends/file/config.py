"""Options of the ``file`` backend and its config-time plan check."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvtier.backends.filestore.options import FileStoreOptions, check_direct_plan

__all__ = ["FileConfig", "validate_file_plan"]


class FileConfig(FileStoreOptions):
    """Options of the ``file`` backend: the shared store options, plus the thread pool."""

    io_threads: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Threads issuing reads and writes for one batch, so that several "
        "requests are in flight.",
    )


def validate_file_plan(config: Any, context: Any) -> None:
    """Refuse O_DIRECT at config time when the page's extents cannot be 4096-aligned."""
    check_direct_plan(config, context, "file.o_direct")
