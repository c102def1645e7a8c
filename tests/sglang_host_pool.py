"""SGLang test support: the real storage module, a stand-in host pool, and the cache
controller's storage calls in the controller's order.

Real SGLang code used here: ``sglang.srt.mem_cache.hicache_storage`` (``HiCacheStorage``,
``HiCacheStorageConfig``, ``HiCacheStorageExtraInfo``, ``STORAGE_BATCH_SIZE``,
``PoolName``) and ``sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory``
(the ``dynamic`` loader), imported from the installed wheel the way a user imports them
(``import sglang`` runs; ``scripts/install-sglang.sh`` installs what it needs).

Not real: SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``), its
``HiCacheController`` and its ``StorageMetricsCollector``. Their modules import
``sglang.srt.mem_cache.memory_pool`` / ``sglang.srt.configs``, whose ``__init__`` imports
``sglang/srt/multimodal/internvl_utils.py``, whose line 5 is ``import
torchvision.transforms``; torchvision's Linux wheels on PyPI link ``libtorch_cuda.so`` and
``libc10_cuda.so``, which the CPU torch build does not have, so that import fails on a
CPU-only machine (``docs/sglang.md`` has the chain). :class:`MHAHostPool` and
:class:`MLAHostPool` have the attributes and page methods of those classes that storage
backends use, with the same buffer shapes per layout: ``kv_buffer``, ``layout``,
``page_size``, ``size``, ``page_num``, ``dtype``, ``layer_num``,
``head_num``/``head_dim``/``v_head_dim`` (MHA), ``kv_lora_rank``/``qk_rope_head_dim``/
``kv_cache_dim`` (MLA), ``dcp_size``, ``alloc``, ``free``, ``get_data_page``,
``get_dummy_flat_data_page`` and ``set_from_flat_data_page``.

For hybrid models (the v2 interface), :class:`MambaHostPool` stands in for SGLang's
``MambaPoolHost`` (``sglang.srt.mem_cache.pool_host.mamba``, which imports the same
chain and, beyond it, ``transformers``): one state slot per host index (``page_size`` 1),
a float32 temporal state and bfloat16 conv states per slot in its ``page_first`` buffers,
and its ``get_data_page`` / ``get_dummy_flat_data_page`` / ``set_from_flat_data_page``,
which gather a slot into a fresh flat byte tensor and scatter it back. SGLang's SWA host
pool is an ``MHATokenToKVPoolHost`` over the sliding-window layers (``build_kv_host_pool``
in ``hybrid_pool_assembler.py``), so :class:`MHAHostPool` stands in for it too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import types
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_VERSION = "0.5.23"
MODULE_PATH = "kvtier.integrations.sglang"
CLASS_NAME = "KvtierHiCacheStorage"


def load_sglang() -> types.ModuleType:
    """Import SGLang's real ``hicache_storage`` module; raises ImportError if it cannot."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(
            f"SGLang is not installed: run scripts/install-sglang.sh "
            f"(pip install --no-deps sglang=={SGLANG_VERSION} and its import-time modules)"
        )
    return importlib.import_module("sglang.srt.mem_cache.hicache_storage")


def sglang_or_skip() -> types.ModuleType:
    """:func:`load_sglang`, skipping the test where SGLang is absent (failing if required)."""
    from kvtier.testing import require

    try:
        return load_sglang()
    except ImportError as exc:
        require("sglang", f"SGLang cannot be imported: {exc}")  # KVTIER_REQUIRE_SGLANG=1: fail
        raise  # not reached: require skipped or failed


# --- stand-in host pools --------------------------------------------------------------------


class _HostPool:
    """The parts of SGLang's HostKVCache that storage uses: sizes, allocator, page views."""

    layer_num: int
    kv_buffer: torch.Tensor

    def __init__(self, *, dtype: torch.dtype, page_size: int, pages: int, layout: str) -> None:
        self.dtype = dtype
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layout = layout
        self.dcp_size = 1
        self.device = "cpu"
        self.pin_memory = False
        self.kv_buffer = self.init_kv_buffer()
        self.free_slots = torch.arange(self.size, dtype=torch.int64)

    def init_kv_buffer(self) -> torch.Tensor:
        raise NotImplementedError

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Token indices of ``need_size // page_size`` whole pages (SGLang's host alloc)."""
        assert need_size % self.page_size == 0
        if need_size > len(self.free_slots):
            return None
        picked, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return picked

    def free(self, indices: torch.Tensor) -> int:
        self.free_slots = torch.cat([self.free_slots, indices.cpu()])
        return len(indices)

    def page_bytes(self) -> int:
        return self.get_dummy_flat_data_page().numel() * self.dtype.itemsize

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))

    def fill_random(self, index: int, seed: int) -> torch.Tensor:
        """Write random bytes into the page at token ``index``; returns a copy of them."""
        gen = torch.Generator().manual_seed(seed)
        page = torch.randint(0, 256, (self.page_bytes(),), dtype=torch.uint8, generator=gen)
        self.set_from_flat_data_page(index, page.view(self.dtype))
        return page

    def page_content(self, index: int) -> torch.Tensor:
        """A copy of the page at token ``index`` as flat bytes."""
        return self.get_data_page(index, flat=True).contiguous().view(torch.uint8).clone()

    def zero_page(self, index: int) -> None:
        self.get_data_page(index, flat=False).zero_()


class MHAHostPool(_HostPool):
    """Stand-in for SGLang's MHATokenToKVPoolHost (same kv_buffer shapes per layout)."""

    def __init__(
        self,
        *,
        layer_num: int = 4,
        head_num: int = 2,
        head_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        page_size: int = 16,
        pages: int = 32,
        layout: str = "page_first",
    ) -> None:
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        super().__init__(dtype=dtype, page_size=page_size, pages=pages, layout=layout)

    def init_kv_buffer(self) -> torch.Tensor:
        L, H, D, ps = self.layer_num, self.head_num, self.head_dim, self.page_size
        dims = {
            "layer_first": (2, L, self.size, H, D),
            "page_first": (2, self.size, L, H, D),
            "page_first_direct": (2, self.page_num, L, ps, H, D),
            "page_head": (2, self.page_num, H, ps, L, D),
        }[self.layout]
        return torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        ps = self.page_size
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + ps]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + ps]
        else:
            page = self.kv_buffer[:, index // ps : index // ps + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()


class MLAHostPool(_HostPool):
    """Stand-in for SGLang's MLATokenToKVPoolHost (same kv_buffer shapes per layout)."""

    def __init__(
        self,
        *,
        layer_num: int = 4,
        kv_lora_rank: int = 96,
        qk_rope_head_dim: int = 32,
        dtype: torch.dtype = torch.bfloat16,
        page_size: int = 16,
        pages: int = 32,
        layout: str = "page_first",
    ) -> None:
        self.layer_num = layer_num
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        super().__init__(dtype=dtype, page_size=page_size, pages=pages, layout=layout)

    def init_kv_buffer(self) -> torch.Tensor:
        L, D, ps = self.layer_num, self.kv_cache_dim, self.page_size
        dims = {
            "layer_first": (L, self.size, 1, D),
            "page_first": (self.size, L, 1, D),
            "page_first_direct": (self.page_num, L, ps, 1, D),
        }[self.layout]
        return torch.zeros(dims, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        ps = self.page_size
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index : index + ps]
        elif self.layout == "page_first":
            page = self.kv_buffer[index : index + ps]
        else:
            page = self.kv_buffer[index // ps : index // ps + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = (self.layer_num, self.page_size, 1, self.kv_cache_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()


class MambaHostPool:
    """Stand-in for SGLang's MambaPoolHost: state slots moved as flat byte pages."""

    def __init__(
        self,
        *,
        layers: int = 3,
        temporal_shape: tuple[int, ...] = (2, 8, 4),
        conv_shapes: tuple[tuple[int, ...], ...] = ((16, 3), (8, 3)),
        slots: int = 16,
        layout: str = "page_first",
        side_states: bool = False,
    ) -> None:
        assert layout in ("page_first", "page_first_direct")
        self.page_size = 1
        self.size = slots
        self.layout = layout
        self.device = "cpu"
        self.num_mamba_layers = layers
        self.temporal_dtype = torch.float32
        self.conv_dtype = torch.bfloat16
        self.dtype = self.conv_dtype
        self.temporal_buffer = torch.zeros((slots, layers, 1, *temporal_shape))
        self.conv_buffer = [
            torch.zeros((slots, layers, 1, *shape), dtype=self.conv_dtype) for shape in conv_shapes
        ]
        self.kv_buffer = [self.temporal_buffer, *self.conv_buffer]  # a list, as SGLang's
        #: registered slot side states (SGLang's ``slot_state_buffers``): no zero-copy meta
        self.slot_state_buffers = (
            [torch.zeros((slots, 6), dtype=torch.uint8)] if side_states else []
        )
        buffers = self.get_hybrid_pool_buffer()
        self.size_per_token = sum(b[0].numel() * b.element_size() for b in buffers)
        self.free_slots = torch.arange(slots, dtype=torch.int64)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_slots):
            return None
        picked, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return picked

    def _page_tensors(self, index: int) -> list[torch.Tensor]:
        return [
            self.temporal_buffer[index],
            *(conv[index] for conv in self.conv_buffer),
            *(state[index] for state in self.slot_state_buffers),
        ]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """Every host tensor a backend would register (SGLang's list, in its order)."""
        return [self.temporal_buffer, *self.conv_buffer, *self.slot_state_buffers]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(pointers, sizes)`` of each slot's states, temporal first (SGLang's zero-copy
        meta); refused with side states, as SGLang refuses."""
        if self.slot_state_buffers:
            raise NotImplementedError("Mamba storage zero-copy does not carry slot side states")
        ptrs, sizes = [], []
        for index in indices.tolist():
            for tensor in self._page_tensors(index):
                ptrs.append(tensor.data_ptr())
                sizes.append(tensor.numel() * tensor.element_size())
        return ptrs, sizes

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """A fresh flat byte tensor of the slot's states (SGLang's ``torch.cat``)."""
        return torch.cat(
            [t.contiguous().view(torch.uint8).reshape(-1) for t in self._page_tensors(index)]
        )

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        flat = data_page.contiguous().view(torch.uint8).reshape(-1)
        assert flat.numel() == self.page_size * self.size_per_token
        start = 0
        for tensor in self._page_tensors(index):
            n = tensor.numel() * tensor.element_size()
            tensor.copy_(flat[start : start + n].clone().view(tensor.dtype).reshape(tensor.shape))
            start += n

    def fill_random(self, index: int, seed: int) -> torch.Tensor:
        """Random (finite) state values in slot ``index``; returns its bytes."""
        gen = torch.Generator().manual_seed(seed)
        for tensor in self._page_tensors(index):
            tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
        return self.page_content(index)

    def page_content(self, index: int) -> torch.Tensor:
        return self.get_data_page(index).clone()

    def zero_page(self, index: int) -> None:
        for tensor in self._page_tensors(index):
            tensor.zero_()


# --- the cache controller's storage calls ----------------------------------------------------


def page_hashes(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """Chained SHA-256 hex page hashes, the form of SGLang's ``get_hash_str`` keys."""
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        h.update(torch.tensor(tokens[start : start + page_size], dtype=torch.int32).numpy())
        prior = h.hexdigest()
        out.append(prior)
    return out


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
    """The HiCacheStorageConfig SGLang's controller builds (``_generate_storage_config``)."""
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


@dataclass
class Controller:
    """What SGLang's HiCacheController does with a storage backend, call for call."""

    storage: Any
    config: Any
    pool: _HostPool
    zero_copy: bool

    @classmethod
    def attach(cls, config: Any, pool: _HostPool) -> Controller:
        """``attach_storage_backend``: factory, then host-pool registration, in that order."""
        load_sglang()
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        storage = StorageBackendFactory.create_backend("dynamic", config, pool)
        storage.register_mem_pool_host(pool)
        storage.register_mem_host_pool_v2(pool, PoolName.KV)  # HybridCacheController's KV entry
        storage.on_host_pools_registered()
        zero_copy = bool(config.extra_config.get("interface_v1", 0))
        return cls(storage, config, pool, zero_copy)

    def _batches(self, hashes: list[str]) -> list[tuple[int, list[str]]]:
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

        return [
            (i, hashes[i : i + STORAGE_BATCH_SIZE])
            for i in range(0, len(hashes), STORAGE_BATCH_SIZE)
        ]

    def backup(self, hashes: list[str], host_indices: torch.Tensor) -> int:
        """``_page_backup`` from the backup thread; returns the completed tokens."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        if not self.config.is_storage_writer:  # backup_skip
            return 0
        ps, done, prefix = self.pool.page_size, 0, []
        for i, batch in self._batches(hashes):
            indices = host_indices[i * ps : (i + len(batch)) * ps]
            info = HiCacheStorageExtraInfo(prefix_keys=list(prefix))
            if self.zero_copy:
                ok = all(self.storage.batch_set_v1(batch, indices, info))
            else:
                data = [self.pool.get_data_page(indices[j * ps]) for j in range(len(batch))]
                ok = self.storage.batch_set(batch, data)
            if not ok:
                break
            prefix += batch
            done += ps * len(batch)
        return done

    def hit_query(self, hashes: list[str]) -> list[str]:
        """``_storage_hit_query`` from the prefetch thread: the hashes of the stored prefix."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        found: list[str] = []
        prefix: list[str] = []
        for _, batch in self._batches(hashes):
            hits = self.storage.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix))
            found += batch[:hits]
            if hits < len(batch):
                break
            prefix = prefix + batch
        return found

    def prefetch(self, hashes: list[str], host_indices: torch.Tensor) -> int:
        """``_page_transfer`` from the prefetch I/O thread; returns the completed pages."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        ps, completed = self.pool.page_size, 0
        for i, batch in self._batches(hashes):
            indices = host_indices[i * ps : (i + len(batch)) * ps]
            info = HiCacheStorageExtraInfo(prefix_keys=hashes[:i])
            if self.zero_copy:
                results = self.storage.batch_get_v1(batch, indices, info)
            else:
                dummies = [self.pool.get_dummy_flat_data_page() for _ in batch]
                pages = self.storage.batch_get(batch, dummies)
                results = []
                for j, page in enumerate(pages):
                    if page is not None:
                        self.pool.set_from_flat_data_page(int(indices[j * ps]), page)
                    results.append(page is not None)
            hits = results.index(False) if False in results else len(results)
            completed += hits
            if hits < len(batch):
                break
        return completed
