"""``kvtier bench --workload multiturn`` and the simulated KV it verifies pages with."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from test_cache import cache_registry

from kvtier import bench_multiturn
from kvtier._cache_sim import check_pages, fill_pages
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import ConfigError

SMALL = [
    "--backend",
    "memory",
    "--num-layers",
    "2",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "16",
    "--page-size",
    "4",
    "--conversations",
    "3",
    "--turns",
    "3",
    "--system-tokens",
    "8",
    "--turn-tokens",
    "8",
]


def parse(argv: list[str]) -> argparse.Namespace:
    """kvtier bench's shared options plus the multiturn ones, as the CLI builds them."""
    parser = argparse.ArgumentParser()
    try:
        from kvtier import bench

        bench.add_arguments(parser)
    except ImportError:  # kvtier.bench not in this build: the workload has its own defaults
        for flag in ("--backend", "--num-layers", "--num-kv-heads", "--head-dim", "--page-size"):
            parser.add_argument(flag, type=str if flag == "--backend" else int)
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--no-progress", action="store_true")
    if parser.get_default("conversations") is None:
        bench_multiturn.add_arguments(parser)
    return parser.parse_args(argv)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_simulated_pages_detect_a_flipped_byte() -> None:
    geometry = load_engine_config(
        {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 4}
    ).geometry()
    pool = TorchDevicePool(geometry, 32)
    keys = ["page-a", "page-b", "page-c"]
    where = torch.tensor([20, 21, 22, 23, 0, 1, 2, 3, 8, 9, 10, 11])
    fill_pages(pool, keys, where)
    assert check_pages(pool, keys, where) == [True, True, True]
    pool.kv_tensors[1][1, 2].view(torch.uint8)[0, 5] ^= 1  # slot 2 is in page-b
    assert check_pages(pool, keys, where) == [True, False, True]
    assert check_pages(pool, ["page-c"], where[:4]) == [False]  # another key's bytes


def test_multiturn_runs_end_to_end_and_reports_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse([*SMALL, "--json", "--no-progress"])
    assert bench_multiturn.run(args, registry=cache_registry()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["mismatched_pages"] == 0
    assert report["turns"] == 9
    rates = report["hit_rate"]
    assert rates["host"] + rates["storage"] > 0
    assert abs(rates["host"] + rates["storage"] + rates["recomputed"] - 1.0) < 1e-3
    assert report["bytes"]["host_to_device"] > 0
    assert report["bytes"]["storage_write"] > 0
    assert report["throughput_gbps"] > 0
    assert set(report["failures"]) <= {"host_exhausted"}  # a busy host may pin the pool


def test_multiturn_reads_from_storage_when_host_pool_is_small() -> None:
    args = parse([*SMALL, "--host-pages", "6", "--no-progress"])
    result = bench_multiturn.run_multiturn(args, registry=cache_registry())
    assert result.ok
    assert result.to_dict()["hit_rate"]["storage"] > 0


def test_progress_bar_only_on_a_terminal() -> None:
    tty = FakeTTY()
    bench_multiturn.run_multiturn(parse(SMALL), registry=cache_registry(), progress_stream=tty)
    assert "multiturn [" in tty.getvalue() and "9/9 turns" in tty.getvalue()
    plain = io.StringIO()
    bench_multiturn.run_multiturn(parse(SMALL), registry=cache_registry(), progress_stream=plain)
    assert plain.getvalue() == ""


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    args = parse([*SMALL, "--plot", str(tmp_path / "run.png")])
    with pytest.raises(ConfigError, match=r"matplotlib.*kvtier\[plot\]"):
        bench_multiturn.run_multiturn(args, registry=cache_registry())
    assert not (tmp_path / "run.png").exists()


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="needs the 'plot' extra (matplotlib)")
    target = tmp_path / "run.png"
    args = parse([*SMALL, "--no-progress", "--plot", str(target)])
    assert bench_multiturn.run_multiturn(args, registry=cache_registry()).ok
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_workload_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--turns"):
        bench_multiturn.run_multiturn(parse([*SMALL, "--turns", "0"]), registry=cache_registry())


def test_kvtier_bench_workload_multiturn_through_the_cli(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier import cli

    code = cli.main(["bench", "--workload", "multiturn", *SMALL, "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["workload"] == "multiturn" and report["ok"]


def test_kvtier_bench_plot_error_through_the_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvtier import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["bench", "--workload", "multiturn", *SMALL, "--plot", str(tmp_path / "x.png")]
    assert cli.main(argv) == 2
    assert "kvtier[plot]" in capsys.readouterr().err
