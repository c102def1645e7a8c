"""A preemption whose store outlives ``preempt_wait_s``, in a real vLLM engine (CPU build).

The tight engine of ``tests/test_vllm_production.py`` (32 KV blocks, chunked prefill)
preempts requests of a crowd of four while every store lags 1 s behind
(``save_delay_s``), a preemption reaches the worker once the writer took the request's
stores (``preempt_after_pickup_s``, a test hook) and waits 0.05 s at most, so a
preempted request's store is still running when vLLM reuses its blocks: the store is
tainted (its guard tripped, its pages never valid from the reused blocks, removed once
the call returns). The same engine, then a second engine on the same root (another
reader of the shared store), load the crowd's prompts again from kvtier: their tokens
are those of an engine without a connector, so no page of the reused blocks was loaded
under the old keys.
(``tests/test_preempted_saves.py`` reads in the window between the publish and the
delete, at the worker level.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm import Engine, _phases, _vllm_python
from test_vllm_production import CROWD, CROWD_TOKENS, RESET, TIGHT, _build, _delta

WAIT_S = 0.05
#: Stores lag 1 s, and a preemption comes once the writer took the request's stores.
LAGGING = {"save_delay_s": 1.0, "preempt_after_pickup_s": 5.0}
PROMPT = {"save_delay_s": 0, "preempt_after_pickup_s": 0}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    python = _vllm_python()
    model = _build(python, tmp_path_factory.mktemp("tiny-llama"), "llama")
    return Engine(python, model, tmp_path_factory.mktemp("vllm-preempted-jobs"))


def _job(root: Path, phases: list[dict[str, Any]], **job: Any) -> dict[str, Any]:
    section = {
        "backend": "file",
        "extra_config": {"root": str(root)},
        "preempt_wait_s": WAIT_S,
    }
    return {"connector": "kvtier", "kvtier": section, "phases": phases, "log_stats": True, **job}


def test_a_store_outliving_its_preemption_wait_is_never_loaded(
    llama: Engine, tmp_path: Path
) -> None:
    root = tmp_path / "shared"
    crowd = {"prompts": CROWD, "max_tokens": CROWD_TOKENS}
    baseline = _phases(llama.run({"connector": None, "phases": [{"name": "crowd", **crowd}]}))
    first = _phases(
        llama.run(
            _job(
                root,
                [
                    {"name": "crowd", **crowd, "hooks": LAGGING},
                    {"name": "again", **crowd, **RESET, "hooks": PROMPT},
                ],
                hooks={},
                **TIGHT,
            )
        )
    )
    expected = baseline["crowd"]["tokens"]
    assert first["crowd"]["tokens"] == expected
    scheduler = first["crowd"]["scheduler"]
    worker = first["crowd"]["worker"]
    assert scheduler["requests_preempted"] >= 1
    # a store of a preempted request still ran past the wait: tainted, and the page store
    # reported its pages not stored (none written from the reused blocks as valid)
    assert worker["preempt_wait_timeouts"] >= 1
    assert worker["save_tainted_pages"] >= 1
    assert worker["store_put_tainted"] >= 1
    # the same engine, its own prefix cache emptied, loads what kvtier kept
    assert first["again"]["tokens"] == expected
    again = _delta(first, "again", "crowd", "worker")
    assert again("load_hit_pages") >= 1
    # a second engine on the same store
    second = _phases(llama.run(_job(root, [{"name": "reader", **crowd}], **TIGHT)))
    assert second["reader"]["tokens"] == expected
    assert second["reader"]["worker"]["load_hit_pages"] >= 1
