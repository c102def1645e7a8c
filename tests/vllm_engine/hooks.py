"""``HookedKvtierConnector``: kvtier's vLLM connector with test-only hooks, never shipped.

The engine tests (``tests/vllm_engine/engine.py``) load it with
``"kv_connector": "HookedKvtierConnector", "kv_connector_module_path": "hooks"`` and its
settings in ``kv_connector_extra_config["kvtier_test"]`` (an in-process engine may also
change ``connector.hooks`` between phases):

- ``load_delay_s`` / ``save_delay_s``: each page-store read / write of a worker sleeps that
  long first (a slow disk or network), so loads and stores are in flight for a while;
- ``load_until_steps``: ``{"steps": N, "max_s": S}``: a read is then held until the worker
  counted N model steps run while it was in flight (``load_overlap_steps``), or S seconds
  passed: a load that blocked the steps would run into S;
- ``swap``: ``{"tokens": P, "with": Q}``: a load of P's pages reads Q's pages instead (a
  negative control: the KV is wrong while every page verifies, and only the output shows it);
- ``preempt_after_pickup_s``: a preemption reaches the worker only once the writer took
  the preempted requests' queued stores (at most that long), so a store of theirs is in
  flight when vLLM reuses their blocks (with ``save_delay_s`` past ``preempt_wait_s``: a
  tainted store);
- ``no_page_extras``: ``true`` at start-up: the scheduler keys pages by their tokens alone,
  without a request's multimodal items or prompt embeddings (a negative control: two
  images with the same text share pages, as they did before the images were keyed).
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.integrations.vllm import scheduler as scheduler_module
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
        if self.hooks.get("no_page_extras"):
            scheduler_module.page_extras = lambda *args: None  # type: ignore[assignment]

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.worker
        if not isinstance(worker, WorkerSide) or worker.store is None:
            return
        # the worker's one verified read and its one write into storage
        get, put = worker._store_get, worker._store_put

        def slow_get(*args: Any, **kwargs: Any) -> Any:
            time.sleep(float(self.hooks.get("load_delay_s", 0)))
            held = self.hooks.get("load_until_steps")
            if held:  # hold the read until that many model steps ran meanwhile (or max_s)
                steps = lambda: worker.counters.snapshot()["load_overlap_steps"]  # noqa: E731
                start, deadline = steps(), time.monotonic() + float(held["max_s"])
                while steps() - start < int(held["steps"]) and time.monotonic() < deadline:
                    time.sleep(0.005)
            return get(*args, **kwargs)

        def slow_put(*args: Any, **kwargs: Any) -> Any:
            time.sleep(float(self.hooks.get("save_delay_s", 0)))
            return put(*args, **kwargs)

        worker._store_get = slow_get  # type: ignore[method-assign]
        worker._store_put = slow_put  # type: ignore[method-assign]
        preempted = worker.preempted

        def preempted_after_pickup(req_ids: Any) -> None:
            hold = float(self.hooks.get("preempt_after_pickup_s", 0))
            gone = set(req_ids)
            deadline = time.monotonic() + hold
            while time.monotonic() < deadline:
                with worker._cv:
                    if not any(save.op.req_id in gone for save in worker._queue):
                        break
                time.sleep(0.005)
            preempted(gone)

        worker.preempted = preempted_after_pickup  # type: ignore[method-assign]

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
