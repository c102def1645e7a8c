"""Metric names are declared once: every counter counted in the tree, every Prometheus
family exposed, every name handed to vLLM and every SGLang StorageMetrics field comes
from a declaration in kvtier.core.metrics / kvtier.core.families."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import UnknownNameError
from kvtier.core.families import STORAGE_METRICS
from kvtier.core.metrics import (
    COUNTERS,
    FAMILIES,
    VLLM_PREFIXES,
    counter_names,
    family,
    series,
    vllm_metrics,
)

PACKAGE = Path(__file__).resolve().parents[1] / "kvtier"
#: Backends keep their own stats (exported by name as ``kvtier_backend_stat``): free names.
FREE = (PACKAGE / "backends",)
#: The counters' own module, and the registry that builds registered ones.
COUNTER_CLASS = {PACKAGE / "core" / "storage.py", PACKAGE / "core" / "metrics.py"}


def _declared() -> set[str]:
    return {name for counted_by in COUNTERS for name in counter_names(counted_by)}


def _families_of_members() -> set[str]:
    """The stems a counted f-string may start with: a family's ``<name>_``."""
    return {f"{spec.name}_" for specs in COUNTERS.values() for spec in specs if spec.suffixes}


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(path.is_relative_to(free) for free in FREE):
            continue
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _receiver(node: ast.expr) -> str:
    """The last name of what a method is called on (``self._counters`` -> ``_counters``)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def undeclared_counts(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each ``<counters>.add/set("<name>")`` (and ``stats.add``) whose name
    is not declared; an f-string counts when it starts with a declared family's stem; a
    keyword ``dropped_counter=`` hands a counter's name over too."""
    declared, stems = _declared(), _families_of_members()
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names: list[ast.expr] = []
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in ("add", "set")
            and (_receiver(func.value).endswith("counters") or _receiver(func.value) == "stats")
            and node.args
        ):
            names.append(node.args[0])
        names += [k.value for k in node.keywords if k.arg == "dropped_counter"]
        for name in names:
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if name.value not in declared:
                    out.append((node.lineno, name.value))
            elif isinstance(name, ast.JoinedStr):
                head = name.values[0] if name.values else None
                stem = head.value if isinstance(head, ast.Constant) else ""
                if not isinstance(stem, str) or stem not in stems:
                    out.append((node.lineno, ast.unparse(name)))
    return out


def plain_counters(tree: ast.Module) -> list[int]:
    """Lines that build a ``Counters()`` with no registered names (any name counts)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and _receiver(node.func) == "Counters"
        and not node.args
        and not any(k.arg == "names" for k in node.keywords)
    ]


def test_every_name_counted_in_the_tree_is_declared() -> None:
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path, tree in _sources()
        for line, name in undeclared_counts(tree)
    }
    assert found == set(), "counted but not declared in kvtier.core.metrics.COUNTERS"


def test_the_scan_catches_an_undeclared_name() -> None:
    tree = ast.parse(
        "self.counters.add('hits')\n"
        "self._counters.add('bytes_reed', 3)\n"
        "ctx.stats.add(f'failures_{cause}')\n"
        "counters.add(f'sideways_{x}')\n"
        "Feed(dropped_counter='never_declared')\n"
    )
    assert undeclared_counts(tree) == [
        (2, "bytes_reed"),
        (4, "f'sideways_{x}'"),
        (5, "never_declared"),
    ]


def test_every_part_outside_the_backends_counts_registered_names_only() -> None:
    plain = {
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path, tree in _sources()
        if path not in COUNTER_CLASS
        for line in plain_counters(tree)
    }
    assert plain == set(), "use kvtier.core.metrics.registered_counters(<counted by>)"


def test_the_scan_catches_a_plain_counter_object() -> None:
    tree = ast.parse("a = Counters()\nb = registered_counters('sglang')\nc = Counters(['x'])\n")
    assert plain_counters(tree) == [1]


def test_a_family_not_declared_cannot_be_built() -> None:
    # the exposition builds every family through this lookup (kvtier.cache.metrics)
    with pytest.raises(UnknownNameError, match="Prometheus family") as info:
        family("kvtier_host_hit")  # a typo of a declared family
    assert info.value.value == "kvtier_host_hit" and "kvtier_host_hits" in str(info.value)
    assert family("kvtier_host_hits").help == FAMILIES["kvtier_host_hits"].help != ""


def test_every_exposed_family_is_declared(tmp_path: Path) -> None:
    """A TieredCache's exposition and a lone page store's emit declared families only."""
    pytest.importorskip("prometheus_client", reason="needs the 'prometheus' extra")
    from test_cache import cache_registry, make_cache, put_pages

    from kvtier.cache.metrics import prometheus_text, store_collector

    declared = {f.sample_name for f in FAMILIES.values()}
    cache = make_cache(cache_registry(), host_pages=8)
    try:
        put_pages(cache, range(16))
        emitted = _types(cache.prometheus_text())
        lone = _types(prometheus_text(store_collector(cache.page_store.tiers[0].store, {})))
    finally:
        cache.close()
    assert emitted <= declared and lone <= declared  # (test_metrics: and the other way)
    assert "kvtier_tier_hits_total" in lone  # a lone page store is tier 0 of itself


def _types(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_every_counter_family_is_consistent_with_its_counters() -> None:
    for counted_by, specs in COUNTERS.items():
        for spec in specs:
            declared = spec.family
            if declared is None:
                continue
            assert FAMILIES[declared.name].kind == declared.kind == "counter", spec.name
            if declared.label is None or declared.label == "tier" or spec.suffixes:
                assert spec.value is None, spec.name  # its series name themselves
            else:
                assert spec.value, f"{spec.name}: a shared family needs its label value"
        # one series per (family, label value): no two counters fill the same one
        for name, members in series(counted_by).items():
            values = [value for _, value in members]
            if FAMILIES[name].label != "tier":
                assert len(values) == len(set(values)), name
    for name, declared in FAMILIES.items():
        assert name.startswith("kvtier_") and declared.help, name
    shared = [spec.name for specs in COUNTERS.values() for spec in specs if spec.family is not None]
    assert len(shared) >= 40  # every Prometheus-facing counter has a family


def test_one_name_per_quantity() -> None:
    names = _declared()
    # bytes read and written are one name each, in every part and scope
    assert {"bytes_read", "bytes_written"} <= names
    assert not names & {"read_bytes", "written_bytes", "bytes_storage_read_total"}
    assert FAMILIES["kvtier_tier_read_bytes"].label == "tier"
    [bytes_read] = [s for s in COUNTERS["page_store"] if s.name == "bytes_read"]
    assert bytes_read.family is not None and bytes_read.family.name == "kvtier_tier_read_bytes"


def test_vllm_metrics_are_generated_from_the_registry() -> None:
    metrics = vllm_metrics()
    for counted_by, prefixes in VLLM_PREFIXES.items():
        for prefix in prefixes:
            for name in counter_names(counted_by):
                assert f"kvtier_{prefix}{name}" in metrics
    assert metrics["kvtier_load_hit_pages"].startswith("kvtier: Pages loaded")
    assert "kvtier_store_bytes_read" in metrics and "kvtier_cache_host_hits" in metrics
    # a rate or a gauge of a cache's stats() is no counter: vLLM never carries it
    assert "kvtier_cache_host_hit_rate" not in metrics
    # Prometheus strips a ``_total`` suffix: no two names may become one series
    assert not {name for name in metrics if f"{name}_total" in metrics}
    assert family("kvtier_backend_stat").kind == "untyped"


def test_sglang_storage_metrics_are_filled_from_their_declaration() -> None:
    from dataclasses import fields

    from kvtier.integrations.sglang.metrics import StorageMetricsShape, TransferWindows

    assert [f.name for f in fields(StorageMetricsShape)] == [s.field for s in STORAGE_METRICS]
    windows = TransferWindows(enabled=True)
    windows.record("prefetch", 4, 4_000_000_000, 2.0)
    windows.record("backup", 3, 1_000_000_000, 1.0)
    taken = windows.take()
    assert (taken.prefetch_pgs, taken.prefetch_bandwidth) == ([4], [2.0])
    assert (taken.backup_pgs, taken.backup_bandwidth) == ([3], [1.0])
    again = windows.take()
    assert all(getattr(again, spec.field) == [] for spec in STORAGE_METRICS)


def test_a_caches_stats_nest_every_counter_by_one_rule() -> None:
    """stats() nests each tiered_cache counter where its name says, and the exposition
    reads it back from there: every counter, none lost or misplaced."""
    from kvtier.cache.stats import CacheStats, counter_values

    stats = CacheStats()
    names = counter_names("tiered_cache")
    for i, name in enumerate(names, start=1):
        stats.add(name, i)
    snapshot = stats.snapshot()
    assert counter_values(snapshot) == {name: i for i, name in enumerate(names, start=1)}
    assert snapshot["storage"]["pages_read"] == names.index("storage_pages_read") + 1
    assert snapshot["bytes"]["storage_read"] == names.index("bytes_storage_read") + 1
