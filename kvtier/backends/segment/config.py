"""Options of the ``segment`` backend, checked when the plan is resolved."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from kvtier.core.errors import InvalidFieldError

__all__ = ["SegmentConfig", "SegmentDurability", "default_root"]

SegmentDurability = Literal["none", "batch"]

#: Smallest and largest segment a store may be configured with.
MIN_SEGMENT_BYTES = 1 << 20
MAX_SEGMENT_BYTES = 4 << 30


def default_root() -> Path:
    """``<tempdir>/kvtier-<uid>/segment``: private to this user, created 0700."""
    return Path(tempfile.gettempdir()) / f"kvtier-{os.geteuid()}" / "segment"


class SegmentConfig(BaseModel):
    """Options of the ``segment`` backend: pages appended into large segment files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Field(
        default_factory=default_root,
        description="Directory holding the segments (created 0700; an existing one must be "
        "private to this user). Default: <tempdir>/kvtier-<uid>/segment.",
    )
    segment_bytes: ByteSize = Field(
        default=ByteSize(64 << 20),
        ge=MIN_SEGMENT_BYTES,
        le=MAX_SEGMENT_BYTES,
        description="Size of one segment file, the unit of reclamation: pages are appended "
        "into it until it is full, and space comes back a whole segment at a time. "
        "1MiB to 4GiB; a page larger than this gets a segment of its own.",
    )
    capacity_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Most bytes of segment files kept (all processes sharing the root "
        "together); whole segments are reclaimed beyond it, in the eviction policy's "
        "order, else oldest first (in a chain, as the tier's space manager picks). At least "
        "twice segment_bytes. None: bounded only by "
        "min_free_bytes.",
    )
    min_free_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=0,
        description="Free space always left on the filesystem: segments are reclaimed (or "
        "the put fails) rather than going below it.",
    )
    fsync: SegmentDurability = Field(
        default="none",
        description="Durability: 'none' survives a process crash, not a power cut; "
        "'batch' fdatasyncs each put's pages before the record that publishes them and "
        "the record after, so a put survives a power cut once it returns.",
    )
    io_threads: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Most threads moving one batch: reads from the page cache use at "
        "most one per CPU and per MiB, reads from the disk one per segment; with the "
        "compiled path a record is written by one thread (threads writing one file take "
        "turns), without it by up to this many, each a contiguous share.",
    )
    compiled_io: bool = Field(
        default=True,
        description="Move a batch's pages with the compiled loop when it was built: a "
        "record's pages written with their envelopes in one call, nearby pages read in "
        "one preadv and checked in the same pass, the GIL released. false, or when it is "
        "missing, runs the same steps in Python.",
    )
    check_disk_on_miss: bool = Field(
        default=True,
        description="On an index miss, look for segments and records other processes "
        "sharing the root appended since (one stat of the directory, one read per "
        "segment another process is still writing).",
    )
    reclaim_rewrite_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=0.9,
        description="With an eviction policy: the most of a segment, as a fraction of "
        "segment_bytes, whose live pages the policy did not choose as victims are "
        "rewritten into the active segment when it is reclaimed; the rest are dropped. "
        "0 drops every live page. Without a policy every live page is dropped.",
    )

    @model_validator(mode="after")
    def _capacity_holds_two_segments(self) -> SegmentConfig:
        if self.capacity_bytes is not None and self.capacity_bytes < 2 * self.segment_bytes:
            raise InvalidFieldError(
                "capacity_bytes",
                f"{int(self.capacity_bytes)} must be at least twice "
                f"segment_bytes ({int(self.segment_bytes)}): space is reclaimed a whole "
                "segment at a time while another is being written; raise capacity_bytes "
                f"to {2 * int(self.segment_bytes)} or more, or lower segment_bytes",
                value=int(self.capacity_bytes),
            )
        return self
