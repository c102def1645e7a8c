"""Eviction and admission policies: the hook, the spec, the kit on every built-in, each
built-in's own behaviour, and the backends' capacity evicting through a given policy."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import threading
import types
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

import kvtier
import kvtier.plugins
from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore.index import FileIndex
from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.backends.mooncake.occupancy import Occupancy
from kvtier.core.errors import (
    DuplicatePluginError,
    InvalidFieldError,
    PluginError,
    UnknownKeyError,
    UnknownNameError,
)
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.geometry import KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.policy import LRUPolicy, never_pinned
from kvtier.core.specs import PolicySpec
from kvtier.core.storage import BackendContext
from kvtier.plugins.manager import load_registry
from kvtier.policies.config import FrequencyConfig, PrefixConfig
from kvtier.policies.frequency import FrequencyAdmission
from kvtier.policies.prefix import PrefixPolicy
from kvtier.policies.slru import SLRUPolicy
from kvtier.testing import PolicyConformanceTests, PolicyKit, require
from kvtier.testing.kit.policies import Tier, workload

ROOT = Path(__file__).resolve().parents[1]
PageInfo = kvtier.plugins.PageInfo


# --- a third party's policy, declared through the hook --------------------------------


class FifoPolicy(kvtier.plugins.EvictionPolicy):
    """First in, first out: a plugin's policy written from the face alone."""

    def __init__(self, config: BaseModel) -> None:
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._tenant: dict[str, str | None] = {}
        self._described: dict[str, str | None] = {}

    def describe(self, key: str, info: kvtier.plugins.PageInfo) -> None:
        with self._lock:
            if key in self._sizes:
                self._tenant[key] = info.tenant
            else:
                self._described[key] = info.tenant

    def record_insert(self, key: str, nbytes: int) -> None:
        with self._lock:
            if key not in self._sizes:
                self._tenant[key] = self._described.pop(key, None)
            self._sizes[key] = nbytes

    def record_access(self, key: str) -> None:
        pass

    def record_remove(self, key: str) -> None:
        with self._lock:
            self._sizes.pop(key, None)
            self._tenant.pop(key, None)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        out, freed = [], 0
        with self._lock:
            for key, size in self._sizes.items():
                if freed >= nbytes:
                    break
                if (tenant is None or self._tenant[key] == tenant) and not pinned(key):
                    out.append(key)
                    freed += size
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def tenant_bytes(self, tenant: str | None) -> int:
        with self._lock:
            return sum(s for k, s in self._sizes.items() if self._tenant[k] == tenant)


class FifoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slack: int = 0


def _policy_plugin(*specs: PolicySpec) -> types.SimpleNamespace:
    @kvtier.hookimpl
    def kvtier_register_policies(register: Callable[[PolicySpec], None]) -> None:
        for spec in specs:
            register(spec)

    return types.SimpleNamespace(kvtier_register_policies=kvtier_register_policies)


FIFO = PolicySpec(
    name="fifo", kind="eviction", factory=FifoPolicy, config_model=FifoConfig, description="x"
)
FIFO_PLUGIN = _policy_plugin(FIFO)


# --- the kit, on every built-in and on a plugin's --------------------------------------


class TestLRUKit(PolicyKit, PolicyConformanceTests):
    policy_name = "lru"


class TestSLRUKit(PolicyKit, PolicyConformanceTests):
    policy_name = "slru"


class TestPrefixKit(PolicyKit, PolicyConformanceTests):
    policy_name = "prefix"


class TestPrefixThreeLevelsKit(PolicyKit, PolicyConformanceTests):
    policy_name = "prefix"
    options = {"levels": 3, "orphans_first": False, "ghost_factor": 0, "duel_sample": 1}


class TestPrefixFixedShareKit(PolicyKit, PolicyConformanceTests):
    policy_name = "prefix"
    options = {"adaptive": False}


class TestFrequencyKit(PolicyKit, PolicyConformanceTests):
    policy_name = "frequency"
    options = {"min_hits": 3, "width": 1024, "halve_every": 500}


class TestPluginPolicyKit(PolicyKit, PolicyConformanceTests):
    policy_name = "fifo"
    plugins = [("fifo-plugin", FIFO_PLUGIN)]


# --- the hook, the registry and the spec ---------------------------------------------


def test_builtin_policies_arrive_through_the_hook() -> None:
    registry = load_registry(autoload=False)
    assert {"lru", "slru", "prefix", "frequency"} <= set(registry.policies)
    assert registry.policies["frequency"].kind == "admission"
    assert {registry.policies[n].kind for n in ("lru", "slru", "prefix")} == {"eviction"}
    assert registry.origin("policy", "prefix").plugin == "kvtier.policies"
    with pytest.raises(TypeError):
        registry.policies["mine"] = FIFO  # type: ignore[index]


def test_a_plugin_registers_a_policy_and_it_builds() -> None:
    registry = load_registry(autoload=False, plugins=[("fifo-plugin", FIFO_PLUGIN)])
    assert registry.origin("policy", "fifo").plugin == "fifo-plugin"
    policy = registry.policy("fifo", kind="eviction").build({"slack": 1})
    assert isinstance(policy, FifoPolicy)


def test_a_policy_name_declared_twice_names_both_plugins() -> None:
    with pytest.raises(DuplicatePluginError) as info:
        load_registry(
            autoload=False, plugins=[("first", FIFO_PLUGIN), ("second", _policy_plugin(FIFO))]
        )
    assert info.value.plugins == ("first", "second")
    assert "policy 'fifo'" in str(info.value)
    clash = PolicySpec(name="lru", kind="eviction", factory=FifoPolicy)
    with pytest.raises(DuplicatePluginError, match=r"kvtier\.policies"):
        load_registry(autoload=False, plugins=[("clash", _policy_plugin(clash))])


def test_register_takes_only_a_policy_spec() -> None:
    @kvtier.hookimpl
    def kvtier_register_policies(register: Callable[[Any], None]) -> None:
        register({"name": "nope"})

    plugin = types.SimpleNamespace(kvtier_register_policies=kvtier_register_policies)
    with pytest.raises(PluginError, match="PolicySpec"):
        load_registry(autoload=False, plugins=[("bad", plugin)])


def test_unknown_policy_names_say_what_there_is() -> None:
    registry = load_registry(autoload=False)
    with pytest.raises(UnknownNameError, match=r"did you mean 'prefix'"):
        registry.policy("prefx")
    with pytest.raises(UnknownNameError, match="admission policy 'lru'"):
        registry.policy("lru", kind="admission")


def test_options_are_validated_with_the_field_path() -> None:
    spec = load_registry(autoload=False).policy("frequency")
    with pytest.raises(UnknownKeyError) as unknown:
        spec.build({"min_hit": 2}, where="tiers[1].admission")
    assert "did you mean 'min_hits'" in str(unknown.value)
    assert unknown.value.where.startswith("tiers[1].admission")
    with pytest.raises(InvalidFieldError) as invalid:
        spec.build({"min_hits": 0}, where="tiers[1].admission")
    assert invalid.value.path == "tiers[1].admission.min_hits"
    with pytest.raises(InvalidFieldError, match=r"^min_hits"):
        spec.build({"min_hits": "many"})
    assert isinstance(spec.build(None), FrequencyAdmission)
    assert spec.validate({"min_hits": 4}).min_hits == 4  # type: ignore[attr-defined]


def test_a_spec_refuses_a_bad_kind_name_or_factory() -> None:
    with pytest.raises(PluginError, match="kind 'evict'"):
        PolicySpec(name="x", kind="evict", factory=FifoPolicy)  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="name"):
        PolicySpec(name="a b", kind="eviction", factory=FifoPolicy)
    wrong = PolicySpec(name="wrong", kind="admission", factory=FifoPolicy)
    with pytest.raises(PluginError, match=r"not a kvtier\.plugins\.AdmissionPolicy"):
        wrong.build()

    def broken(config: BaseModel) -> None:
        raise RuntimeError("boom")

    with pytest.raises(PluginError, match="boom"):
        PolicySpec(name="broken", kind="eviction", factory=broken).build()
    lazy = PolicySpec(name="lazy", kind="eviction", factory="kvtier.policies.slru:SLRUPolicy")
    assert isinstance(lazy.build({}), SLRUPolicy)  # imported only when built
    with pytest.raises(PluginError, match="not of the form"):
        PolicySpec(name="bad", kind="eviction", factory="no-colon").build()
    with pytest.raises(PluginError, match="cannot import its factory"):
        PolicySpec(name="gone", kind="eviction", factory="kvtier_no_such:Policy").build()


def test_the_plugin_face_exports_the_contract() -> None:
    for name in ("PageInfo", "EvictionPolicy", "AdmissionPolicy", "PolicySpec"):
        assert name in kvtier.plugins.__all__
        assert getattr(kvtier.plugins, name).__module__.startswith("kvtier.core")


def test_policies_import_only_the_core_and_the_hook_markers() -> None:
    for path in sorted((ROOT / "kvtier" / "policies").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
                module = node.module or ""
                assert module.startswith(
                    ("kvtier.core", "kvtier.policies", "kvtier.plugins.hookspecs")
                ), f"{path.name} imports {module}"


# --- each built-in's own behaviour ---------------------------------------------------


def _fill(policy: Any, chain: list[str], size: int = 10, tenant: str | None = None) -> None:
    parent = None
    for key in chain:
        policy.describe(key, PageInfo(parent=parent, tokens=16, tenant=tenant))
        policy.record_insert(key, size)
        parent = key


def test_lru_evicts_the_least_recently_used() -> None:
    policy = LRUPolicy()
    for key in "abc":
        policy.record_insert(key, 10)
    policy.record_access("a")
    assert policy.choose_victims(1) == ["b"]
    assert policy.choose_victims(25) == ["b", "c", "a"]
    assert policy.order() == ["b", "c", "a"]


def test_slru_keeps_pages_used_twice_through_a_scan() -> None:
    policy = SLRUPolicy()
    tier = Tier(policy, capacity=100)
    for key in ("hot1", "hot2"):
        tier.put(key, 10)
        tier.hit(key)
    for i in range(50):  # a scan of pages used once
        tier.put(f"scan{i}", 10)
    assert {"hot1", "hot2"} <= set(tier.pages)
    tier.check()


def test_slru_remembers_a_page_evicted_too_soon() -> None:
    policy = SLRUPolicy()
    tier = Tier(policy, capacity=30)
    for key in ("a", "b", "c", "d"):
        tier.put(key, 10)
    assert "a" not in tier.pages  # evicted from probation
    tier.put("a", 10)  # back while the ghost remembers it: protected
    for i in range(5):
        tier.put(f"new{i}", 10)
    assert "a" in tier.pages


def test_prefix_evicts_a_chain_from_its_leaf_up() -> None:
    policy = PrefixPolicy()
    _fill(policy, ["root", "mid", "leaf"])
    assert policy.choose_victims(1) == ["leaf"]
    assert policy.choose_victims(30) == ["leaf", "mid", "root"]
    # a new chain under the same root, looked up through it: the old leaf goes first
    policy.record_access("root")
    _fill(policy, ["other"])
    policy.describe("branch", PageInfo(parent="root", tokens=16))
    policy.record_insert("branch", 10)
    assert policy.choose_victims(1) == ["leaf"]


def test_prefix_evicts_orphans_first_and_takes_them_back() -> None:
    policy = PrefixPolicy()
    _fill(policy, ["a", "b", "c"])
    _fill(policy, ["x", "y"])
    for key in ("b", "c"):  # b and c used again: protected above a, x and y
        policy.record_access(key)
    policy.record_remove("a")  # deleted: b and c are unreachable here now
    assert policy.choose_victims(20) == ["c", "b"]  # the dead subtree, leaf first
    assert policy.levels()["orphans"] == 2
    policy.describe("a", PageInfo(parent=None, tokens=16))
    policy.record_insert("a", 10)  # their parent is back
    assert policy.levels()["orphans"] == 0
    assert policy.choose_victims(1) == ["y"]
    policy.record_remove("x")
    assert policy.choose_victims(10) == ["y"]  # an orphan
    policy.record_access("y")  # hit after all (its parent is in another tier)
    assert policy.levels()["orphans"] == 0


def test_prefix_levels_follow_reuse_and_the_ghost_remembers() -> None:
    policy = PrefixPolicy(PrefixConfig(levels=2))
    _fill(policy, ["p"])
    assert policy.levels()["level0"] == 1
    policy.record_access("p")
    policy.record_access("p")
    assert policy.levels()["level2"] == 1
    policy.record_remove("p")
    _fill(policy, ["p"])  # comes back while remembered: one level above where it was
    assert policy.levels()["level2"] == 1
    forgetful = PrefixPolicy(PrefixConfig(ghost_factor=0))
    for i in range(40):
        _fill(forgetful, [f"k{i}"])
        forgetful.record_remove(f"k{i}")
    _fill(forgetful, ["k0"])
    assert forgetful.levels()["level0"] == 1  # forgotten: probation again


def test_prefix_protected_levels_keep_their_share() -> None:
    policy = PrefixPolicy(PrefixConfig(levels=2, protected_fraction=0.5))
    tier = Tier(policy, capacity=1000)
    for i in range(100):
        tier.put(f"k{i}", 10)
        tier.hit(f"k{i}")
        tier.hit(f"k{i}")
    assert policy.levels()["level2"] == 100  # the tier is not full: nothing to balance
    assert policy.choose_victims(10) == ["k0"]  # full: the shares hold, oldest first
    levels = policy.levels()
    assert levels["level2"] <= 25 + 1 and levels["level1"] <= 25 + 1
    tier.check()


def test_prefix_keeps_a_shared_prefix_through_one_off_chains() -> None:
    """A page every request starts with (a system prompt) outlives the one-off chains
    under it, each longer than the tier holds; LRU loses it, so the test can fail."""

    def keeps_the_root(policy: Any) -> bool:
        tier = Tier(policy, capacity=100)
        tier.put("system", 10, PageInfo(tokens=16))
        for r in range(30):
            tier.hit("system")
            parent = "system"
            for p in range(12):
                key = f"r{r}-p{p}"
                tier.put(key, 10, PageInfo(parent=parent, tokens=16))
                parent = key
            tier.check()
        return "system" in tier.pages

    assert keeps_the_root(PrefixPolicy())
    assert keeps_the_root(SLRUPolicy())
    assert not keeps_the_root(LRUPolicy())


def _second_use_soon(adaptive: bool) -> tuple[int, float]:
    """Every page used twice, the second time 30 pages later, in a tier of 100 pages:
    LRU keeps each page until its second use; probation (a tenth) does not."""
    policy = PrefixPolicy(PrefixConfig(adaptive=adaptive))
    tier = Tier(policy, capacity=1000)
    hits = 0
    for i in range(6000):
        tier.put(f"p{i}", 10)
        again = f"p{i - 30}"
        if again in tier.pages:
            hits += 1
            tier.hit(again)
        elif i >= 30:
            tier.put(again, 10)
    tier.check()
    return hits, policy.protected_fraction


def test_prefix_duel_with_lru_lowers_protection_where_recency_wins() -> None:
    fixed_hits, fixed_share = _second_use_soon(adaptive=False)
    hits, share = _second_use_soon(adaptive=True)
    assert fixed_share == 0.9 and fixed_hits < 200  # protected holds pages used up
    assert share < 0.5  # the sampled LRU shadow hit more, so protection went down
    assert hits > 4000  # and now the second uses hit here too


def test_prefix_duel_keeps_protection_where_it_wins() -> None:
    """30 pages reused every round between one-off pages (3 a round) in a tier of 100:
    LRU loses the reused pages to the one-offs, probation does not; the share stays."""
    policy = PrefixPolicy()
    tier = Tier(policy, capacity=1000)
    hits = 0
    for i in range(3000):
        hot = f"hot{i % 30}"
        if hot in tier.pages:
            hits += 1
            tier.hit(hot)
        else:
            tier.put(hot, 10)
        for j in range(3):
            tier.put(f"once{i}-{j}", 10)
    assert policy.protected_fraction == 0.9
    assert hits >= 2900


@pytest.mark.parametrize("name", ["prefix", "slru"])
def test_the_ghost_is_bounded_and_remembers_the_most_recent(name: str) -> None:
    """The ghost holds at most 4/3 of ghost_factor x the resident pages (plus 16): its
    two generations, the older dropped whole; a key evicted a moment ago is remembered,
    one evicted thousands of evictions ago is not."""
    policy = load_registry(autoload=False).policy(name).build({"ghost_factor": 2})
    tier = Tier(policy, capacity=200)  # 20 pages of 10 bytes
    for i in range(2000):
        tier.put(f"k{i}", 10)
        assert policy.remembered() <= 4 / 3 * 2 * len(policy) + 16
    assert policy.remembered() >= 2 / 3 * 2 * len(policy)  # never less than one generation
    tier.check()
    recent = next(f"k{i}" for i in range(1999, 0, -1) if f"k{i}" not in tier.pages)
    for key in (recent, "k0"):  # remembered, then forgotten: put back, then a scan
        tier.put(key, 10)
        for i in range(30):  # more than the tier holds
            tier.put(f"{key}-scan{i}", 10)
    assert recent in tier.pages  # it came back protected
    assert "k0" not in tier.pages  # forgotten: it came back on probation, and left


def test_frequency_admits_from_the_min_hits_th_sighting() -> None:
    policy = FrequencyAdmission(FrequencyConfig(min_hits=2))
    policy.record_access("k")
    assert policy.admit("k", 1) is False
    policy.record_access("k")
    assert policy.admit("k", 1) is True
    assert policy.estimate("never") == 0
    assert policy.memory_bytes == 4 * (1 << 16)


def test_frequency_counts_fade_by_halving() -> None:
    policy = FrequencyAdmission(FrequencyConfig(min_hits=2, width=64, halve_every=10))
    policy.record_access("k")
    policy.record_access("k")
    assert policy.estimate("k") >= 2
    for i in range(8):
        policy.record_access(f"other{i}")  # the 10th access halves every counter
    assert policy.estimate("k") == 1
    assert policy.admit("k", 1) is False


def test_frequency_is_the_same_in_every_instance_of_a_seed() -> None:
    keys = [f"key{i}" for i in range(300)]
    a = FrequencyAdmission(FrequencyConfig(width=64, seed=7))
    b = FrequencyAdmission(FrequencyConfig(width=64, seed=7))
    for key in keys:
        a.record_access(key)
        b.record_access(key)
    assert [a.estimate(k) for k in keys] == [b.estimate(k) for k in keys]


def test_the_kit_workload_fills_and_checks_a_tier() -> None:
    tier, victims = workload(PrefixPolicy(), seed=9, steps=500)
    assert any(victims) and tier.nbytes <= tier.capacity
    tier.check()


def _policy_benchmark() -> types.ModuleType:
    """``benchmarks/policies.py``, imported as a module (it is a script, not a package)."""
    name = "kvtier_benchmark_policies"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "policies.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (its dataclasses look their module up)
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_policy_benchmark_replays_a_trace_beside_lru_the_oracle_and_opt(
    tmp_path: Path,
) -> None:
    """A document of 4 blocks asked every third request between one-off chains of 6, in
    a cache of 7 blocks: LRU loses the document between two asks, an oracle that admits
    only what comes back (and OPT) keep it, and so does ``prefix`` after its second ask."""
    trace = tmp_path / "trace.jsonl"
    rows, fresh = [], 100
    for r in range(60):
        if r % 3 == 0:
            ids = [0, 1, 2, 3]
        else:
            ids, fresh = list(range(fresh, fresh + 6)), fresh + 6
        rows.append({"timestamp": r, "input_length": 512 * len(ids), "hash_ids": ids})
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    bench = _policy_benchmark()
    lines = bench.run(bench.load_trace(trace), [0.03], ["lru", "prefix"], reps=0)
    out = {line["policy"]: line for line in lines if line["baseline_name"] == "lru"}
    asks_after_the_first = 19 * 4 / (20 * 4 + 40 * 6)
    lru, prefix = out["lru"], out["prefix"]
    assert lru["capacity_blocks"] == 7 and lru["hit_ratio"] == 0
    assert lru["reuse_oracle_hit_ratio"] == pytest.approx(asks_after_the_first, abs=1e-4)
    assert lru["opt_hit_ratio"] == pytest.approx(asks_after_the_first, abs=1e-4)
    assert prefix["lru_hit_ratio"] == 0 and prefix["ns_per_access"] is None
    assert prefix["hit_ratio"] >= asks_after_the_first - 2 * 4 / 320  # all but two asks hit
    assert prefix["capacity_overflows"] == 0
    # through a real chain tier (a memory backend evicting through the policy), the same
    chained = {line["policy"]: line for line in lines if "in a chain tier" in line["case"]}
    assert {row: line["hit_ratio"] for row, line in chained.items()} == {
        "lru": lru["hit_ratio"],
        "prefix": prefix["hit_ratio"],
    }
    assert chained["prefix"]["ours"] is None and chained["prefix"]["replay_us_per_access"] > 0
    false = {line["policy"]: line for line in lines if "false parents" in line["case"]}
    assert false["lru"]["hit_ratio"] == lru["hit_ratio"]  # LRU reads no parent
    assert false["prefix"]["true_parents_hit_ratio"] == prefix["hit_ratio"]
    assert false["prefix"]["merged_requests"] == bench.DEFAULT_MERGED
    costed = bench.run(bench.load_trace(trace), [0.03], ["prefix"], reps=1)
    (in_chain,) = [line for line in costed if "in a chain tier" in line["case"]]
    assert in_chain["ours"] >= 0 and in_chain["baseline"] >= 0  # ns per access, both sides
    assert in_chain["ours"] == in_chain["chain_ns_per_access"]
    start, end = bench.parse_slice("30:")
    half = bench.load_trace(trace, end, start)  # the second half alone
    assert len(half.requests) == 30 and half.distinct == 4 + 20 * 6
    assert bench.parse_slice("5:10") == (5, 10)
    with pytest.raises(SystemExit, match="START:END"):
        bench.parse_slice("10:5")


# --- backends' capacity through a given policy ---------------------------------------


class Recording(LRUPolicy):
    """LRU that records what it is told and asked, and can be told to prefer a key."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.prefer: str | None = None

    def record_insert(self, key: str, nbytes: int) -> None:
        self.calls.append(("insert", key))
        super().record_insert(key, nbytes)

    def record_access(self, key: str) -> None:
        self.calls.append(("access", key))
        super().record_access(key)

    def record_remove(self, key: str) -> None:
        self.calls.append(("remove", key))
        super().record_remove(key)

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        self.calls.append(("victims", str(nbytes)))
        if self.prefer is not None and self.prefer in self and not pinned(self.prefer):
            return [self.prefer]
        return super().choose_victims(nbytes, pinned=pinned, tenant=tenant)


GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def _context(policy: Any = None, namespace: str = "default") -> BackendContext:
    return BackendContext(GEOMETRY, Layout.PAGE_FIRST, namespace=namespace, eviction=policy)


def _page(fill: int, size: int = 100) -> list[Extent]:
    return [extent_of_view(memoryview(bytearray([fill]) * size))]


def test_the_memory_backend_evicts_through_the_given_policy() -> None:
    policy = Recording()
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300), _context(policy))
    assert backend.eviction is policy
    assert backend.put(["a", "b", "c"], [_page(i) for i in range(3)]) == [True] * 3
    assert backend.get(["a"], [_page(0)]) == [True]
    policy.prefer = "c"  # the policy, not recency, decides
    assert backend.put(["d"], [_page(3)]) == [True]
    assert backend.exists(["a", "b", "c", "d"]) == [True, True, False, True]
    assert ("access", "a") in policy.calls and ("remove", "c") in policy.calls
    assert backend.delete(["a"]) == [True] and "a" not in policy
    backend.clear()
    assert len(policy) == 0 and policy.nbytes == 0
    assert isinstance(MemoryBackend().eviction, LRUPolicy)  # None: the built-in lru


def test_the_memory_backend_refuses_a_put_its_policy_cannot_make_room_for() -> None:
    class Stingy(LRUPolicy):
        def choose_victims(self, nbytes: int, **_: Any) -> list[str]:
            return []

    backend = MemoryBackend(MemoryConfig(capacity_bytes=200), _context(Stingy()))
    assert backend.put(["a", "b"], [_page(1), _page(2)]) == [True, True]
    assert backend.put(["c"], [_page(3)]) == [False]
    stats = backend.stats()
    assert stats["put_failed_capacity"] == 1 and stats["bytes"] == 200


def test_the_file_backend_evicts_through_the_given_policy(tmp_path: Path) -> None:
    policy = Recording()
    config = FileConfig(root=tmp_path / "pages", capacity_bytes=300, min_free_bytes=0)
    backend = FileBackend(config, _context(policy))
    try:
        assert backend.index.eviction is policy
        for i, key in enumerate("abc"):
            assert backend.put([key], [_page(i)]) == [True]
        assert backend.get(["a"], [_page(0)]) == [True]
        policy.prefer = "c"
        assert backend.put(["d"], [_page(3)]) == [True]
        assert backend.exists(["a", "b", "c", "d"]) == [True, True, False, True]
        assert ("access", "a") in policy.calls and ("remove", "c") in policy.calls
        policy.prefer = "d"  # the page being written is never a victim, nor asked for
        assert backend.put(["d"], [_page(4, size=150)]) == [True]
        assert backend.exists(["d"]) == [True] and backend.stats()["bytes"] <= 300
    finally:
        backend.close()
    again = FileBackend(config, _context(fresh := Recording()))
    try:  # the index is rebuilt from disk into the policy
        assert {key for op, key in fresh.calls if op == "insert"} == set(again.index.keys())
    finally:
        again.close()


def test_the_file_index_default_is_the_builtin_lru(tmp_path: Path) -> None:
    index = FileIndex(tmp_path)
    assert isinstance(index.eviction, LRUPolicy)
    index.commit_many([("a", 1), ("b", 1)])
    index.touch("a")
    assert index.keys() == ["b", "a"]


def test_mooncake_occupancy_tells_its_policy_the_page_keys() -> None:
    policy = Recording()
    occupancy = Occupancy(30, eviction=policy, prefix="kv/ns/")
    for key in ("a", "b", "c"):
        occupancy.stored(f"kv/ns/{key}", 10)
    occupancy.touch(["kv/ns/a"])
    assert ("access", "a") in policy.calls
    assert occupancy.victims(10, keep=set()) == ["kv/ns/b"]
    assert occupancy.victims(20, keep={"kv/ns/b"}) == ["kv/ns/c", "kv/ns/a"]
    occupancy.forget(["kv/ns/b"])
    assert "b" not in policy and occupancy.snapshot() == (2, 20)
    policy.record_insert("stray", 10)  # a page this client never stored
    policy.prefer = "stray"
    assert occupancy.victims(10, keep=set()) == []
    assert "stray" not in policy  # forgotten, so it is not named again
    occupancy.clear()
    assert len(policy) == 0


@pytest.fixture(scope="module")
def mooncake_backend() -> Iterator[Callable[[Any], Any]]:
    from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason, use_client_env

    require("mooncake", mooncake_unavailable_reason())
    use_client_env()
    master = MooncakeMaster(storage_node_bytes=64 << 20)
    master.start()
    opened: list[Any] = []

    def build(policy: Any) -> Any:
        from kvtier.backends.mooncake.backend import MooncakeBackend
        from kvtier.backends.mooncake.config import MooncakeConfig

        config = MooncakeConfig(
            master_address=master.address, global_segment_size=0, capacity_bytes=300
        )
        backend = MooncakeBackend(config, _context(policy, f"t-{uuid.uuid4().hex[:12]}"))
        opened.append(backend)
        return backend

    try:
        yield build
    finally:
        for backend in opened:
            backend.close()
        master.close()


@pytest.mark.mooncake
def test_mooncake_capacity_evicts_through_the_given_policy(
    mooncake_backend: Callable[[Any], Any],
) -> None:
    policy = Recording()
    backend = mooncake_backend(policy)
    for i, key in enumerate("abc"):
        assert backend.put([key], [_page(i)]) == [True]
    policy.prefer = "b"
    assert backend.put(["d"], [_page(3)]) == [True]
    assert backend.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert ("remove", "b") in policy.calls and "d" in policy
    assert backend.stats()["capacity_evictions"] == 1
