"""``kvtier bench``: the single workload (the README's main job: the file backend with the
segment store beside it by default), the multiturn workload, and the simulated KV the
latter verifies pages with."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from test_cache import cache_registry

from kvtier import bench
from kvtier.bench import multiturn as bench_multiturn
from kvtier.bench import single
from kvtier.bench.progress import Progress
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import ConfigError
from kvtier.testing.content import check_pages, fill_pages

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
    bench.add_arguments(parser)
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
    args = parse([*SMALL, "--workload", "multiturn", "--json", "--no-progress"])
    assert bench.run(args, registry=cache_registry()) == 0
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


def test_progress_bar_on_a_terminal_plain_lines_elsewhere() -> None:
    tty = FakeTTY()
    bench_multiturn.run_multiturn(parse(SMALL), registry=cache_registry(), progress_stream=tty)
    assert "multiturn [" in tty.getvalue() and "9/9 turns" in tty.getvalue()
    plain = io.StringIO()
    bench_multiturn.run_multiturn(parse(SMALL), registry=cache_registry(), progress_stream=plain)
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue()
    assert lines[0] == "kvtier bench multiturn: started, 9 turns to go"
    assert lines[-1].startswith("kvtier bench multiturn: finished, 9/9 turns in ")
    quiet = io.StringIO()
    args = parse([*SMALL, "--no-progress"])
    bench_multiturn.run_multiturn(args, registry=cache_registry(), progress_stream=quiet)
    assert quiet.getvalue() == ""


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


# --- the single workload (the README's main job) ------------------------------------

SINGLE = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--page-size", "16"]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([*SINGLE, "--pages", "6", "--rounds", "1", *argv])


def test_bench_round_trip_verifies_and_reports(tmp_path: Path) -> None:
    result = single.run_bench(bench_args("--batch", "4", "--workdir", str(tmp_path)))
    out = result.to_dict()
    assert out["ok"] is True and out["failures"] == []
    assert out["backend"] == "file" and out["pages"] == 6 and out["batch"] == 4
    assert out["stored_bytes_per_page"] == out["page_bytes"] + 4096
    paths = ("put", "get", "raw_put", "raw_get", "raw_put_threads", "raw_get_threads")
    for name in (*paths, "device_to_host", "host_to_device"):
        assert out[name]["gbps"] > 0 and out[name]["p99_ms"] >= out[name]["p50_ms"] >= 0
    assert set(out["ratio"]) == set(out["ratio_threads"]) == {"put", "get"}
    assert out["raw_threads"] == 4  # the file backend's io_threads
    assert out["store_stats"]["hits"] == 12 and out["store_stats"]["invalid"] == 0
    assert list(tmp_path.iterdir()) == []  # the temporary pages are gone
    assert "bit-exact" in result.report()


def test_bench_runs_on_the_segment_backend(tmp_path: Path) -> None:
    # the main job beside the file backend: the same pages, packed into segments
    result = single.run_bench(
        bench_args("--backend", "segment", "--batch", "3", "--workdir", str(tmp_path))
    )
    out = result.to_dict()
    assert out["ok"] is True and out["failures"] == [] and out["backend"] == "segment"
    assert out["raw_threads"] == 4  # the segment backend's io_threads
    assert out["store_stats"]["hits"] == 12 and out["store_stats"]["invalid"] == 0
    assert out["backend_stats"]["write_calls"] == 4  # one record per batch put, 2 rounds
    assert list(tmp_path.iterdir()) == []


def test_bench_json_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(bench_args("--json", "--no-raw", "--layout", "layer_first")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "layer_first" and "ratio" not in out and out["ok"]


def test_bench_reports_failed_pages_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    # a memory backend too small for one page: every put fails, nothing comes back
    args = bench_args("--backend", "memory", "--extra-config", '{"capacity_bytes": 1024}')
    assert bench.run(args) == 1
    assert "put of page 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--extra-config", '{"root": '], "extra-config"),
        (["--extra-config", '{"fsycn": "page"}'], "fsync"),
        (["--kv-lora-rank", "64"], "MLA geometry option"),
        (["--backend", "fiel"], "did you mean 'file'"),
        (["--pages", "0"], "--pages"),
    ],
)
def test_bench_rejects_bad_options_before_running(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        single.run_bench(bench_args(*argv))


def test_bench_progress_bar_on_a_terminal() -> None:
    tty = FakeTTY()
    bar = Progress(4, tty, enabled=True)
    for _ in range(4):
        bar.step("put")
    bar.close()
    assert "100%" in tty.getvalue() and "put" in tty.getvalue()
    assert "\n" not in tty.getvalue()  # redrawn in place


def test_bench_progress_off_a_terminal_is_plain_lines_at_a_modest_rate() -> None:
    now = [100.0]
    pipe = io.StringIO()
    bar = Progress(100, pipe, enabled=True, unit="pages", interval=5.0, clock=lambda: now[0])
    for _ in range(99):  # 99 steps over 49 s: a line is due at most every 5 s
        now[0] += 0.5
        bar.step("round 1/3: put")
    now[0] += 0.5
    bar.step("round 3/3: get")
    bar.close()
    bar.close()  # once
    lines = pipe.getvalue().splitlines()
    assert "\r" not in pipe.getvalue()
    assert lines[0] == "kvtier bench: started, 100 pages to go"
    assert lines[-1] == "kvtier bench: finished, 100/100 pages in 50.0 s"
    middle = lines[1:-1]
    assert 8 <= len(middle) <= 10  # every 5 s of 49, not one per step
    assert middle[0] == "kvtier bench: 10/100 pages (10%), round 1/3: put, 5 s"


def test_bench_single_shows_progress_on_a_pipe_unless_asked_not_to() -> None:
    pipe = io.StringIO()
    single.run_bench(bench_args("--backend", "file", "--no-raw"), progress_stream=pipe)
    lines = pipe.getvalue().splitlines()
    assert lines[0] == "kvtier bench: started, 24 page transfers to go"
    assert lines[-1].startswith("kvtier bench: finished, 24/24 page transfers in ")
    for quiet in (["--no-progress"], ["--json"]):  # --json keeps stderr quiet, as before
        pipe = io.StringIO()
        single.run_bench(bench_args("--backend", "file", "--no-raw", *quiet), progress_stream=pipe)
        assert pipe.getvalue() == ""


def test_kvtier_bench_command(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    argv = ["bench", *SINGLE, "--pages", "3", "--rounds", "1", "--json", "--no-raw"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["backend"] == "file" and out["pages"] == 3
    assert main(["bench", "--backend", "fiel"]) == 2
    assert "did you mean 'file'" in capsys.readouterr().err


# --- the main job: the file backend with the segment store beside it -----------------


def test_the_main_job_runs_file_and_segment_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipe = io.StringIO()
    result = single.run_bench(
        bench_args("--batch", "3", "--workdir", str(tmp_path)), progress_stream=pipe
    )
    out = result.to_dict()
    # the first backend's object is what a one-backend run prints, the other beside it
    assert out["backend"] == "file" and out["ok"] is True and out["failures"] == []
    (segment,) = out["beside"]
    assert segment["backend"] == "segment" and segment["ok"] is True
    for run in (out, segment):
        assert set(run["ratio"]) == set(run["ratio_threads"]) == {"put", "get"}
        assert run["ratio"]["put"] > 0 and run["ratio_threads"]["get"] > 0
        assert run["target"] == {"put": 0.9, "get": 0.9}  # both store local files
        assert run["store_stats"]["hits"] == 12 and run["store_stats"]["invalid"] == 0
        assert "beside" not in run or run is out
    assert segment["backend_stats"]["write_calls"] == 4  # one record per batch put
    assert "write_calls" not in out["backend_stats"]  # the file backend's own counters
    report = result.report()
    assert "kvtier bench: file backend" in report and "kvtier bench: segment backend" in report
    assert report.count("verified: all 6 pages bit-exact") == 2
    summary = report[report.index("side by side: file and segment") :].splitlines()
    assert summary[1].split()[:3] == ["backend", "put", "GB/s"]
    for name, run in (("file", out), ("segment", segment)):
        (row,) = [line for line in summary if line.split()[:1] == [name]]
        assert f"{run['ratio']['put']:.2f}x, {run['ratio']['get']:.2f}x" in row
    lines = pipe.getvalue().splitlines()  # one progress line for both runs
    assert lines[0] == "kvtier bench: started, 48 page transfers to go"
    assert lines[-1].startswith("kvtier bench: finished, 48/48 page transfers in ")
    assert list(tmp_path.iterdir()) == []  # both temporary roots and the raw files gone
    # the command: the same object on stdout, readable by the scripts that read one
    assert bench.run(bench_args("--json", "--no-progress", "--no-raw")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["backend"] == "file" and printed["beside"][0]["backend"] == "segment"
    assert "ratio" not in printed and printed["ok"] is True


def test_backends_listed_run_in_order_and_one_alone_has_nothing_beside() -> None:
    result = single.run_bench(bench_args("--backend", "segment,memory", "--no-raw"))
    assert [result.name, *(b.name for b in result.beside)] == ["segment", "memory"]
    alone = single.run_bench(bench_args("--backend", "memory", "--no-raw")).to_dict()
    assert "beside" not in alone and alone["backend"] == "memory"


def test_ok_covers_every_backend_and_the_summary_flags_the_one_that_failed() -> None:
    good = single.run_bench(bench_args("--backend", "memory"))
    # room for no page: every put fails
    failed = single.run_bench(
        bench_args("--backend", "memory", "--extra-config", '{"capacity_bytes": 1024}')
    )
    assert good.ok and not failed.ok
    good.beside = [failed]
    out = good.to_dict()
    assert out["ok"] is False and out["failures"] == [] and out["beside"][0]["ok"] is False
    assert out["beside"][0]["ratio"]["put"] is None
    report = good.report()
    assert "kvtier bench: FAILED: " in report  # the failed run's table says so first
    summary = report[report.index("side by side: ") :].splitlines()
    assert [line.endswith("FAILED") for line in summary[2:4]] == [False, True]
    assert "n/a, n/a" in summary[3]


def test_a_chain_of_tiers_from_config_is_benchmarked_through_the_chain(tmp_path: Path) -> None:
    # the eviction policy is looked up in the registry's policies (a plan resolved
    # without them refuses every policy name)
    chain = {
        "tiers": [
            {"backend": "memory", "extra_config": {"capacity_bytes": "1MiB"}},
            {"backend": "segment", "eviction": "lru"},
        ]
    }
    args = bench_args("--config", json.dumps(chain), "--workdir", str(tmp_path), "--batch", "3")
    result = single.run_bench(args)
    out = result.to_dict()
    assert out["ok"] is True and out["tiers"] == ["memory", "segment"]
    assert out["backend"] == "memory" and out["target"] == {"put": None, "get": None}
    assert out["store_stats"]["hits"] == 12  # every get answered by the first tier
    # write-through: every round's pages cascaded into the segment tier, one record a batch
    assert out["backend_stats"]["tier1.puts"] == 12
    assert out["backend_stats"]["tier1.write_calls"] == 4
    assert result.report().startswith("kvtier bench: chain memory -> segment, io ")
    assert list(tmp_path.iterdir()) == []  # the segment tier's temporary root is gone


def test_multiturn_takes_a_chain_from_config_too() -> None:
    chain = {"tiers": [{"backend": "memory"}, {"backend": "segment"}]}
    args = parse([*SMALL[2:], "--workload", "multiturn", "--config", json.dumps(chain)])
    args.no_progress = True
    result = bench_multiturn.run_multiturn(args, registry=cache_registry())
    assert result.ok and result.to_dict()["plan"]["backend"] == "memory"
