"""The GPU check's pieces, proven on the CPU: both benchmarks run, print the JSON lines the
check collects and move every byte right; the engine loop loads what it saved; the check
script parses. The same code runs unchanged on CUDA (scripts/gpu-check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.core.errors import InvalidFieldError
from kvtier.testing.engine_loop import MODES, EngineLoop, LoopShape

ROOT = Path(__file__).resolve().parents[1]
LINE_KEYS = {"bench", "case", "ours", "baseline", "baseline_name", "unit", "ratio", "target"}


def _run(script: str, *args: str) -> list[dict[str, Any]]:
    """Run a benchmark on the CPU at its quick size; its JSON lines (it must exit 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVTIER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(text) for text in proc.stdout.splitlines() if text.strip()]
    assert lines, proc.stderr[-3000:]
    return lines


def test_the_transfer_benchmark_covers_every_backend_layout_and_operation() -> None:
    lines = _run("gpu.py")
    cases = [r for r in lines if not r["case"].startswith(("best ", "summary"))]
    assert {(r["io"], r["layout"], r["op"]) for r in cases} == {
        (io, layout, op)
        for io in ("direct", "kernel")
        for layout in ("layer_first", "page_first", "page_first_direct", "page_head")
        for op in ("backup_all", "load_all", "backup_layer", "load_layer")
    }
    for record in cases:
        assert record.keys() >= LINE_KEYS, record
        assert record["wrong_bytes"] == 0, record
        assert record["ours"] > 0 and record["baseline"] > 0 and record["unit"] == "GB/s"
    best = [r for r in lines if r["case"].startswith("best ")]
    assert {r["op"] for r in best} == {"backup_all", "load_all", "backup_layer", "load_layer"}
    assert all(r["target"] == 0.8 for r in best)
    (summary,) = [r for r in lines if r["case"] == "summary"]
    assert summary["wrong_bytes"] == 0 and summary["cases"] == 32
    assert set(summary["best"]) == {"backup_all", "load_all", "backup_layer", "load_layer"}


def test_the_engine_loop_benchmark_reports_the_hidden_fraction_and_right_bytes() -> None:
    lines = _run("engine_loop.py", "--reps", "3", "--io-backend", "direct")
    steps = [r for r in lines if r["case"].startswith("step ")]
    assert [r["case"].split()[1] for r in steps] == ["sync", "overlap"]
    for record in steps:
        assert record.keys() >= LINE_KEYS, record
        assert record["wrong_bytes"] == 0 and record["checked_steps"] == 4  # 1 warm-up + 3
        assert record["io"] == "direct"
    (summary,) = [r for r in lines if r["case"] == "summary"]
    assert summary["wrong_bytes"] == 0 and summary["load_errors"] == []
    assert isinstance(summary["hidden_fraction"], float)
    assert summary["t_none_ms"] > 0 and summary["t_sync_ms"] > 0 and summary["t_overlap_ms"] > 0
    assert summary["load_hit_pages"] == 8 * 8  # 8 loading steps of 8 pages each


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_one_step_loads_exactly_the_saved_bytes(mode: str) -> None:
    loop = EngineLoop(LoopShape(layers=3, num_blocks=16, load_pages=4), "cpu", seed=7)
    try:
        loop.save_prefix()
        loop.clear_load_blocks()
        assert loop.wrong_bytes() > 0  # the check sees an unloaded block
        seconds = loop.step(mode)  # type: ignore[arg-type]
        assert seconds > 0
        assert loop.wrong_bytes() == 0
        assert loop.load_errors() == set()
        assert loop.worker.stats()["load_hit_pages"] == 4
    finally:
        loop.close()


def test_the_overlapped_step_loads_each_layer_at_its_own_wait() -> None:
    """Layer i's bytes arrive at wait_for_layer_load(i), not before: what lets the copy of
    layer i + 1 run under layer i's compute on a GPU."""
    loop = EngineLoop(LoopShape(layers=3, num_blocks=16, load_pages=4), "cpu", seed=3)
    try:
        loop.save_prefix()
        loop.clear_load_blocks()
        blocks = torch.tensor(loop.load_blocks)
        from kvtier.integrations.vllm.messages import PageOp

        loop.worker.start_loads([PageOp("q", loop.keys, loop.load_blocks, 0)])
        loop.worker.wait_layer(loop.names[0])
        first, last = (loop.kv_caches[loop.names[i]].index_select(0, blocks) for i in (0, 2))
        assert torch.equal(first.view(torch.int16), loop.expected[loop.names[0]])
        assert not last.view(torch.int16).any()
        for name in loop.names[1:]:
            loop.worker.wait_layer(name)
        loop.worker.end_step([])
        assert loop.wrong_bytes() == 0
    finally:
        loop.close()


def test_the_loop_rotates_the_modes_and_checks_every_loading_step() -> None:
    loop = EngineLoop(LoopShape(layers=2, num_blocks=8, load_pages=2), "cpu")
    seen: list[tuple[str, int]] = []
    try:
        loop.save_prefix()
        times = loop.run_modes(3, warmup=0, check=lambda mode, wrong: seen.append((mode, wrong)))
    finally:
        loop.close()
    assert {m: len(v) for m, v in times.seconds.items()} == dict.fromkeys(MODES, 3)
    assert sorted(seen) == sorted([("sync", 0), ("overlap", 0)] * 3)


def test_bad_shapes_and_modes_are_refused_by_name() -> None:
    with pytest.raises(InvalidFieldError, match="num_blocks"):
        EngineLoop(LoopShape(num_blocks=8, load_pages=8), "cpu")
    with pytest.raises(InvalidFieldError, match="hidden"):
        EngineLoop(LoopShape(hidden=0), "cpu")
    loop = EngineLoop(LoopShape(layers=2, num_blocks=8, load_pages=2), "cpu")
    try:
        with pytest.raises(InvalidFieldError, match="save_prefix"):
            loop.step("overlap")
        with pytest.raises(InvalidFieldError, match="mode"):
            loop.step("fast")  # type: ignore[arg-type]
    finally:
        loop.close()


def test_the_check_scripts_parse() -> None:
    for script in ("gpu-check.sh", "fetch-gpu-wheels.sh"):
        proc = subprocess.run(
            ["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True
        )
        assert proc.returncode == 0, (script, proc.stderr)


def test_the_gpu_wheels_are_ignored_not_committed() -> None:
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()
