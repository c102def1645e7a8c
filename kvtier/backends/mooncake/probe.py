"""Whether the Mooncake client can load here, and how to install it.

Cheap and free of Mooncake imports, so declaring the backend imports nothing optional.
"""

from __future__ import annotations

import ctypes

__all__ = ["INSTALL_HINT", "probe_mooncake"]

#: How to get what the ``mooncake`` backend needs.
INSTALL_HINT = (
    "pip install 'kvtier[mooncake]' on GPU hosts or 'kvtier[mooncake-cpu]' on CPU-only "
    "hosts; both need libibverbs (apt-get install libibverbs1)"
)


def probe_mooncake() -> str | None:
    """Why the Mooncake client cannot load here (libibverbs missing), or None. Cheap."""
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return "libibverbs.so.1 cannot be loaded (apt-get install libibverbs1)"
    return None
