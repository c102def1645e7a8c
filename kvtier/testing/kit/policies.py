"""The policies' conformance kit: what every eviction and admission policy must do.

A policy plugin's test module subclasses :class:`PolicyKit` (which names the policy and
builds it through its ``PolicySpec``, as a tier does) and the mixins::

    from kvtier.testing import PolicyConformanceTests, PolicyKit

    class TestMyPolicy(PolicyKit, PolicyConformanceTests):
        policy_name = "my_policy"
        options = {"knob": 3}                      # validated against its config_model
        plugins = [("my-policy", my_policy)]       # found without an entry point

An eviction policy is driven the way a tier drives one (:class:`Tier`: record every
insert, hit and removal; when full, remove each victim ``choose_victims`` names) on seeded
random workloads of prefix chains, tenants and deletes, and must keep the capacity,
never name a pinned page or another tenant's, give the same victims for the same calls,
shrug off unknown keys and keep its counts right under threads. An admission policy must
answer the same for the same calls and stay whole under threads. A test of one kind is
skipped for a policy of the other.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from kvtier.core.policy import AdmissionPolicy, EvictionPolicy, PageInfo
from kvtier.core.specs import PolicySpec
from kvtier.testing.kit.harness import load_kit_registry

__all__ = [
    "AdmissionPolicyTests",
    "EvictionPolicyTests",
    "PolicyConformanceTests",
    "PolicyEnv",
    "PolicyKit",
    "Tier",
    "workload",
]


@dataclass
class PolicyEnv:
    """The policy under test: its spec, and :meth:`build` for a fresh instance."""

    spec: PolicySpec
    options: Mapping[str, Any]

    def build(self) -> Any:
        """A fresh instance, built through the spec as a tier builds one."""
        return self.spec.build(self.options)

    def eviction(self) -> EvictionPolicy:
        """A fresh instance of an eviction policy (skips the test for another kind)."""
        if self.spec.kind != "eviction":
            pytest.skip(f"policy {self.spec.name!r} is an {self.spec.kind} policy")
        policy = self.build()
        assert isinstance(policy, EvictionPolicy)
        return policy

    def admission(self) -> AdmissionPolicy:
        """A fresh instance of an admission policy (skips the test for another kind)."""
        if self.spec.kind != "admission":
            pytest.skip(f"policy {self.spec.name!r} is an {self.spec.kind} policy")
        policy = self.build()
        assert isinstance(policy, AdmissionPolicy)
        return policy


class PolicyKit:
    """The fixture class a policy's test module subclasses (with one or more mixins).

    Set ``policy_name``; ``options`` are its options (checked against its
    ``config_model``); list plugin modules that are not installed through an entry point
    in ``plugins`` as ``(name, module)`` pairs.
    """

    policy_name: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Any]] = {}
    plugins: ClassVar[Sequence[tuple[str, object]]] = ()

    @pytest.fixture
    def policy_kit(self) -> PolicyEnv:
        """The policy's spec, from a registry loaded as kvtier loads one."""
        if not self.policy_name:
            pytest.fail(f"{type(self).__name__} must set policy_name")
        registry = load_kit_registry(self.plugins)
        return PolicyEnv(registry.policy(self.policy_name), dict(self.options))


@dataclass
class Tier:
    """A tier as the contract describes one: it owns its pages and tells the policy.

    ``put`` records the page and, when the tier is over ``capacity``, removes every victim
    ``choose_victims`` names (never ``keep``, nor what ``pinned`` holds) and records each
    removal; it returns the victims. Everything it does is checked against the policy.
    """

    policy: EvictionPolicy
    capacity: int
    pages: dict[str, int] = field(default_factory=dict)
    tenants: dict[str, str | None] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(self.pages.values())

    def put(self, key: str, nbytes: int, info: PageInfo | None = None) -> list[str]:
        if info is not None:
            self.policy.describe(key, info)
            self.tenants[key] = info.tenant
        self.pages[key] = nbytes
        self.policy.record_insert(key, nbytes)
        excess = self.nbytes - self.capacity
        if excess <= 0:
            return []
        keep = key
        victims = self.policy.choose_victims(excess, pinned=lambda k: k == keep or k in self.pinned)
        assert len(victims) == len(set(victims)), f"victims named twice: {victims}"
        for victim in victims:
            assert victim != keep and victim not in self.pinned, f"{victim!r} was pinned"
            assert victim in self.pages, f"victim {victim!r} is not a page of the tier"
            self.remove(victim)
        return victims

    def hit(self, key: str) -> None:
        if key in self.pages:
            self.policy.record_access(key)

    def remove(self, key: str) -> None:
        self.pages.pop(key, None)
        self.tenants.pop(key, None)
        self.policy.record_remove(key)

    def check(self) -> None:
        """The policy tracks exactly the tier's pages, their bytes and tenants' bytes."""
        policy = self.policy
        assert len(policy) == len(self.pages)
        assert policy.nbytes == self.nbytes
        for key in self.pages:
            assert key in policy, f"{key!r} is in the tier but not in the policy"
        for tenant in {*self.tenants.values(), None, "nobody"}:
            expected = sum(
                size for key, size in self.pages.items() if self.tenants.get(key) == tenant
            )
            assert policy.tenant_bytes(tenant) == expected, tenant


def workload(
    policy: EvictionPolicy, seed: int, *, steps: int = 3000, tenants: bool = False
) -> tuple[Tier, list[list[str]]]:
    """Drive ``policy`` through a seeded random mix of prefix chains (a request walks
    its chain, hits the resident pages and puts the rest), revisits and deletes, in a
    :class:`Tier` of 96 KiB; the tier and the victims of every put."""
    rng = random.Random(seed)
    tier = Tier(policy, capacity=96 * 1024)
    chains = [[f"c{c}-p{p}" for p in range(rng.randint(1, 12))] for c in range(120)]
    owners = [rng.choice(["a", "b", None]) if tenants else None for _ in chains]
    victims: list[list[str]] = []
    for _ in range(steps):
        roll = rng.random()
        c = int(rng.paretovariate(1.2)) % len(chains) if roll < 0.7 else rng.randrange(120)
        chain = chains[c]
        if roll > 0.97 and tier.pages:  # a delete, or a page found invalid
            tier.remove(rng.choice(sorted(tier.pages)))
            continue
        parent = None
        for key in chain[: rng.randint(1, len(chain))]:
            if key in tier.pages:
                tier.hit(key)
            else:
                size = rng.choice((1024, 2048, 4096, 8192))
                info = PageInfo(parent=parent, tokens=rng.randint(1, 16), tenant=owners[c])
                victims.append(tier.put(key, size, info))
                assert tier.nbytes <= tier.capacity, "the victims did not make room"
            parent = key
    return tier, victims


class EvictionPolicyTests:
    """The contract of an eviction policy, driven as a tier drives one."""

    def test_kit_policy_keeps_the_capacity(self, policy_kit: PolicyEnv) -> None:
        tier, victims = workload(policy_kit.eviction(), seed=0)
        assert any(victims), "the workload never filled the tier"
        tier.check()

    def test_kit_policy_counts_tenants(self, policy_kit: PolicyEnv) -> None:
        tier, _victims = workload(policy_kit.eviction(), seed=1, steps=1500, tenants=True)
        tier.check()
        key = next(iter(tier.pages))
        tier.policy.describe(key, PageInfo(tenant="moved"))  # a resident page changes hands
        tier.tenants[key] = "moved"
        tier.check()

    def test_kit_policy_never_names_a_pinned_page(self, policy_kit: PolicyEnv) -> None:
        tier, _victims = workload(policy_kit.eviction(), seed=2, steps=800)
        resident = sorted(tier.pages)
        pinned = set(resident[::2])
        chosen = tier.policy.choose_victims(tier.nbytes, pinned=lambda k: k in pinned)
        assert not pinned & set(chosen)
        unpinned = sum(tier.pages[k] for k in resident if k not in pinned)
        assert sum(tier.pages[k] for k in chosen) == unpinned, "it may take every other page"
        assert tier.policy.choose_victims(1, pinned=lambda k: True) == []
        tier.check()  # choosing removed nothing

    def test_kit_policy_names_only_that_tenants_pages(self, policy_kit: PolicyEnv) -> None:
        tier, _victims = workload(policy_kit.eviction(), seed=3, steps=1500, tenants=True)
        for tenant in ("a", "b"):
            theirs = {k for k, t in tier.tenants.items() if t == tenant}
            chosen = tier.policy.choose_victims(tier.nbytes, tenant=tenant)
            assert set(chosen) <= theirs, f"pages of others chosen for tenant {tenant!r}"
            assert set(chosen) == theirs, f"tenant {tenant!r} has more pages to give"
            small = tier.policy.choose_victims(1, tenant=tenant)
            assert set(small) <= theirs and bool(small) == bool(theirs)
        assert tier.policy.choose_victims(1, tenant="nobody") == []

    def test_kit_policy_frees_what_it_is_asked(self, policy_kit: PolicyEnv) -> None:
        tier, _victims = workload(policy_kit.eviction(), seed=4, steps=600)
        policy = tier.policy
        assert policy.choose_victims(0) == []
        for want in (1, 5000, tier.nbytes // 2, tier.nbytes, tier.nbytes * 2):
            chosen = policy.choose_victims(want)
            freed = sum(tier.pages[k] for k in chosen)
            assert freed >= min(want, tier.nbytes), (want, freed)
            assert len(chosen) == len(set(chosen))
        assert Tier(policy_kit.eviction(), 1).policy.choose_victims(10) == []  # empty

    def test_kit_policy_same_calls_same_victims(self, policy_kit: PolicyEnv) -> None:
        _tier, first = workload(policy_kit.eviction(), seed=5, tenants=True)
        _tier, second = workload(policy_kit.eviction(), seed=5, tenants=True)
        assert first == second, "the same calls gave other victims"

    def test_kit_policy_shrugs_off_unknown_keys(self, policy_kit: PolicyEnv) -> None:
        policy = policy_kit.eviction()
        policy.record_remove("never-seen")
        policy.record_access("never-seen")
        assert "never-seen" not in policy and len(policy) == 0 and policy.nbytes == 0
        policy.describe("only-described", PageInfo(parent="nobody", tokens=3, tenant="t"))
        assert "only-described" not in policy and policy.nbytes == 0
        policy.record_insert("k", 100)
        policy.record_insert("k", 300)  # re-written, another size
        assert len(policy) == 1 and policy.nbytes == 300
        policy.record_remove("k")
        policy.record_remove("k")
        assert len(policy) == 0 and policy.nbytes == 0 and policy.tenant_bytes(None) == 0
        assert policy.choose_victims(1) == []

    def test_kit_policy_is_thread_safe(self, policy_kit: PolicyEnv) -> None:
        policy = policy_kit.eviction()
        threads, rounds = 8, 400
        kept: list[dict[str, int]] = [{} for _ in range(threads)]
        errors: list[BaseException] = []
        start = threading.Barrier(threads)

        def work(t: int) -> None:
            rng = random.Random(t)
            mine = kept[t]
            try:
                start.wait()
                for i in range(rounds):
                    key = f"t{t}-{i % 50}"
                    parent = f"t{t}-{i % 50 - 1}" if i % 50 else None
                    policy.describe(key, PageInfo(parent=parent, tokens=8, tenant=f"t{t % 2}"))
                    size = rng.choice((100, 200, 300))
                    policy.record_insert(key, size)
                    mine[key] = size
                    policy.record_access(key)
                    for victim in policy.choose_victims(500, tenant=f"t{t % 2}"):
                        assert isinstance(victim, str)
                    if rng.random() < 0.4:
                        gone = rng.choice(sorted(mine))
                        policy.record_remove(gone)
                        del mine[gone]
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors, errors
        assert policy.nbytes == sum(sum(mine.values()) for mine in kept)
        assert len(policy) == sum(len(mine) for mine in kept)
        for parity in (0, 1):
            expected = sum(sum(m.values()) for t, m in enumerate(kept) if t % 2 == parity)
            assert policy.tenant_bytes(f"t{parity}") == expected


def _answers(policy: AdmissionPolicy, seed: int) -> list[bool]:
    rng = random.Random(seed)
    answers = []
    for _ in range(3000):
        key = f"k{int(rng.paretovariate(1.1)) % 500}"
        policy.describe(key, PageInfo(parent=None, tokens=16, tenant=rng.choice(["a", None])))
        policy.record_access(key)
        answer = policy.admit(key, 4096)
        assert isinstance(answer, bool)
        answers.append(answer)
    return answers


class AdmissionPolicyTests:
    """The contract of an admission policy."""

    def test_kit_admission_same_calls_same_answers(self, policy_kit: PolicyEnv) -> None:
        assert _answers(policy_kit.admission(), 0) == _answers(policy_kit.admission(), 0)

    def test_kit_admission_answers_unknown_keys(self, policy_kit: PolicyEnv) -> None:
        policy = policy_kit.admission()
        assert isinstance(policy.admit("never-seen", 1), bool)
        policy.record_access("seen-once")
        assert isinstance(policy.admit("seen-once", 0), bool)

    def test_kit_admission_is_thread_safe(self, policy_kit: PolicyEnv) -> None:
        policy = policy_kit.admission()
        errors: list[BaseException] = []
        start = threading.Barrier(8)

        def work(t: int) -> None:
            try:
                start.wait()
                for i in range(500):
                    key = f"k{(i * 7 + t) % 97}"
                    policy.record_access(key)
                    assert isinstance(policy.admit(key, 4096), bool)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors, errors


class PolicyConformanceTests(EvictionPolicyTests, AdmissionPolicyTests):
    """Every test of the policy kit; those of the other kind skip."""
