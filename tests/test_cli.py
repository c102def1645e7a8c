"""The kvtier command: exit codes, output, errors without tracebacks, bench delegation."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

import kvtier
from kvtier.cli import main
from kvtier.core.geometry import AttentionKind
from kvtier.core.layout import Layout
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Capability,
    Feature,
    IOBackendSpec,
    Operation,
)
from kvtier.plugins.registry import PluginInfo, Registry


class ShelfOpts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    capacity_bytes: int = Field(1024, description="Most bytes kept.")
    label: str | None = None


def _factory(*args: Any) -> None:
    return None


WHOLE = (Operation.BACKUP_ALL, Operation.LOAD_ALL)
COPY = IOBackendSpec(
    name="copy",
    factory=_factory,
    priority=5,
    description="Test copier.",
    capabilities=frozenset(
        Capability(lay, att, op)
        for lay in (Layout.PAGE_FIRST_DIRECT, Layout.LAYER_FIRST)
        for att in AttentionKind
        for op in WHOLE
    ),
)
SHELF = BackendSpec(
    name="shelf",
    factory=_factory,
    config_model=ShelfOpts,
    description="A test shelf.",
    layouts=ALL_LAYOUTS,
    attention=ALL_ATTENTION,
    operations=ALL_OPERATIONS,
    features=frozenset({Feature.ZERO_COPY}),
)
VAULT = BackendSpec(
    name="vault",
    factory="kvtier_no_such_module:Vault",
    requires=("kvtier_no_such_module",),
    install_hint="pip install 'kvtier[vault]'",
    layouts=ALL_LAYOUTS,
    attention=ALL_ATTENTION,
    operations=ALL_OPERATIONS,
    io_backends=frozenset({"copy"}),
)


@pytest.fixture
def registry() -> Registry:
    return Registry(
        {"shelf": SHELF, "vault": VAULT},
        {"copy": COPY},
        {
            ("backend", "shelf"): PluginInfo("tests.shelf", "shelf-dist", "1.2.3"),
            ("backend", "vault"): PluginInfo("tests.vault"),
            ("io_backend", "copy"): PluginInfo("tests.copy", "kvtier", "0.1.0"),
        },
    )


def run(capsys: pytest.CaptureFixture[str], argv: list[str], **kw: Any) -> tuple[int, str, str]:
    code = main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


# --- help ------------------------------------------------------------------------------


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, ["--help"])
    assert code == 0
    for text in (
        "backends",
        "check",
        "bench",
        "examples:",
        "kvtier check --backend memory",
        "exit status",
    ):
        assert text in out


def test_check_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, ["check", "--help"])
    assert code == 0
    for text in (
        "--extra-config JSON|@FILE",
        "--config JSON|@FILE",
        "--strict-geometry",
        "auto",
        "examples:",
    ):
        assert text in out


def test_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, ["check", "--num-layers", "many"])
    assert code == 2
    assert "invalid int value: 'many'" in err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["check", "--num-layers", "many"],
            "kvtier check: error: argument --num-layers: invalid int value: 'many'; "
            "see 'kvtier check --help'",
        ),
        (
            ["backends", "--jsno"],
            "kvtier backends: error: unrecognized arguments: --jsno (did you mean --json?); "
            "see 'kvtier backends --help'",
        ),
        (
            ["check", "--strict-geometyr"],
            "kvtier check: error: unrecognized arguments: --strict-geometyr (did you mean "
            "--strict-geometry?); see 'kvtier check --help'",
        ),
        (
            ["bench", "--workload", "multi"],
            "kvtier bench: error: argument --workload: invalid choice: 'multi' (choose from "
            "'single', 'multiturn'); see 'kvtier bench --help'",
        ),
        (
            ["bogus"],
            "kvtier: error: argument COMMAND: invalid choice: 'bogus' (choose from "
            "'backends', 'check', 'bench'); see 'kvtier --help'",
        ),
    ],
)
def test_usage_errors_are_one_line_with_where_to_look(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err == line + "\n"


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, [])
    assert code == 2 and "COMMAND" in err


# --- kvtier backends -------------------------------------------------------------------


def test_backends_table(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, out, err = run(capsys, ["backends"], registry=registry)
    assert code == 0 and err == ""
    assert "Storage backends (2)" in out
    assert "  shelf  [available]" in out
    assert "plugin:      tests.shelf (shelf-dist 1.2.3)" in out
    assert "features:    zero_copy" in out
    assert "io backends: any" in out
    assert "capacity_bytes  int         default 1024\n          Most bytes kept.\n" in out
    assert "label           str | None  default null\n" in out
    assert "  vault  [UNAVAILABLE: missing Python module(s) kvtier_no_such_module]" in out
    assert "install:     pip install 'kvtier[vault]'" in out
    assert "io backends: copy" in out
    assert "(no options)" in out
    assert "IO backends (1)" in out
    assert "  copy  [available]  priority 5" in out
    assert "plugin:      tests.copy (kvtier 0.1.0)" in out
    matrix = [line.strip() for line in out.splitlines() if "/mha" in line or "/mla" in line]
    assert matrix[0].split() == ["layer_first/mha", "x", "x", "-", "-"]
    assert "page_first_direct/mla" in matrix[-1]


def test_backends_json(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, out, _ = run(capsys, ["backends", "--json"], registry=registry)
    assert code == 0
    data = json.loads(out)
    assert data["format"] == 1
    assert [b["name"] for b in data["backends"]] == ["shelf", "vault"]
    shelf, vault = data["backends"]
    assert shelf["plugin"] == "tests.shelf"
    assert (shelf["distribution"], shelf["version"]) == ("shelf-dist", "1.2.3")
    assert shelf["available"] is True and shelf["unavailable_reason"] is None
    assert shelf["layouts"] == sorted(lay.value for lay in Layout)
    assert shelf["operations"] == [op.value for op in Operation]
    assert shelf["io_backends"] is None and shelf["features"] == ["zero_copy"]
    assert shelf["config"] == [
        {
            "name": "capacity_bytes",
            "type": "int",
            "required": False,
            "default": 1024,
            "description": "Most bytes kept.",
        },
        {
            "name": "label",
            "type": "str | None",
            "required": False,
            "default": None,
            "description": "",
        },
    ]
    assert vault["available"] is False
    assert vault["install_hint"] == "pip install 'kvtier[vault]'"
    assert vault["io_backends"] == ["copy"]
    (copy,) = data["io_backends"]
    assert copy["priority"] == 5
    assert {"layout": "layer_first", "attention": "mha", "operation": "backup_all"} in copy[
        "capabilities"
    ]
    assert len(copy["capabilities"]) == 8
    # Stable: the same registry gives byte-identical output.
    assert run(capsys, ["backends", "--json"], registry=registry)[1] == out


def test_backends_from_installed_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    # conftest turns entry-point autoload off: only built-ins.
    code, out, _ = run(capsys, ["backends", "--json"])
    assert code == 0
    names = [b["name"] for b in json.loads(out)["backends"]]
    assert "memory" in names


# --- kvtier check ----------------------------------------------------------------------


def test_check_ok(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, out, err = run(
        capsys,
        [
            "check",
            "--backend",
            "shelf",
            "--num-layers",
            "2",
            "--num-kv-heads",
            "1",
            "--head-dim",
            "8",
            "--extra-config",
            '{"capacity_bytes": 4096}',
        ],
        registry=registry,
    )
    assert code == 0 and err == ""
    assert out.startswith("OK: the configuration resolves to this plan\n")
    assert "io_backend     copy (auto)" in out
    assert "layout         page_first_direct (auto)" in out
    assert "capacity_bytes=4096" in out
    assert "note: auto picked io_backend=copy (priority 5) layout=page_first_direct" in out
    assert "defaults used" not in out


def test_check_fills_and_announces_geometry(
    capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, out, _ = run(capsys, ["check", "--backend", "shelf"], registry=registry)
    assert code == 0
    assert (
        "note: geometry not given, defaults used: num_layers=32, num_kv_heads=8, head_dim=128"
        in out
    )


def test_check_strict_geometry(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, out, err = run(
        capsys,
        ["check", "--backend", "shelf", "--strict-geometry", "--num-layers", "2"],
        registry=registry,
    )
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: 2 problems in engine config:")
    assert "num_kv_heads: required field is missing" in err
    assert "Traceback" not in err


def test_check_unknown_backend(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, _, err = run(capsys, ["check", "--backend", "shelv"], registry=registry)
    assert code == 2
    assert err == (
        "kvtier: error: unknown backend 'shelv' (did you mean 'shelf'?); "
        "available: 'shelf', 'vault'\n"
    )


def test_check_unavailable_backend(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, _, err = run(capsys, ["check", "--backend", "vault"], registry=registry)
    assert code == 2
    assert "backend 'vault' is unavailable" in err and "pip install 'kvtier[vault]'" in err


def test_check_bad_extra_config(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, _, err = run(
        capsys,
        ["check", "--backend", "shelf", "--extra-config", "{capacity_bytes: 1}"],
        registry=registry,
    )
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == (
        "kvtier: error: --extra-config: invalid JSON at line 1, column 2: "
        "Expecting property name enclosed in double quotes"
    )
    assert lines[1:3] == ["    {capacity_bytes: 1}", "     ^"]
    assert "the shell removed them" in err
    assert "Traceback" not in err


def test_check_extra_config_wrong_type(
    capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, _, err = run(
        capsys,
        ["check", "--backend", "shelf", "--extra-config", '{"capacity_bytes": "x", "lable": 1}'],
        registry=registry,
    )
    assert code == 2
    assert "unknown key 'lable' in extra_config of backend 'shelf' (did you mean 'label'?)" in err
    assert "extra_config.capacity_bytes: Input should be a valid integer" in err


def test_check_unsupported_combination(
    capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, _, err = run(
        capsys,
        [
            "check",
            "--backend",
            "shelf",
            "--layout",
            "page_first",
            "--operations",
            "backup_all,load_layer",
        ],
        registry=registry,
    )
    assert code == 2
    assert "no IO backend runs backend 'shelf'" in err
    assert "with layout 'page_first'" in err
    assert "Combinations that would work:\n  (none)" in err


def test_check_lists_working_combinations(
    capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, _, err = run(
        capsys,
        ["check", "--backend", "shelf", "--io-backend", "copy", "--layout", "page_first"],
        registry=registry,
    )
    assert code == 2
    assert (
        "Combinations that would work:\n  io_backend=copy layout=page_first_direct\n"
        "  io_backend=copy layout=layer_first\n"
    ) in err


def test_check_config_file_with_flag_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        'backend = "shelf"\nattention = "mla"\nnum_layers = 3\nkv_lora_rank = 16\n'
        'qk_rope_head_dim = 8\nlayout = "page_first_direct"\n'
        "[extra_config]\ncapacity_bytes = 77\n"
    )
    code, out, _ = run(
        capsys,
        ["check", "--config", f"@{path}", "--layout", "layer_first", "--json"],
        registry=registry,
    )
    assert code == 0
    data = json.loads(out)
    assert data["ok"] is True and data["notes"] == []
    plan = data["plan"]
    assert (plan["backend"], plan["layout"], plan["attention"]) == ("shelf", "layer_first", "mla")
    assert plan["backend_config"] == {"capacity_bytes": 77, "label": None}
    assert plan["geometry"]["num_layers"] == 3


def test_check_bad_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, _, err = run(
        capsys, ["check", "--config", f"@{tmp_path}/missing.toml"], registry=registry
    )
    assert code == 2
    assert "--config: file" in err and "missing.toml' does not exist" in err


def test_check_json_error(capsys: pytest.CaptureFixture[str], registry: Registry) -> None:
    code, out, err = run(capsys, ["check", "--backend", "nope", "--json"], registry=registry)
    assert code == 2
    data = json.loads(out)
    assert data == {
        "format": 1,
        "ok": False,
        "error": "UnknownNameError",
        "message": "unknown backend 'nope'; available: 'shelf', 'vault'",
    }
    assert "unknown backend 'nope'" in err


def test_check_verbose_logs_the_auto_pick(
    capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    code, _, err = run(capsys, ["-v", "check", "--backend", "shelf"], registry=registry)
    assert code == 0
    assert "INFO kvtier.core.capabilities: kvtier: auto picked io_backend=copy" in err


def test_check_with_installed_memory_backend(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, ["check", "--backend", "memory", "--io-backend", "nope"])
    assert code == 2 and out == ""
    assert "unknown IO backend 'nope'" in err


# --- kvtier bench ----------------------------------------------------------------------


def test_bench_not_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kvtier.bench", None)  # makes the import fail
    monkeypatch.delattr(kvtier, "bench", raising=False)
    code, out, err = run(capsys, ["bench", "--quick"])
    assert code == 2 and out == ""
    assert err == (
        "kvtier: error: kvtier bench is not available yet in this build (there is "
        "no kvtier.bench module)\n"
    )


def test_bench_broken_module_does_not_break_other_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], registry: Registry
) -> None:
    broken = types.ModuleType("kvtier.bench")  # imports, but lacks add_arguments / run
    monkeypatch.setitem(sys.modules, "kvtier.bench", broken)
    monkeypatch.setattr(kvtier, "bench", broken, raising=False)
    code, _, err = run(capsys, ["bench"])
    assert code == 2
    assert "kvtier bench cannot start" in err
    assert "must define add_arguments(parser) and run(args)" in err
    assert main(["backends"], registry=registry) == 0


def test_bench_add_arguments_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType("kvtier.bench")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        raise RuntimeError("boom")

    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.run = lambda args: 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.bench", fake)
    monkeypatch.setattr(kvtier, "bench", fake, raising=False)
    code, _, err = run(capsys, ["bench", "--anything"])
    assert code == 2
    assert "add_arguments failed: RuntimeError('boom')" in err


def test_bench_delegates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[argparse.Namespace] = []
    fake = types.ModuleType("kvtier.bench")
    fake.__doc__ = "Fake benchmarks."

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--quick", action="store_true")

    def run_bench(args: argparse.Namespace) -> int:
        calls.append(args)
        return 7

    fake.add_arguments = add_arguments  # type: ignore[attr-defined]
    fake.run = run_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.bench", fake)
    monkeypatch.setattr(kvtier, "bench", fake, raising=False)
    assert main(["bench", "--quick"]) == 7
    assert calls[0].quick is True
    code, out, _ = run(capsys, ["bench", "--help"])
    assert code == 0 and "Fake benchmarks." in out and "--quick" in out


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType("kvtier.bench")

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    fake.add_arguments = lambda parser: None  # type: ignore[attr-defined]
    fake.run = interrupted  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.bench", fake)
    monkeypatch.setattr(kvtier, "bench", fake, raising=False)
    code, out, err = run(capsys, ["bench"])
    assert (code, out, err) == (130, "", "kvtier: interrupted\n")


def test_console_exit_status_and_no_traceback() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "check", "--extra-config", "{'a': 1}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvtier: error: --extra-config: invalid JSON at line 1")
    assert "Traceback" not in proc.stderr
