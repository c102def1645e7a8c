"""SGLang: a storage call that times out and completes late never lands in reused memory.

A backend call past ``backend_call_timeout_s`` reports False and may still read or fill
the pages it was given when it resumes. SGLang takes its host pages back as soon as the
adapter returns, so a late get must not fill them (a bounded get is staged through
kvtier's scratch pages), a late put must not publish what SGLang wrote there since (it is
guarded: the page never verifies), and kvtier's own scratch pages (the generic path's,
a by-value state pool's) stay out of reuse until the call returns (``scratch_pages_quarantined``).
Each case stalls a real backend with :class:`~kvtier.testing.faults.CallGate`, reuses the
memory as SGLang would, lets the stalled call complete, and checks every byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    page_content,
    sglang_or_skip,
    storage_config,
)
from sglang_host_pool import mha_host_pool as MHAHostPool
from sglang_host_pool import mla_host_pool as MLAHostPool

from kvtier.testing.faults import CallGate

hs = sglang_or_skip()

from test_sglang import _fill, _hashes, _starts  # noqa: E402
from test_sglang_v2 import MAMBA, TRAILING, Hybrid, _store  # noqa: E402
from test_sglang_v2 import _hashes as _hybrid_hashes  # noqa: E402

#: The call bound of these tests: short, so a stalled call times out at once.
BOUND_S = 0.3
#: How long a test waits for a gated call (it never waits this long when all is well).
WAIT_S = 30.0


def _extra(root: Path, *, zero_copy: bool = True, bound: float | None = BOUND_S) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "backend_name": "kvtier",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "kvtier": {
            "backend": "file",
            "extra_config": {"root": str(root)},
            "backend_call_timeout_s": bound,
        },
    }
    if zero_copy:
        extra["interface_v1"] = 1
    return extra


@pytest.fixture
def attach() -> Iterator[Callable[[Any, dict[str, Any]], Controller]]:
    """Attach kvtier to a host pool as SGLang does; every controller is closed afterwards."""
    made: list[Controller] = []

    def make(pool: Any, extra: dict[str, Any]) -> Controller:
        config = storage_config(extra_config=extra, is_mla=is_mla(pool), layout=pool.layout)
        made.append(Controller.attach(config, pool))
        return made[-1]

    yield make
    for controller in made:
        controller.close()


def _reuse(pool: Any, starts: list[int], seed: int) -> list[torch.Tensor]:
    """Fill host pages with other bytes, as SGLang does with pages it took back."""
    return [fill_random(pool, start, seed + i) for i, start in enumerate(starts)]


def _backend(storage: Any, pool: str = "kv") -> Any:
    """The backend object behind a pool's first tier (where a gate goes)."""
    attached = storage._require() if pool == "kv" else storage._pool(pool)
    return attached.store.tiers[0].store.backend


def _stalled(gate: CallGate) -> None:
    assert gate.wait_stalled(WAIT_S), "the gated call never started"


def _returned(gate: CallGate) -> None:
    gate.release()
    assert gate.wait_returned(WAIT_S), "the late call never returned"


def test_sglang_late_get_never_fills_a_host_page_sglang_reused(attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool(layout="page_first")
    controller = attach(pool, _extra(tmp_path / "store"))
    storage = controller.storage
    indices, stored = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    assert storage.batch_set_v1(hashes, indices) == [True, True]
    target = pool.alloc(2 * pool.page_size)
    with CallGate(_backend(storage), "get") as gate:
        assert storage.batch_get_v1(hashes, target) == [False, False]
        _stalled(gate)
        # SGLang frees the pages of the failed prefetch and backs up other data into them
        reused = [
            fill_random(pool, start, 100 + i) for i, start in enumerate(_starts(pool, target))
        ]
        _returned(gate)
    for start, expected, old in zip(_starts(pool, target), reused, stored, strict=True):
        got = page_content(pool, start)
        assert not torch.equal(got, old), "the late get wrote the stored page into SGLang's"
        assert torch.equal(got, expected)
    stats = storage.kvtier_stats()
    assert stats["backend_timeouts_get"] == 1
    assert stats["scratch_pages_quarantined"] == 2  # kvtier's scratch pages, held for the late read
    assert storage._require().pages.scratch_held() == 0  # released once it returned
    # a get in time is staged and still bit-exact
    again = pool.alloc(2 * pool.page_size)
    assert storage.batch_get_v1(hashes, again) == [True, True]
    for start, expected in zip(_starts(pool, again), stored, strict=True):
        assert torch.equal(page_content(pool, start), expected)
    assert storage.kvtier_stats()["pages_staged"] == 2


def test_sglang_late_put_never_publishes_what_sglang_wrote_since(
    attach: Any, tmp_path: Path
) -> None:
    pool = MHAHostPool(layout="page_first")
    controller = attach(pool, _extra(tmp_path / "store"))
    storage = controller.storage
    indices, _ = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    with CallGate(_backend(storage), "put") as gate:
        assert storage.batch_set_v1(hashes, indices) == [False, False]
        _stalled(gate)
        # the backup failed: SGLang evicts the host pages and fills them with another prefix
        reused = [
            fill_random(pool, start, 200 + i) for i, start in enumerate(_starts(pool, indices))
        ]
        _returned(gate)
    target = pool.alloc(2 * pool.page_size)
    results = storage.batch_get_v1(hashes, target)
    for start, ok, other in zip(_starts(pool, target), results, reused, strict=True):
        # the late write landed (the file backend seals each page as it writes it) but
        # never verifies: no key loads the bytes SGLang wrote there after the timeout
        assert not ok or not torch.equal(page_content(pool, start), other)
    assert results == [False, False]
    stats = storage.kvtier_stats()
    assert stats["backend_timeouts_put"] == 1
    assert stats["puts"] == 0 and stats["invalid"] >= 1
    # the store keeps working: the same keys stored in time load bit-exact
    assert storage.batch_set_v1(hashes, indices) == [True, True]
    assert storage.batch_get_v1(hashes, target) == [True, True]
    for start, expected in zip(_starts(pool, target), reused, strict=True):
        assert torch.equal(page_content(pool, start), expected)


def test_sglang_unbounded_calls_stay_zero_copy(attach: Any, tmp_path: Path) -> None:
    pool = MHAHostPool(layout="page_first")
    controller = attach(pool, _extra(tmp_path / "store", bound=None))
    storage = controller.storage
    indices, stored = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    assert storage.batch_set_v1(hashes, indices) == [True, True]
    target = pool.alloc(2 * pool.page_size)
    assert storage.batch_get_v1(hashes, target) == [True, True]
    for start, expected in zip(_starts(pool, target), stored, strict=True):
        assert torch.equal(page_content(pool, start), expected)
    stats = storage.kvtier_stats()
    assert stats["pages_staged"] == 0 and stats["hits"] == 2


def test_sglang_generic_path_holds_its_scratch_pages_for_a_late_get(
    attach: Any, tmp_path: Path
) -> None:
    pool = MHAHostPool(layout="layer_first")
    controller = attach(pool, _extra(tmp_path / "store", zero_copy=False))
    storage = controller.storage
    indices, stored = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    values = [pool.get_data_page(start) for start in _starts(pool, indices)]
    assert storage.batch_set(hashes, values) is True
    pages = storage._require().pages
    targets = [pool.get_dummy_flat_data_page() for _ in hashes]
    with CallGate(_backend(storage), "get") as gate:
        assert storage.batch_get(hashes, targets) == [None, None]
        _stalled(gate)
        # the tensors the late read fills stay registered (alive) until it returns
        assert pages.scratch_held() == 2
        assert storage.kvtier_stats()["scratch_pages_quarantined"] == 2
        _returned(gate)
    assert pages.scratch_held() == 0
    # the late read landed in the held tensors, nowhere else
    for target, expected in zip(targets, stored, strict=True):
        assert torch.equal(target.view(torch.uint8), expected)


def test_sglang_generic_late_put_never_publishes_reused_bytes(attach: Any, tmp_path: Path) -> None:
    pool = MLAHostPool(layout="page_first_direct")
    controller = attach(pool, _extra(tmp_path / "store", zero_copy=False))
    storage = controller.storage
    indices, _ = _fill(pool, 2)
    hashes = _hashes(2, pool.page_size)
    # MLA, page_first_direct: SGLang's flat data page is a view of its host pool
    values = [pool.get_data_page(start) for start in _starts(pool, indices)]
    assert all(
        v.data_ptr() == pool.get_data_page(s).data_ptr()
        for v, s in zip(values, _starts(pool, indices), strict=True)
    )
    with CallGate(_backend(storage), "put") as gate:
        assert storage.batch_set(hashes, values) is False
        _stalled(gate)
        reused = [
            fill_random(pool, start, 300 + i) for i, start in enumerate(_starts(pool, indices))
        ]
        _returned(gate)
    targets = [pool.get_dummy_flat_data_page() for _ in hashes]
    got = storage.batch_get(hashes, targets)
    for page, other in zip(got, reused, strict=True):
        assert page is None or not torch.equal(page.view(torch.uint8), other)
    assert got == [None, None]


def test_sglang_by_value_state_pages_are_held_for_a_late_get(tmp_path: Path) -> None:
    section = {
        "backend": "file",
        "extra_config": {"root": str(tmp_path / "store")},
        "backend_call_timeout_s": BOUND_S,
    }
    h = Hybrid("file", tmp_path / "store", side_states=True, section=section)
    try:
        mamba = h.storage._pool(MAMBA)
        assert not mamba.in_place
        hashes = _hybrid_hashes(4)
        data = _store(h, hashes)
        slot = h.mamba.alloc(2)
        before = [page_content(h.mamba, int(s)) for s in slot]
        transfer = hs.PoolTransfer(
            name=MAMBA, host_indices=slot, keys=hashes[1::2], hit_policy=TRAILING
        )
        with CallGate(_backend(h.storage, MAMBA), "get") as gate:
            assert h.storage.batch_get_v2([transfer]) == {MAMBA: [False, False]}
            _stalled(gate)
            # the flat pages the late read fills are kvtier's: kept until it returns
            assert mamba.pages.held() == 2
            assert h.storage.kvtier_stats()["mamba_scratch_pages_quarantined"] == 2
            _returned(gate)
        assert mamba.pages.held() == 0
        # nothing reached SGLang's slots from the late read
        for s, old in zip(slot, before, strict=True):
            assert torch.equal(page_content(h.mamba, int(s)), old)
        # in time, the same get loads the stored states
        assert h.storage.batch_get_v2([transfer]) == {MAMBA: [True, True]}
        for i, s in enumerate(slot):
            assert torch.equal(page_content(h.mamba, int(s)), data["mamba"][i])
    finally:
        h.close()
