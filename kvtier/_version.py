"""The kvtier version, in a module of its own so that nothing imports upward for it."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
