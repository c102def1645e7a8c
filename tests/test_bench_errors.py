"""Every ``kvtier bench`` mistake: exit 2, one ``kvtier bench: error: ...`` line naming the
option and what would work, found before the run starts, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.bench import single
from kvtier.cache import TieredCache
from kvtier.cli import main

TINY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--page-size", "4"]
SINGLE = [*TINY, "--pages", "2", "--rounds", "1", "--no-progress"]
MULTI = [
    *TINY,
    "--workload",
    "multiturn",
    "--conversations",
    "2",
    "--turns",
    "2",
    "--system-tokens",
    "8",
    "--turn-tokens",
    "8",
    "--no-progress",
]


@pytest.fixture(autouse=True)
def _no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that starts fails the test: every mistake here must be found before."""

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run started although the options were wrong")

    monkeypatch.setattr(single, "_run_plan", started)
    monkeypatch.setattr(TieredCache, "open", started)


@pytest.fixture
def cpu_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as a CPU build, whatever the test machine has."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``kvtier bench argv``; assert exit 2, nothing on stdout, one error line; return it."""
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert err.startswith("kvtier bench: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("workload", [SINGLE, MULTI], ids=["single", "multiturn"])
@pytest.mark.usefixtures("cpu_torch")
def test_cuda_on_a_cpu_build_of_torch(
    capsys: pytest.CaptureFixture[str], workload: list[str]
) -> None:
    err = one_error(capsys, [*workload, "--device", "cuda"])
    assert "--device: 'cuda' needs CUDA, but this torch" in err
    assert "built without it; use --device cpu" in err


def test_misspelt_device(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_error(capsys, [*SINGLE, "--device", "cdua"])
    assert "--device: 'cdua' is not a torch device (did you mean 'cuda'?); use cpu" in err


def test_cuda_index_that_does_not_exist(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = one_error(capsys, [*MULTI, "--device", "cuda:5"])
    assert "'cuda:5': this machine has 2 CUDA device(s), cuda:0 to cuda:1" in err


def test_device_the_io_backend_does_not_run_on(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_error(capsys, [*SINGLE, "--device", "meta", "--io-backend", "direct"])
    assert "--device: 'meta': IO backend 'direct' runs on cpu, cuda" in err


def test_plot_into_a_missing_directory_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib", reason="needs the 'plot' extra (matplotlib)")
    err = one_error(capsys, [*MULTI, "--plot", "/nonexistent/x.png"])
    assert "--plot: cannot write '/nonexistent/x.png' (No such file or directory)" in err
    assert "existing writable directory" in err


def test_plot_is_checked_without_leaving_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib", reason="needs the 'plot' extra (matplotlib)")
    target = tmp_path / "run.png"
    err = one_error(capsys, [*MULTI, "--plot", str(target), "--device", "cdua"])
    assert "--device" in err  # found after the plot file was probed
    assert not target.exists()


def test_plot_with_the_single_workload_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_error(capsys, [*SINGLE, "--plot", "run.png"])
    assert "--plot: the single workload has nothing to plot" in err
    assert "add --workload multiturn" in err


@pytest.mark.parametrize("workload", [SINGLE, MULTI], ids=["single", "multiturn"])
@pytest.mark.parametrize(
    ("workdir", "expected"),
    [
        ("/proc", "--workdir: cannot create a directory in '/proc'"),
        ("/nonexistent/kv", "--workdir: '/nonexistent/kv' is not a directory"),
        ("/etc/hostname", "--workdir: '/etc/hostname' is not a directory"),
    ],
)
def test_workdir_that_cannot_hold_the_files(
    capsys: pytest.CaptureFixture[str], workload: list[str], workdir: str, expected: str
) -> None:
    if not Path(workdir).exists() and "not a directory" not in expected:
        pytest.skip(f"{workdir} is not on this machine")
    err = one_error(capsys, [*workload, "--workdir", workdir])
    assert expected in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--pages", "0"], "--pages: must be a positive integer, got 0"),
        (["--batch", "-1"], "--batch: must be a positive integer, got -1"),
        (["--rounds", "0"], "--rounds: must be a positive integer, got 0"),
        (["--page-size", "0"], "page_size: Input should be greater than 0, got 0"),
        (["--num-layers", "-2"], "num_layers: Input should be greater than 0, got -2"),
        (["--verify", "nope"], "argument --verify: invalid choice: 'nope'"),
        (["--pages", "many"], "argument --pages: invalid int value: 'many'"),
        (["--pagse", "3"], "unrecognized arguments: --pagse 3 (did you mean --pages?)"),
        (["--pages", "100000000000"], "of host memory"),
        (["--batch", "3"], "--batch: 3 pages per call is more than a round has (--pages 2)"),
        (["--seed", str(2**70)], "--seed: must be an integer from 0 to 2**62 - 1"),
        (["--seed", "-1"], "--seed: must be an integer from 0 to 2**62 - 1, got -1"),
        # several backends (the default is file,segment) and --config
        (["--extra-config", '{"root": "/tmp/kv"}'], "'root' would be shared by 2 backends"),
        (["--extra-config", '{"fsync": "page"}'], "--extra-config[segment].fsync: Input"),
        (["--backend", "file,,segment"], "--backend: 'file,,segment' has an empty name"),
        (["--backend", "segment,file,segment"], "--backend: 'segment' is listed twice"),
        (["--backend", "file,segmnet"], "unknown backend 'segmnet' (did you mean 'segment'?)"),
        (["--config", '{"layout": "page_first"}'], "--config.layout: is set with --layout"),
        (["--config", '{"tenats": {}}'], "unknown key 'tenats' in --config (did you mean"),
        (["--config", "[1]"], "--config"),
        (
            ["--backend", "file", "--config", '{"tiers": [{"backend": "memory"}]}'],
            "--backend: give either --backend / --extra-config or 'tiers' in --config",
        ),
        (
            ["--config", '{"tiers": [{"backend": "memory"}, {"backend": "file", "wirte": "b"}]}'],
            "unknown key 'wirte' in tiers[1] (did you mean 'write'?)",
        ),
        (
            ["--config", '{"tiers": [{"backend": "segment", "eviction": "lur"}]}'],
            "unknown eviction policy 'lur' (did you mean 'lru'?)",
        ),
    ],
)
def test_bad_single_options(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    err = one_error(capsys, [*SINGLE, *argv])
    assert expected in err
    if expected.startswith(("argument", "unrecognized")):
        assert err.rstrip().endswith("see 'kvtier bench --help'")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--host-pages", "0"], "--host-pages: must be a positive integer, got 0"),
        (["--conversations", "-3"], "--conversations: must be a positive integer, got -3"),
        (["--turn-tokens", "0"], "--turn-tokens: must be a positive integer, got 0"),
        (["--system-tokens", "-1"], "--system-tokens: must be 0 or more, got -1"),
        (["--host-pages", "100000000000"], "use fewer --host-pages"),
        (["--seed", "-7"], "--seed: must be an integer from 0 to 2**62 - 1, got -7"),
    ],
)
def test_bad_multiturn_options(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    err = one_error(capsys, [*MULTI, *argv])
    assert expected in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([*SINGLE, "--turns", "9"], "--turns: is an option of the multiturn workload, but this"),
        ([*SINGLE, "--write-policy", "write_back"], "add --workload multiturn, or drop"),
        ([*MULTI, "--pages", "8"], "--pages: is an option of the single workload, but this run"),
        ([*MULTI, "--no-raw"], "--no-raw: is an option of the single workload"),
        ([*MULTI, "--backend", "file,segment"], "the multiturn workload runs one backend"),
    ],
)
def test_an_option_of_the_other_workload_is_not_silently_ignored(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert expected in one_error(capsys, argv)


def test_pages_that_do_not_fit_on_disk(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("kvtier.bench.checks.shutil.disk_usage", lambda path: usage(1, 1, 0))
    err = one_error(capsys, SINGLE)
    assert "(the raw side's files and the backend's pages), but 0.0 GiB is free there" in err
    assert "or a --workdir with more room" in err


def test_python_m_kvtier_bench_is_kvtier_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.bench.__main__ import main as bench_main

    assert bench_main([*SINGLE, "--verify", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier bench: error: argument --verify") and err.count("\n") == 1


def test_console_prints_no_traceback_for_a_bad_device() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", *SINGLE, "--device", "cdua"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"KVTIER_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kvtier bench: error: --device: 'cdua'")
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
