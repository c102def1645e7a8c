"""Options of the ``memory`` backend."""

from __future__ import annotations

from pydantic import BaseModel, ByteSize, ConfigDict, Field

__all__ = ["MemoryConfig"]


class MemoryConfig(BaseModel):
    """Options of the ``memory`` backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        gt=0,
        description="Most bytes held; the least recently used pages go first. "
        "An integer or a size such as '512MiB'.",
    )
