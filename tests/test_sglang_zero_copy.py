"""Every built-in backend behind SGLang's v1 path: bit-exact, and zero-copy where declared.

SGLang's own host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, on the CPU)
and its ``HiCacheController``, whose backup and prefetch threads make the calls
(``sglang_host_pool.Controller``). The adapter serves SGLang's own host-pool memory to the
backend. Backends that read and
write extents in place (file, uring) need nothing more; Mooncake needs that memory
registered, which ``open_page_store`` does through the pool's ``memory_regions()``, so no
page goes through Mooncake's staging buffer. Mooncake runs against a real master on
loopback (``kvtier.testing.mooncake``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_host_pool import (
    CLASS_NAME,
    MODULE_PATH,
    Controller,
    fill_random,
    is_mla,
    mha_host_pool,
    mla_host_pool,
    page_content,
    page_hashes,
    sglang_or_skip,
    storage_config,
)

from kvtier.core.specs import Feature
from kvtier.plugins.manager import default_registry
from kvtier.testing import require
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

sglang_or_skip()

ALL_BACKENDS = ["memory", "file", "uring", "segment", "mooncake"]


def _require(name: str) -> None:
    if name == "uring":
        from kvtier.backends.uring import URING_SPEC

        require(name, URING_SPEC.unavailable_reason())  # KVTIER_REQUIRE_URING
    elif name == "mooncake":
        require(name, mooncake_unavailable_reason())  # KVTIER_REQUIRE_MOONCAKE


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """One master plus a 256 MiB storage node on loopback for this module."""
    _require("mooncake")
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=256 << 20).start()
    try:
        yield master
    finally:
        master.close()


def _options(name: str, request: pytest.FixtureRequest, root: Path) -> dict[str, Any]:
    if name in ("file", "uring", "segment"):
        return {"root": str(root)}
    if name == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        return {"master_address": master.address, "global_segment_size": 0}
    return {}


@pytest.fixture(params=ALL_BACKENDS)
def controller_for(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Attach kvtier to a host pool through SGLang's loader, on the parametrized backend."""
    name = str(request.param)
    _require(name)
    made: list[Controller] = []

    def make(pool: Any) -> Controller:
        extra = {
            "backend_name": "kvtier",
            "module_path": MODULE_PATH,
            "class_name": CLASS_NAME,
            "interface_v1": 1,
            "kvtier": {"backend": name, "extra_config": _options(name, request, tmp_path)},
        }
        cfg = storage_config(extra_config=extra, is_mla=is_mla(pool), layout=pool.layout)
        controller = Controller.attach(cfg, pool)
        made.append(controller)
        return controller

    make.backend = name  # type: ignore[attr-defined]
    yield make
    for controller in made:
        controller.close()


def _zero_copy(name: str) -> bool:
    return Feature.ZERO_COPY in default_registry().backends[name].features


@pytest.mark.parametrize(
    "pool_factory",
    [
        lambda: mha_host_pool(layout="page_first"),
        lambda: mha_host_pool(layout="layer_first"),
        lambda: mla_host_pool(layout="page_first_direct"),
    ],
    ids=["mha-page_first", "mha-layer_first", "mla-page_first_direct"],
)
def test_round_trip_is_bit_exact_and_unstaged(
    controller_for: Any, pool_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pool = pool_factory()
    with caplog.at_level(logging.WARNING):
        controller = controller_for(pool)
        count = 4
        indices = pool.alloc(count * pool.page_size)
        data = [fill_random(pool, int(indices[i * pool.page_size]), 40 + i) for i in range(count)]
        hashes = page_hashes(list(range(1000, 1000 + count * pool.page_size)), pool.page_size)
        assert controller.backup(hashes, indices) == count * pool.page_size
        target = pool.alloc(count * pool.page_size)
        assert controller.prefetch(controller.hit_query(hashes), target) == count
    for i, expected in enumerate(data):
        assert torch.equal(page_content(pool, int(target[i * pool.page_size])), expected)
    stats = controller.storage.kvtier_stats()
    assert stats["hits"] == count and stats["invalid"] == 0
    if _zero_copy(controller_for.backend):
        assert stats.get("backend_staged_pages", 0) == 0, stats
        assert not [r for r in caplog.records if "staging buffer" in r.getMessage()]
    if controller_for.backend == "mooncake":
        # SGLang's kv_buffer and the adapter's envelope slab, registered once each
        assert stats["backend_registered_regions"] >= 2, stats
