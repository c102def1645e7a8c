"""The single workload's table and JSON: what each column measures, the target next to
each ratio, the verification in use, and failures first with no ratio for what failed."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier import bench
from kvtier.bench import single
from kvtier.bench.single_report import MAX_LISTED_FAILURES

TINY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--page-size", "16"]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([*TINY, "--pages", "6", "--rounds", "1", "--no-progress", *argv])


def _row(report: str, label: str) -> str:
    (row,) = [line for line in report.splitlines() if line.strip().startswith(label)]
    return row


def test_columns_say_what_one_call_moves() -> None:
    result = single.run_bench(bench_args("--backend", "file", "--batch", "2"))
    report = result.report()
    assert "one call moves" in _row(report, "path")
    assert _row(report, "device -> host (backup)").endswith("6 pages (a whole round)")
    assert _row(report, "host -> device (load)").endswith("6 pages (a whole round)")
    labels = ("host -> storage (put)", "storage -> host (get)", "raw os.pwritev ")
    for label in (*labels, "raw os.preadv, 4 threads"):
        assert _row(report, label).endswith(" 2 pages")
    assert "p50 / p99:" in report and "the latency of one call" in report
    out = result.to_dict()
    assert out["device_to_host"]["pages_per_call"] == 6
    assert out["put"]["pages_per_call"] == out["raw_get"]["pages_per_call"] == 2


@pytest.mark.parametrize("verify", ["full", "header"])
def test_a_local_disk_backend_prints_its_targets(verify: str) -> None:
    # the checksum is computed as the bytes land, so full verification has the same target
    result = single.run_bench(
        bench_args("--backend", "file", "--verify", verify, "--raw-threads", "3")
    )
    out = result.to_dict()
    report = result.report()
    assert out["target"] == {"put": 0.9, "get": 0.9}
    assert out["target_threads"] == {"put": 1.0, "get": 1.0} and out["raw_threads"] == 3
    for label, key, target_key in (
        ("kvtier / raw  ", "ratio", "target"),
        ("kvtier / raw, 3 threads", "ratio_threads", "target_threads"),
    ):
        line = _row(report, label)
        for op in ("put", "get"):
            ratio, target = out[key][op], out[target_key][op]
            verdict = "ok" if ratio >= target else "BELOW TARGET"
            assert f"{op} {ratio:.2f}x (target {target:.2f}x: {verdict})" in line
    checks = "its checksums" if verify == "full" else "its header checks"
    assert f"a backend on local disk, {checks} included, may cost 10%" in report
    assert "at least as fast as raw I/O spread over as many threads" in report
    for label in ("raw os.pwritev, 3 threads", "raw os.preadv, 3 threads"):
        assert _row(report, label)


def test_the_default_batch_is_eight_pages_or_a_whole_smaller_round() -> None:
    assert single.run_bench(bench_args("--pages", "16")).to_dict()["batch"] == 8
    assert single.run_bench(bench_args()).to_dict()["batch"] == 6  # --pages 6


def test_a_memory_backend_has_no_target_and_says_why() -> None:
    result = single.run_bench(bench_args("--backend", "memory"))
    out = result.to_dict()
    assert out["target"] == {"put": None, "get": None}
    assert (
        "no target: raw I/O writes local files and 'memory' stores elsewhere"
        in (out["target_reason"])
    )
    assert "(target" not in _row(result.report(), "kvtier / raw  ")
    assert out["target_threads"] == {"put": None, "get": None}


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        ("full", "verify     full: every page's envelope header and payload checksum"),
        ("header", "verify     header: only each page's envelope header is checked"),
    ],
)
def test_the_table_names_the_verification_in_use(mode: str, text: str) -> None:
    report = single.run_bench(bench_args("--verify", mode, "--no-raw")).report()
    assert text in report
    assert "each byte on the device is compared with the original" in report


def test_failed_gets_come_first_and_get_no_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    # room for 2 of 6 pages: the puts succeed (older pages are evicted), 4 gets miss
    args = bench_args("--backend", "memory", "--extra-config", '{"capacity_bytes": 45000}')
    assert bench.run(args) == 1
    report = capsys.readouterr().out
    first = report.splitlines()[0]
    assert first.startswith("kvtier bench: FAILED: ")
    assert "failed pages in the timed rounds: get 4" in first and "no get ratio" in first
    assert "FAILED: 4 page(s)" in _row(report, "storage -> host (get)")
    assert "FAILED" not in _row(report, "host -> storage (put)")
    for label in ("kvtier / raw  ", "kvtier / raw, 4 threads"):
        line = _row(report, label)
        assert "get n/a" in line and "put " in line and "put n/a" not in line
    args.json = True
    assert bench.run(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert out["ratio"]["get"] is None and out["ratio"]["put"] is not None
    assert out["ratio_threads"]["get"] is None and out["ratio_threads"]["put"] is not None
    assert out["failed_pages"] == {"get": 4}
    assert out["get"]["failed_pages"] == 4


def test_failed_puts_get_no_ratio_and_the_list_says_how_many_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # too small for one page: every put fails, every get misses, every round differs:
    # 3 rounds x (6 puts + 6 gets + 2 kv tensors) problems
    args = bench_args("--backend", "memory", "--extra-config", '{"capacity_bytes": 1024}')
    args.rounds = 2
    assert bench.run(args) == 1
    report = capsys.readouterr().out
    assert report.startswith("kvtier bench: FAILED: 42 problem(s), listed below; ")
    assert "no put or get ratio" in report.splitlines()[0]
    assert "put n/a" in report and "get n/a" in report
    listed = [line for line in report.splitlines() if line.startswith("    - ")]
    assert len(listed) == MAX_LISTED_FAILURES
    assert f"    ... and {42 - MAX_LISTED_FAILURES} more (--json lists them all)" in report
    args.json = True
    bench.run(args)
    out = json.loads(capsys.readouterr().out)
    assert out["failure_count"] == len(out["failures"]) == 42
    assert out["ratio"] == {"put": None, "get": None}
