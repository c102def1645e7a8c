"""``kvtier bench --backend mooncake`` against a real ``mooncake_master`` on loopback.

The master keeps its default read lease (10 s), far longer than a round here, so every
page a round's gets read is still leased when the next round starts: a bench that
removes or re-puts those keys fails there. Without the Mooncake package or binaries the
tests skip, unless KVTIER_REQUIRE_MOONCAKE=1 (CI), where they fail.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest

from kvtier import bench
from kvtier.bench import single
from kvtier.cli import main
from kvtier.testing import require
from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

pytestmark = pytest.mark.mooncake

TINY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--page-size", "16"]


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    """One master with the default lease; the bench's client contributes the memory."""
    require("mooncake", mooncake_unavailable_reason())
    use_client_env()
    with MooncakeMaster() as started:
        yield started


def _argv(master: MooncakeMaster, *more: str) -> list[str]:
    extra = {"master_address": master.address, "global_segment_size": 64 << 20}
    return ["--backend", "mooncake", "--extra-config", json.dumps(extra), *TINY, *more]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_round_puts_and_gets_cleanly_despite_read_leases(master: MooncakeMaster) -> None:
    result = single.run_bench(_args(_argv(master, "--pages", "4", "--rounds", "3", "--batch", "2")))
    out = result.to_dict()
    assert out["failures"] == [] and out["ok"] is True
    assert out["failed_pages"] == {}
    failed = {k: v for k, v in out["backend_stats"].items() if "failed" in k and v}
    assert failed == {}, failed  # no OBJECT_HAS_LEASE on delete or put
    assert out["store_stats"]["hits"] == 4 * 4  # every page of every round (warm-up too)
    assert out["ratio"]["put"] is not None and out["ratio"]["put"] > 0
    assert out["ratio"]["get"] is not None and out["ratio"]["get"] > 0
    assert out["target"] == {"put": None, "get": None}  # a network store: no target
    assert "FAILED" not in result.report()


def test_kvtier_bench_mooncake_command_exits_0(
    master: MooncakeMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", *_argv(master, "--pages", "3", "--rounds", "2", "--json")])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] and report["backend"] == "mooncake" and report["failure_count"] == 0
