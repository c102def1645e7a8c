"""``HookedKvtierConnector``: kvtier's vLLM connector with test-only hooks, never shipped.

The engine tests (``tests/vllm_engine/engine.py``) load it with
``"kv_connector": "HookedKvtierConnector", "kv_connector_module_path": "hooks"`` and its
settings in ``kv_connector_extra_config["kvtier_test"]`` (an in-process engine may also
change ``connector.hooks`` between phases):

- ``load_delay_s`` / ``save_delay_s``: each page-store read / write of a worker sleeps that
  long first (a slow disk or network), so loads and stores are in flight for a while;
- ``swap``: ``{"tokens": P, "with": Q}``: a load of P's pages reads Q's pages instead (a
  negative control: the KV is wrong while every page verifies, and only the output shows it).
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.integrations.vllm.connector import KvtierConnector
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.scheduler import TenantKeyers
from kvtier.integrations.vllm.worker import WorkerSide

__all__ = ["HookedKvtierConnector"]


class HookedKvtierConnector(KvtierConnector):
    """:class:`KvtierConnector` plus the hooks of the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.hooks: dict[str, Any] = dict(extra.get("kvtier_test") or {})

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.worker
        if not isinstance(worker, WorkerSide) or worker.store is None:
            return
        store = worker.store
        get, put = store.get, store.put

        def slow_get(*args: Any, **kwargs: Any) -> Any:
            time.sleep(float(self.hooks.get("load_delay_s", 0)))
            return get(*args, **kwargs)

        def slow_put(*args: Any, **kwargs: Any) -> Any:
            time.sleep(float(self.hooks.get("save_delay_s", 0)))
            return put(*args, **kwargs)

        store.get = slow_get  # type: ignore[method-assign]
        store.put = slow_put  # type: ignore[method-assign]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        swap = self.hooks.get("swap")
        if swap:
            keyer = TenantKeyers(self.plan, self.settings.tenant, self.groups)(None)
            wrong = dict(zip(keyer.keys(swap["tokens"]), keyer.keys(swap["with"]), strict=True))
            loads = self._work().loads
            for i, op in enumerate(loads):
                if any(key in wrong for key in op.keys):
                    keys = [wrong.get(key, key) for key in op.keys]
                    loads[i] = PageOp(op.req_id, keys, op.blocks, op.first, op.group)
        super().start_load_kv(forward_context, **kwargs)
