"""SGLang test support: SGLang's own KV classes on the CPU, and its own cache controllers.

Everything KV-related here is the installed SGLang release's own code, imported as SGLang
imports it: the device pools (``MHATokenToKVPool``, ``MLATokenToKVPool``, built with
``device="cpu"``), the host pools built from them the way SGLang's assembler builds them
(``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ``MambaPoolHost``: the device pool's
buffer info, ``device_capacity_tokens``, ``start_layer``, ``end_layer``, ``pin_memory=False``),
the token allocator (``PagedTokenToKVPoolAllocator``), ``HiCacheController`` and, for hybrid
models, ``HybridCacheController`` over a ``HostPoolGroup``. The controllers run their own
storage threads (prefetch, prefetch I/O, prefetch sync, backup) and call kvtier's
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` (and the v2 calls) exactly as in a
server; :class:`Controller` only puts operations on the controller's queues, where
SGLang's scheduler puts them, and waits for the controller's acknowledgements.

What is not SGLang's: the scheduler around the controller (the radix tree that decides
what to back up and to prefetch), replaced by those few queue operations, and the device
side of the controller (``write`` / ``load``: device-to-host copies through
``sgl_kernel``, CUDA only), which no storage test needs.

SGLang's KV modules import ``torchvision`` (through ``sglang.srt.configs``), which loads
only beside its own torch build; ``scripts/install-sglang.sh`` installs that torch (SGLang's
pinned ``torch==2.14.1``, a CUDA build that runs on the CPU) with ``torchvision`` into the
SGLang test environment (``.venv-sglang``, or ``$KVTIER_SGLANG_VENV``). In kvtier's own
environment (the CPU torch) these tests skip, and ``tests/test_sglang_env.py`` runs them
with that environment's python; ``KVTIER_REQUIRE_SGLANG=1`` makes a missing environment a
failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import sys
import threading
import types
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
MODULE_PATH = "kvtier.integrations.sglang"
CLASS_NAME = "KvtierHiCacheStorage"
ROOT = Path(__file__).resolve().parent.parent
#: The SGLang test environment scripts/install-sglang.sh makes.
VENV = Path(os.environ.get("KVTIER_SGLANG_VENV", ROOT / ".venv-sglang"))
#: How long a test waits for one of the controller's threads before it fails.
WAIT_S = 60.0

#: SGLang's KV modules whose classes the tests drive (and assert are SGLang's own).
KV_MODULES = (
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.group",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.device_pool_info",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.observability.metrics_collector",
)


def load_sglang() -> types.ModuleType:
    """Import SGLang's real ``hicache_storage`` module; raises ImportError if it cannot."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(
            f"SGLang is not installed: run scripts/install-sglang.sh "
            f"(pip install --no-deps sglang=={SGLANG_VERSION} and its import-time modules)"
        )
    return importlib.import_module("sglang.srt.mem_cache.hicache_storage")


def load_kv_classes() -> dict[str, types.ModuleType]:
    """Import SGLang's KV modules (:data:`KV_MODULES`); raises ImportError naming the cause."""
    load_sglang()
    import warnings

    modules = {}
    with warnings.catch_warnings():
        # SGLang's quantization modules warn at import that CUDA kernels are absent
        warnings.simplefilter("ignore")
        for name in KV_MODULES:
            try:
                modules[name] = importlib.import_module(name)
            except Exception as exc:
                raise ImportError(f"{name} failed to import: {exc!r}") from exc
    return modules


def in_sglang_env() -> bool:
    """Whether this interpreter is the SGLang test environment's."""
    return Path(sys.prefix).resolve() == VENV.resolve()


def sglang_storage_or_skip() -> types.ModuleType:
    """SGLang's storage module (``import sglang`` works): kvtier's own environment has it."""
    from kvtier.testing import require

    try:
        return load_sglang()
    except ImportError as exc:
        require("sglang", f"SGLang cannot be imported: {exc}")  # KVTIER_REQUIRE_SGLANG=1: fail
        raise  # not reached: require skipped or failed


def sglang_or_skip() -> types.ModuleType:
    """SGLang's storage module, once SGLang's KV classes import here; else skip.

    In kvtier's own environment (CPU torch, no torchvision) the KV classes cannot import:
    the test skips there, because ``tests/test_sglang_env.py`` runs it with the SGLang
    environment's python. Without that environment, or inside it when the classes still
    fail, it skips, and fails under ``KVTIER_REQUIRE_SGLANG=1``.
    """
    import pytest

    from kvtier.testing import require

    storage = sglang_storage_or_skip()
    try:
        load_kv_classes()
    except ImportError as exc:
        if not in_sglang_env() and (VENV / "bin" / "python").exists():
            pytest.skip(
                f"SGLang's KV classes cannot be imported in this environment ({exc}); "
                f"tests/test_sglang_env.py runs this test with {VENV}/bin/python",
                allow_module_level=True,
            )
        require(
            "sglang",
            f"SGLang's KV classes cannot be imported ({exc}) and there is no SGLang "
            f"environment at {VENV}: run scripts/install-sglang.sh",
        )
        raise
    return storage


# --- SGLang's pools, on the CPU ---------------------------------------------------------------

#: The device pool each host pool was built from (SGLang keeps it in the pool entry).
_DEVICE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@contextmanager
def _host_memory_budget() -> Iterator[None]:
    """Size host pools against the memory this machine has free, without the 10 GiB that
    SGLang keeps back for a serving host (its own ``host_memory_budget_scope``)."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(int(psutil.virtual_memory().available)):
        yield


def mha_host_pool(
    *,
    layer_num: int = 4,
    head_num: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    pages: int = 32,
    layout: str = "page_first",
    head_group_num: int = 1,
) -> Any:
    """SGLang's ``MHATokenToKVPoolHost`` of ``pages`` pages over its ``MHATokenToKVPool``.

    Built as ``build_kv_host_pool`` builds it (``_mha_host_inputs``: the device pool's buffer
    info, ``device_capacity_tokens``, ``start_layer``, ``end_layer``), on the CPU, unpinned.
    ``dtype`` is the model's KV dtype: fp8 pools keep raw bytes (``torch.uint8``), as SGLang's.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    device = MHATokenToKVPool(
        size=4 * page_size,
        page_size=page_size,
        dtype=dtype,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    with _host_memory_budget():
        host = get_mha_host_pool_cls(info)(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            write_back_staging=device.hicache_write_back_staging,
            head_group_num=head_group_num,
            host_token_capacity=pages * page_size,
        )
    _DEVICE[host] = device
    return host


def mla_host_pool(
    *,
    layer_num: int = 4,
    kv_lora_rank: int = 96,
    qk_rope_head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    pages: int = 32,
    layout: str = "page_first",
) -> Any:
    """SGLang's ``MLATokenToKVPoolHost`` of ``pages`` pages over its ``MLATokenToKVPool``
    (as ``_build_mha_mla_host_pool`` builds it), on the CPU, unpinned."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(
        size=4 * page_size,
        page_size=page_size,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
    )
    with _host_memory_budget():
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            override_kv_cache_dim=device.kv_cache_dim,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=device.layer_num,
            host_token_capacity=pages * page_size,
        )
    _DEVICE[host] = device
    return host


def mamba_host_pool(
    *,
    layers: int = 3,
    temporal_shape: tuple[int, ...] = (2, 8, 4),
    conv_shapes: tuple[tuple[int, ...], ...] = ((16, 3), (8, 3)),
    slots: int = 16,
    layout: str = "page_first",
    side_states: bool = False,
) -> Any:
    """SGLang's ``MambaPoolHost`` over device state buffers of a Mamba model (float32
    temporal state, bfloat16 conv states), as ``build_mamba_host_pool`` builds it from the
    device pool's ``MambaStateBufferInfo``; ``side_states`` registers a slot side state
    (``extra_checkpoint_buffers``), which SGLang's zero-copy page meta refuses.
    """
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    device_slots = slots // 2
    info = MambaStateBufferInfo(
        temporal=torch.zeros((layers, device_slots, *temporal_shape), dtype=torch.float32),
        conv=tuple(
            torch.zeros((layers, device_slots, *shape), dtype=torch.bfloat16)
            for shape in conv_shapes
        ),
        extra_checkpoint_buffers=(
            (torch.zeros((device_slots, 6), dtype=torch.uint8),) if side_states else ()
        ),
    )
    with _host_memory_budget():
        host = MambaPoolHost(
            info,
            2.0,
            0,
            device_capacity=device_slots,
            pin_memory=False,
            device="cpu",
            layout=layout,
        )
    _DEVICE[host] = info
    return host


#: The names test modules outside this folder's SGLang tests use for the KV pools.
MHAHostPool = mha_host_pool
MLAHostPool = mla_host_pool


def is_mla(pool: Any) -> bool:
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return isinstance(pool, MLATokenToKVPoolHost)


def device_pool_of(pool: Any) -> Any:
    """The device pool (or, for Mamba, the device state buffers) ``pool`` was built from."""
    return _DEVICE[pool]


def page_bytes(pool: Any) -> int:
    """Bytes of one of the pool's flat data pages (SGLang's ``get_dummy_flat_data_page``)."""
    dummy = pool.get_dummy_flat_data_page()
    return int(dummy.numel() * dummy.element_size())


def fill_random(pool: Any, index: int, seed: int) -> torch.Tensor:
    """Write random bytes into the page at host slot ``index`` with SGLang's
    ``set_from_flat_data_page``; returns a copy of them."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (page_bytes(pool),), dtype=torch.uint8, generator=gen)
    pool.set_from_flat_data_page(index, data.view(pool.dtype))
    return data


def page_content(pool: Any, index: int) -> torch.Tensor:
    """A copy of the page at host slot ``index`` as flat bytes (SGLang's ``get_data_page``)."""
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).clone()


def zero_page(pool: Any, index: int) -> None:
    """Zero the page at host slot ``index``."""
    zeros = torch.zeros(page_bytes(pool), dtype=torch.uint8)
    pool.set_from_flat_data_page(index, zeros.view(pool.dtype))


def starts(pool: Any, indices: torch.Tensor) -> list[int]:
    """The first host slot of each page of ``indices``."""
    return [int(i) for i in indices[:: pool.page_size]]


# --- page hashes, as SGLang computes them ---------------------------------------------------


class Chain(list[str]):
    """SGLang's page hashes of ``tokens`` (``get_storage_hash_str``), with the tokens: the
    controller's prefetch thread hashes the tokens again itself. ``tokens`` may be
    SGLang's ``RadixKey`` carrying a request's ``extra_key`` and ``cache_salt``."""

    tokens: Any

    @classmethod
    def of(cls, tokens: Any, page_size: int) -> Chain:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        chain = cls(get_storage_hash_str(tokens, None, page_size=page_size))
        chain.tokens = tokens
        return chain


def page_hashes(tokens: Sequence[int], page_size: int) -> Chain:
    """SGLang's storage page hashes of ``tokens`` (chained SHA-256 hex, one per page)."""
    return Chain.of(list(tokens), page_size)


def radix_key(
    tokens: Sequence[int], *, extra_key: str | None = None, salt: str | None = None
) -> Any:
    """SGLang's ``RadixKey`` of a request's tokens with its namespace (``extra_key``, which
    carries the LoRA id, and ``cache_salt``)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(list(tokens), extra_key=extra_key, cache_salt=salt)


# --- SGLang's cache controllers ---------------------------------------------------------------


def storage_config(
    *,
    extra_config: dict[str, Any],
    is_mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    layout: str = "page_first",
    model_name: str | None = "test/model",
    metrics: bool = True,
) -> Any:
    """A HiCacheStorageConfig as SGLang's controller generates it (``_generate_storage_config``).

    :meth:`Controller.attach` has the real controller generate its own from these fields
    (checked equal); tests that build the storage without a controller use it as is.
    """
    hs = load_sglang()
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        extra_config=dict(extra_config),
    )


@contextmanager
def _parallel(config: Any) -> Iterator[None]:
    """SGLang's parallel context of one rank, as its launcher publishes it, while a
    controller generates its storage config from it."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        attn_tp_rank=config.tp_rank,
        attn_tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
        attn_dcp_rank=0,
        attn_dcp_size=1,
    ):
        yield


_REQUESTS = itertools.count()


@dataclass
class Controller:
    """SGLang's own ``HiCacheController`` with kvtier (or any backend) attached, and the
    scheduler's side of its queues."""

    controller: Any
    pool: Any
    #: The extra pools' hits of the last :meth:`prefetch` (its PrefetchAcks' ``pool_hits``).
    pool_hits: dict[Any, int] = field(default_factory=dict)
    _acked: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def attach(
        cls,
        config: Any,
        pool: Any,
        *,
        backend: str = "dynamic",
        write_policy: str = "write_through_selective",
    ) -> Controller:
        """Build SGLang's ``HiCacheController`` over ``pool`` (and the device pool it was
        built from) with the storage backend attached at start-up, as the scheduler does:
        the controller generates its storage config from the rank's parallel context,
        ``model_name`` and the extra-config, builds the backend through SGLang's factory,
        registers the host pool and starts its storage threads. ``config`` gives the
        fields; the controller's own config is checked to agree. ``write_policy`` is
        SGLang's ``--hicache-write-policy`` (the controller's default, as SGLang's)."""
        load_kv_classes()
        from sglang.srt.managers.cache_controller import HiCacheController

        controller = _build(
            HiCacheController, config, pool, backend, group=None, write_policy=write_policy
        )
        return cls(controller, pool)

    @property
    def storage(self) -> Any:
        return self.controller.storage_backend

    @property
    def config(self) -> Any:
        return self.controller.storage_config

    @property
    def zero_copy(self) -> bool:
        return self.controller.page_get_func.__name__ == "_page_get_zero_copy"

    def backup(
        self,
        hashes: Sequence[str],
        host_indices: torch.Tensor,
        *,
        prefix_keys: Sequence[str] | None = None,
        extra_pools: list[Any] | None = None,
    ) -> int:
        """``write_storage`` (what the radix tree calls): the backup thread stores the pages
        (``batch_set_v1``, or the generic ``batch_set``; v2 for ``extra_pools``); returns
        the tokens it completed. ``prefix_keys``: the hashes of the pages before them."""
        kwargs = {"extra_pools": extra_pools} if extra_pools is not None else {}
        op_id = self.controller.write_storage(
            host_indices,
            [],
            hash_value=list(hashes),
            prefix_keys=None if prefix_keys is None else list(prefix_keys),
            **kwargs,
        )
        return int(self._acked_backup(op_id).completed_tokens)

    def _acked_backup(self, op_id: int) -> Any:
        while op_id not in self._acked:
            try:
                op = self.controller.ack_backup_queue.get(timeout=WAIT_S)
            except Empty:
                raise AssertionError("SGLang's backup thread never acknowledged") from None
            self._acked[op.id] = op
        return self._acked.pop(op_id)

    def hit_query(self, chain: Chain, *, extra_pools: list[Any] | None = None) -> list[str]:
        """``prefetch`` (what the radix tree calls): the prefetch thread hashes the chain's
        tokens and asks storage which leading pages it has (``batch_exists``, v2 with
        ``extra_pools``); returns the hashes of the hit."""
        return list(self.query(chain, extra_pools=extra_pools).hash_value)

    def query(self, chain: Chain, *, extra_pools: list[Any] | None = None) -> Any:
        """The prefetch thread's hit query: the operation, with its hit recorded."""
        operation = self._prefetch_op(chain.tokens, extra_pools)
        self.controller.prefetch_queue.put(operation)
        try:
            hit = self.controller.prefetch_hit_queue.get(timeout=WAIT_S)
        except Empty:
            raise AssertionError("SGLang's prefetch thread never answered") from None
        assert hit is operation
        return hit

    def _prefetch_op(self, tokens: Any, extra_pools: list[Any] | None) -> Any:
        rid = f"req-{next(_REQUESTS)}"
        if extra_pools is None and not isinstance(self, HybridController):
            from sglang.srt.managers.cache_controller import PrefetchOperation

            return PrefetchOperation(rid, tokens)
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            PrefetchOperation as HybridPrefetchOperation,
        )

        return HybridPrefetchOperation(
            CacheRequestHandle(rid, 0), tokens, pool_transfers=extra_pools
        )

    def prefetch(
        self, hashes: Sequence[str], host_indices: torch.Tensor, *, operation: Any = None
    ) -> int:
        """The scheduler hands a hit's operation, with host slots for it, to the prefetch
        I/O thread, which loads the pages (``batch_get_v1`` or the generic ``batch_get``;
        v2 for the operation's extra pools); returns the pages SGLang counts as loaded."""
        if operation is None:
            operation = self._prefetch_op([], None)
        operation.hash_value = list(hashes)
        operation.host_indices = host_indices
        self.controller.prefetch_buffer.put(operation)
        tokens = 0
        self.pool_hits = {}
        while True:
            try:
                ack = self.controller.ack_prefetch_queue.get(timeout=WAIT_S)
            except Empty:
                raise AssertionError("SGLang's prefetch I/O thread never finished") from None
            assert ack.operation is operation
            if ack.completed_tokens is not None:
                tokens = int(ack.completed_tokens)
            if ack.pool_hits:
                self.pool_hits.update(ack.pool_hits)
            if ack.completed_req:
                return tokens // self.controller.page_size

    def close(self) -> None:
        """``detach_storage_backend``: stop the storage threads and close the backend."""
        self.controller.detach_storage_backend()


def _allocator(device: Any) -> Any:
    """SGLang's token allocator over ``device`` (the controller reads ``get_kvcache()``)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        device.size, device.page_size, device.dtype, "cpu", device, need_sort=False
    )


def _build(
    cls: Any,
    config: Any,
    pool: Any,
    backend: str,
    *,
    group: Any,
    write_policy: str = "write_through_selective",
) -> Any:
    """One of SGLang's controllers over ``pool`` (``group``: its HostPoolGroup)."""
    device = device_pool_of(pool)
    extra = dict(config.extra_config or {})
    with _parallel(config):
        controller = cls(
            _allocator(device),
            group if group is not None else pool,
            pool.page_size,
            None,  # tp_group: one rank, no collectives
            threading.Event(),
            write_policy=write_policy,
            io_backend="direct",
            storage_backend=backend,
            model_name=config.model_name,
            storage_backend_extra_config=extra,
            enable_storage_metrics=config.enable_storage_metrics,
        )
    made = controller.storage_config
    assert (made.tp_rank, made.tp_size, made.is_mla_model, made.model_name) == (
        config.tp_rank,
        config.tp_size,
        config.is_mla_model,
        config.model_name,
    ), (made, config)
    return controller


class HybridController(Controller):
    """SGLang's own ``HybridCacheController`` over a ``HostPoolGroup`` of the KV pool and
    extra pools (``[(PoolName, host pool), ...]``): ``attach_storage_backend`` registers
    every pool with ``register_mem_host_pool_v2``, and the backup and prefetch threads move
    the extra pools' pages with ``batch_set_v2`` / ``batch_exists_v2`` / ``batch_get_v2``."""

    @classmethod
    def attach_group(
        cls, config: Any, pool: Any, extra: Sequence[tuple[Any, Any]]
    ) -> HybridController:
        load_kv_classes()
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

        def entry(name: Any, host: Any, anchor: bool) -> Any:
            device = device_pool_of(host)
            return PoolEntry(
                name=name,
                host_pool=host,
                device_pool=device,
                layer_mapper=lambda layer: layer,
                is_primary_index_anchor=anchor,
            )

        group = HostPoolGroup(
            [entry(PoolName.KV, pool, True), *(entry(n, p, False) for n, p in extra)]
        )
        controller = _build(HybridCacheController, config, pool, "dynamic", group=group)
        return cls(controller, pool)
