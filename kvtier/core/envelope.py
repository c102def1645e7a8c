"""The stored page format: a fixed-size envelope header in front of every page's payload."""

from __future__ import annotations

__all__ = ["ENVELOPE_BYTES"]

#: Bytes reserved for the envelope in front of every stored page. 4096 keeps the payload
#: aligned for O_DIRECT on storage and the header slot aligned in the host pool.
ENVELOPE_BYTES = 4096
