"""SGLang's HiCache storage (L3) on any kvtier backend, through SGLang's ``dynamic`` loader.

SGLang loads it with (``docs/sglang.md`` has the full command line)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
      "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
      "kvtier": {"backend": "file", "extra_config": {"root": "/mnt/nvme/kvtier"}}}'

SGLang's loader checks that :class:`KvtierHiCacheStorage` subclasses its ``HiCacheStorage``
and calls ``KvtierHiCacheStorage(storage_config, kwargs)``. The ``kvtier`` section is
validated there, with kvtier's parser and errors (unknown keys, types, the backend's own
options, attention kind). SGLang then hands over its host pool (``register_mem_pool_host``),
where the pool's geometry and layout are checked against the backend and the backend is
built. Both steps run inside SGLang's ``attach_storage_backend``, before any storage thread
starts, so a bad configuration stops the server at start-up.

Data path: with ``"interface_v1": 1`` SGLang calls ``batch_exists``, ``batch_get_v1`` and
``batch_set_v1``. A page reaches the backend as its envelope slot (one 4096-byte slot per
host page, in a slab kept here because SGLang's pool has no header room) followed by the
page's contiguous runs inside SGLang's own ``kv_buffer``; backends read and write those
regions in place, with no fresh tensor and no gather or scatter; backends that move only
registered memory (Mooncake) get the whole ``kv_buffer`` and the slab registered once, when
SGLang hands over its pool (:meth:`SGLangPages.memory_regions`). The core's
:class:`~kvtier.core.pagestore.PageStore` writes and verifies the envelopes, so a truncated,
bit-flipped or foreign page is a counted miss, never data. The legacy tensor API
(``get``/``set``/``batch_get``/``batch_set``/``exists``) stores the same bytes in the same
format, so both paths read each other's pages.

Hybrid models (SGLang's v2 calls): the extra host pools SGLang registers with
``register_mem_host_pool_v2`` (Mamba state, SWA KV, ...) each get a plan and page store of
their own, built the same way (:mod:`kvtier.integrations.sglang.plan`); ``batch_exists_v2``
counts a prefix only where every pool's hit policy allows it, and ``batch_get_v2`` ends a
pool's run at its first missing or invalid page.

Keys: SGLang's page hashes are used as given, prefixed by kvtier's namespace (model,
host-pool layout, geometry fingerprint, tenant) and, for MHA under tensor parallelism,
suffixed by the rank. MLA pages are identical on every rank, so they are shared and written
only by the rank SGLang names the storage writer (``HiCacheStorageConfig.is_storage_writer``).
Under SGLang's heterogeneous TP (``tp_lcm_size``, ``page_head``), a rank that SGLang asks to
split heads stores each page as the head slices the ranks of a ``tp_lcm_size``-way instance
hold, each in that rank's namespace and store, so instances of different TP sizes share pages.

The real SGLang host pools this reads are ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost``; the attributes used are ``kv_buffer``, ``layout``, ``page_size``,
``size``, ``dtype``, ``layer_num``, ``head_num``/``head_dim`` (MHA), ``kv_cache_dim`` and
``qk_rope_head_dim`` (MLA), ``dcp_size`` and the view method
``get_data_page(index, flat=False)``.

This module is the face SGLang's loader imports; the work is done in one module per job:
``settings`` (the ``kvtier`` section), ``plan`` (SGLang's config and host pools into kvtier
plans and page stores, resolved in one place), ``pages`` and ``pools`` (the pools' memory
and page stores), ``metrics`` (StorageMetrics and kvtier's counters) and ``storage`` (the
class, SGLang's v1, v2 and generic calls).
"""

from __future__ import annotations

from kvtier.integrations.sglang.pages import SGLangPages, pool_geometry_fields, pool_layout
from kvtier.integrations.sglang.settings import SECTION, SGLangSection
from kvtier.integrations.sglang.storage import KvtierHiCacheStorage

__all__ = [
    "SECTION",
    "KvtierHiCacheStorage",
    "SGLangPages",
    "SGLangSection",
    "pool_geometry_fields",
    "pool_layout",
]
