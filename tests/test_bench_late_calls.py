"""``kvtier bench``: a storage call that times out stops the run, its host pages untouched.

The bench reuses its host pages every round. A call past the bound may still read or fill
them when it resumes, so no later round may use them: the run stops with an error that
says so, and the late call keeps the run's memory alive until it returns.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_bench import bench_args
from test_cache import shared_backend

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.bench import single
from kvtier.core.errors import StorageError
from kvtier.testing.faults import CallGate

BOUND_S = 0.3


@pytest.mark.parametrize("op", ["put", "get"])
def test_bench_stops_when_a_call_times_out(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = MemoryBackend(MemoryConfig())
    original = single.open_page_store

    def bounded(plan: Any, host: Any, **kwargs: Any) -> Any:
        return original(plan, host, **{**kwargs, "backend_call_timeout_s": BOUND_S})

    monkeypatch.setattr(single, "open_page_store", bounded)
    gate = CallGate(backend, op).install()
    try:
        with pytest.raises(StorageError, match=f"a {op} of host pages 0..3 did not return"):
            single.run_bench(
                bench_args("--backend", "shared", "--batch", "4", "--no-progress"),
                registry=shared_backend(backend),
            )
        assert gate.stalled == 1
    finally:
        gate.remove()
    assert gate.wait_returned(30.0)
