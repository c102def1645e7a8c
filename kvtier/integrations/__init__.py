"""Adapters that put kvtier behind serving engines.

Each adapter lives in its own module and imports its engine only when that module is
imported, so ``import kvtier`` never needs an engine installed:

- :mod:`kvtier.integrations.sglang`: SGLang's HiCache ``dynamic`` storage backend
  (``pip install 'kvtier[sglang]'``; see ``docs/sglang.md``).
"""

from __future__ import annotations

__all__: list[str] = []
