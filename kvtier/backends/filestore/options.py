"""Options of every backend on the on-disk scheme, and the config-time O_DIRECT check.

``file`` and ``uring`` extend :class:`FileStoreOptions` with their own fields, so both
take the same root, durability, capacity and free-space options and share a default root.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field

from kvtier.core.errors import InvalidFieldError
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import (
    ALIGNMENT,
    Layout,
    block_aligned_layouts,
    extent_bytes,
    extents_block_aligned,
)

__all__ = ["Durability", "FileStoreOptions", "check_direct_plan", "default_root"]

Durability = Literal["none", "page", "batch"]


def default_root() -> Path:
    """``<tempdir>/kvtier-<uid>/file``: private to this user, created 0700."""
    return Path(tempfile.gettempdir()) / f"kvtier-{os.geteuid()}" / "file"


class FileStoreOptions(BaseModel):
    """Options every backend on this on-disk scheme takes (``file``, ``uring``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Field(
        default_factory=default_root,
        description="Directory holding the pages (created 0700; an existing one must be "
        "private to this user). Default: <tempdir>/kvtier-<uid>/file.",
    )
    fsync: Durability = Field(
        default="none",
        description="Durability: 'none' survives a process crash, not a power cut; "
        "'page' fsyncs each page and its directory; 'batch' fsyncs each page and each "
        "touched directory once per batch.",
    )
    o_direct: bool = Field(
        default=False,
        description="Bypass the page cache (O_DIRECT). Needs extents that are multiples of "
        "4096 bytes (checked at config time) and a filesystem that supports it (checked "
        "at start-up).",
    )
    capacity_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Most bytes of pages kept; least recently used pages are evicted "
        "beyond it. None: bounded only by min_free_bytes. An integer or '64GiB'.",
    )
    min_free_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=0,
        description="Free space always left on the filesystem; pages are evicted (or the "
        "put fails) rather than going below it.",
    )
    compiled_io: bool = Field(
        default=True,
        description="Use the compiled page loop (open, preadv/pwritev, checksum and "
        "envelope with the GIL released) when it was built: file moves every page with "
        "it, uring reads the pages found in the page cache with it before using the "
        "ring. false, or when it is missing, runs the same steps in Python.",
    )
    check_disk_on_miss: bool = Field(
        default=True,
        description="On an index miss, exists() stats the file once, so pages written by "
        "other processes sharing the root are found.",
    )


def check_direct_plan(config: Any, context: Any, field: str) -> None:
    """Refuse O_DIRECT at config time when the page's extents cannot be block aligned.

    ``field`` names the option in the error (``file.o_direct``, ``uring.o_direct``); the
    layouts suggested instead are those of the geometry's attention kind that align.
    """
    if not getattr(config, "o_direct", False):
        return
    geometry: KVGeometry = context.geometry
    layout = Layout(context.layout)
    if extents_block_aligned(geometry, layout):
        return
    working = [other.value for other in block_aligned_layouts(geometry) if other is not layout]
    hint = (
        f"use layout {' or '.join(repr(w) for w in working)}, or set o_direct to false"
        if working
        else "set o_direct to false (no layout aligns this geometry)"
    )
    raise InvalidFieldError(
        field,
        f"O_DIRECT needs every extent to be a multiple of {ALIGNMENT} bytes, but "
        f"layout {layout.value!r} cuts a page of {geometry.describe()} into extents of "
        f"{extent_bytes(geometry, layout)} bytes; {hint}",
        value=True,
    )
