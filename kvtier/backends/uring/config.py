"""Options of the ``uring`` backend and its config-time plan check."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvtier.backends.filestore.options import FileStoreOptions, check_direct_plan

__all__ = ["UringConfig", "validate_uring_plan"]


class UringConfig(FileStoreOptions):
    """Options of the ``uring`` backend: the shared store options, plus the queue."""

    queue_depth: int = Field(
        default=32,
        ge=1,
        le=4096,
        description="Most requests in flight in each thread's ring; 8-64 keeps a local "
        "NVMe busy, 1 issues one request at a time.",
    )
    submit_async: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Whether reads and writes go to the kernel's io_uring workers "
        "(IOSQE_ASYNC) instead of being tried inline at submission, where page-cache "
        "copies hold the GIL. 'auto': buffered I/O goes to the workers when queue_depth "
        "> 1, O_DIRECT and queue depth 1 are submitted inline, and page writes that "
        "cannot overlap (queue depth 1, a one-page put) are plain pwritev calls.",
    )


def validate_uring_plan(config: Any, context: Any) -> None:
    """Refuse O_DIRECT at config time when the page's extents cannot be 4096-aligned."""
    check_direct_plan(config, context, "uring.o_direct")
