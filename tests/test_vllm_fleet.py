"""Several real vLLM engines on one store at once: a fleet, and prefill/decode handoff.

Each engine is a long-running vLLM CPU engine process (``tests/vllm_engine/server.py``,
driven by ``served.py``) taking requests while the others run, all on one Mooncake master
started on loopback by the fixture:

- the *fleet*: engines ``a`` and ``b``, each with a tier of its own (``file`` on a,
  ``segment`` on b) above the shared Mooncake store, and a tenant with a quota; requests
  sharing a long prefix alternate between them while both run, an engine is killed
  (``kill -9``) and restarted while the other writes, and the master is killed and
  restarted mid-run; a router follows both through their KV events;
- *prefill/decode*: a ``kv_producer`` engine computes prompts and stores them, a
  ``kv_consumer`` engine serves them from the store, waiting for the producer's
  announced pages (``kv_transfer_params``), with a page corrupted or missing.

Every output is compared with the same prompt computed by an engine with no connector
(greedy, one prompt at a time in both): no check ever accepts a wrong token.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm import ROOT, _vllm_python
from test_vllm_production import _build

from kvtier.integrations.router import EventFeed, PrefixRouter, Stored, block_ids, decode_batch
from kvtier.testing import require

sys.path.insert(0, str(ROOT / "tests" / "vllm_engine"))
from served import ServedEngine

BLOCK = 32
_rng = random.Random(34)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(1, 500) for _ in range(n)]


SHARED = _tokens(8 * BLOCK)  # 8 whole pages
ALTERNATING = [SHARED + _tokens(5 + i) for i in range(6)]
WRITTEN = [_tokens(6 * BLOCK) + _tokens(7) for _ in range(4)]  # while b restarts
TENANT = [_tokens(6 * BLOCK) + _tokens(9) for _ in range(2)]  # salted: a tenant's own
OUTAGE = [_tokens(4 * BLOCK) + _tokens(3 + i) for i in range(4)]  # while the master is down
RECOVERED = [_tokens(6 * BLOCK) + _tokens(5) for _ in range(4)]  # after the master restarts
HANDOFF = [_tokens(10 * BLOCK) + _tokens(11) for _ in range(3)]
EVERY = [*ALTERNATING, *WRITTEN, *TENANT, *OUTAGE, *RECOVERED, *HANDOFF]
MAX_TOKENS = 8
#: Shorter than a page: a request that stores nothing, only makes its engine step.
NUDGE = [11, 12, 13, 14, 15]
#: The quota of the tenant ``small``, in pages.
QUOTA_PAGES = 3


@pytest.fixture(scope="module")
def python() -> Path:
    return _vllm_python()


@pytest.fixture(scope="module")
def model(python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(python, tmp_path_factory.mktemp("fleet-model"), "llama")


@pytest.fixture(scope="module")
def master() -> Iterator[Any]:
    from kvtier.testing.mooncake import MooncakeMaster, mooncake_unavailable_reason

    require("mooncake", mooncake_unavailable_reason())
    # a storage node holds the store's memory, so pages outlive the engines that put them
    # (a read lease of 1 s: a page is damaged, through the store, soon after it is read)
    with MooncakeMaster(storage_node_bytes=256 << 20, lease_ttl_ms=1000) as started:
        started.start()
        yield started


ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def _mooncake(master: Any) -> dict[str, Any]:
    return {
        "backend": "mooncake",
        "extra_config": {"master_address": master.address, "global_segment_size": 0},
    }


def _start(
    python: Path, model: Path, work: Path, name: str, kvtier: dict[str, Any] | None, **job: Any
) -> ServedEngine:
    spec: dict[str, Any] = {"model": str(model), "connector": None, **job}
    if kvtier is not None:
        spec.update(connector="kvtier", kvtier=kvtier)
    return ServedEngine(python, spec, work, env=ENV, name=name)


def _one_by_one(engine: ServedEngine, prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
    return [engine.generate([p], MAX_TOKENS, **kw)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference(python: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every prompt's greedy tokens computed by an engine with no connector."""
    engine = _start(python, model, tmp_path_factory.mktemp("ref"), "reference", None)
    try:
        engine.wait_ready()
        return {
            tuple(p): r["tokens"] for p, r in zip(EVERY, _one_by_one(engine, EVERY), strict=True)
        }
    finally:
        engine.quit()


def _same(reference: dict, prompt: list[int], result: dict[str, Any]) -> bool:
    return result["tokens"] == reference[tuple(prompt)]


# --- the fleet: two engines at once on one store ------------------------------------------------


#: Each engine's own tier: a file store on a, a segment store on b.
LOCAL = {"a": "file", "b": "segment"}


def _fleet_section(
    name: str, root: Path, master: Any, page_bytes: int | None = None
) -> dict[str, Any]:
    local = {"backend": LOCAL[name], "extra_config": {"root": str(root)}}
    section: dict[str, Any] = {"tiers": [local, _mooncake(master)]}
    if page_bytes is not None:
        section["tenants"] = {"small": {"quota_bytes": QUOTA_PAGES * page_bytes}}
    return section


def _page_bytes(model: Path) -> int:
    """Bytes of one page of the model, from its own config (K and V, bfloat16)."""
    import json

    config = json.loads((model / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_key_value_heads"] * head * 2
    return config["num_hidden_layers"] * per_token * BLOCK


@pytest.fixture(scope="module")
def fleet(
    python: Path,
    model: Path,
    master: Any,
    reference: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Runs the fleet's scenario once; each check below reads its part of the record."""
    work = tmp_path_factory.mktemp("fleet")
    roots = {name: work / f"pages-{name}" for name in ("a", "b")}
    page = _page_bytes(model)
    endpoints = {name: f"ipc://{work}/events-{name}" for name in ("a", "b")}
    engines = {
        name: _start(
            python,
            model,
            work,
            name,
            _fleet_section(name, roots[name], master, page),
            kv_events_endpoint=endpoints[name],
        )
        for name in ("a", "b")
    }
    record: dict[str, Any] = {"page": page}
    router = PrefixRouter(list(engines), block_size=BLOCK)
    media: set[tuple[str, str | None]] = set()

    def decode(payload: bytes) -> list[Any]:  # the router's, noting each store's locality
        events = decode_batch(payload)
        media.update((e.medium or "", e.locality) for e in events if isinstance(e, Stored))
        return events

    feeds: list[EventFeed] = []
    try:
        for engine in engines.values():
            engine.wait_ready()
        feeds = [EventFeed(endpoints[name], name, router, decode) for name in engines]
        a, b = engines["a"], engines["b"]
        # 1. a computes the shared prefix; then requests alternate, both engines running
        record["first"] = a.generate([ALTERNATING[0]], MAX_TOKENS)[0]
        a.flush()
        # an engine publishes its tiers' events at its steps: the Mooncake stores the flush
        # waited for (a cascade after the request's last step) reach the router at a's next
        a.generate([NUDGE], 1)
        record["route"] = _routed(router, ALTERNATING[1], len(SHARED) // BLOCK)
        record["before_b"] = b.stats()
        for i, prompt in enumerate(ALTERNATING[1:], start=1):
            (b if i % 2 else a).submit(f"alt{i}", prompt, MAX_TOKENS)
        record["alternating"] = [
            (b if i % 2 else a).result(f"alt{i}") for i in range(1, len(ALTERNATING))
        ]
        b.flush()
        record["after_b"] = b.stats()
        # 2. b killed while a writes; b restarted on its own root serves what a wrote
        for i, prompt in enumerate(WRITTEN):
            a.submit(f"w{i}", prompt, MAX_TOKENS)
        b.kill()
        record["written"] = [a.result(f"w{i}") for i in range(len(WRITTEN))]
        a.flush()
        b = engines["b"] = _start(
            python, model, work, "b2", _fleet_section("b", roots["b"], master, page)
        )
        b.wait_ready()
        record["restarted"] = _one_by_one(b, WRITTEN)
        record["restarted_shared"] = b.generate([ALTERNATING[-1]], MAX_TOKENS)[0]
        record["restarted_stats"] = b.stats()
        # 3. a tenant over its quota, salted so its pages are its own
        record["tenant_a"] = _one_by_one(a, TENANT, cache_salt="small")
        a.flush()
        record["tenant_stats"] = a.stats()
        record["tenant_unsalted_b"] = b.generate([TENANT[0]], MAX_TOKENS)[0]
        # 4. the master killed mid-run: both keep serving by recompute, then recover
        for i, prompt in enumerate(OUTAGE):
            (a if i % 2 else b).submit(f"o{i}", prompt, MAX_TOKENS)
        master.kill()
        record["outage"] = [(a if i % 2 else b).result(f"o{i}") for i in range(len(OUTAGE))]
        record["outage_again"] = b.generate([OUTAGE[1]], MAX_TOKENS)[0]
        master.restart()
        record["recovered"] = _recovered(a, b)
        record["recovered_stats"] = b.stats()
        record["media"] = sorted(media, key=str)
    finally:
        for feed in feeds:
            feed.close()
        for engine in engines.values():
            if engine.alive:
                engine.quit()
    return record


def _routed(router: PrefixRouter, prompt: list[int], pages: int, timeout: float = 30.0) -> Any:
    """The router's choice for ``prompt`` once its events show ``pages`` of it for every
    engine (vLLM publishes each step's events after the step; the stores land later)."""
    names = block_ids(prompt, router.block_size)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if min(count for count, _ in router.index.matched(names).values()) >= pages:
            break
        time.sleep(0.2)
    route = router.route(prompt)
    router.finished(route.engine)  # asked, not sent
    return route


def _recovered(a: ServedEngine, b: ServedEngine) -> list[tuple[list[int], dict, dict]]:
    """After the master restarts: a serves a new prompt and stores it, then b serves it,
    until b loads it from the store (the clients reconnected) or the prompts run out."""
    rounds = []
    for prompt in RECOVERED:
        made = a.generate([prompt], MAX_TOKENS)[0]
        a.flush()
        served = b.generate([prompt], MAX_TOKENS)[0]
        rounds.append((prompt, made, served))
        if served["cached"] > 0:
            break
        time.sleep(2.0)
    return rounds


def test_an_engine_loads_what_another_running_engine_stored(
    fleet: dict[str, Any], reference: dict
) -> None:
    shared_pages = len(SHARED) // BLOCK
    assert _same(reference, ALTERNATING[0], fleet["first"])
    for prompt, result in zip(ALTERNATING[1:], fleet["alternating"], strict=True):
        assert _same(reference, prompt, result)
        assert result["cached"] >= shared_pages * BLOCK  # the prefix from a tier, or vLLM's
    worker = fleet["after_b"]["worker"]
    assert worker["load_hit_pages"] - fleet["before_b"]["worker"]["load_hit_pages"] >= shared_pages
    assert worker["load_failed_pages"] == 0


def test_the_router_sees_each_engines_tiers_through_their_kv_events(fleet: dict[str, Any]) -> None:
    pages = len(SHARED) // BLOCK
    route = fleet["route"]
    # a holds the prefix in its own device cache and file tier, b only through Mooncake
    assert route.matched["a"] == (pages, pages)
    assert route.matched["b"] == (pages, 0)
    assert route.engine == "a"
    media = dict(fleet["media"])
    assert media["KVTIER:0:file"] == "LOCAL" and media["KVTIER:0:segment"] == "LOCAL"
    assert media["KVTIER:1:mooncake"] == "REMOTE"
    assert "GPU" in media  # vLLM's own blocks, published beside kvtier's


def test_a_restarted_engine_serves_what_the_other_wrote_meanwhile(
    fleet: dict[str, Any], reference: dict
) -> None:
    for prompt, result in zip(WRITTEN, fleet["restarted"], strict=True):
        assert _same(reference, prompt, result)
        assert result["cached"] == (len(prompt) - 1) // BLOCK * BLOCK
    assert _same(reference, ALTERNATING[-1], fleet["restarted_shared"])
    assert fleet["restarted_shared"]["cached"] >= len(SHARED)
    assert fleet["restarted_stats"]["worker"]["load_failed_pages"] == 0


def test_a_tenants_quota_holds_and_its_salted_pages_are_its_own(
    fleet: dict[str, Any], reference: dict
) -> None:
    for prompt, result in zip(TENANT, fleet["tenant_a"], strict=True):
        assert _same(reference, prompt, result)
    assert _same(reference, TENANT[0], fleet["tenant_unsalted_b"])
    assert fleet["tenant_unsalted_b"]["cached"] == 0  # never served the tenant's pages
    small = fleet["tenant_stats"]["tenants"]["small"]
    assert small["quota_evictions"] > 0, small  # the second prompt's pages took the room
    assert small["quota_bytes"] == QUOTA_PAGES * fleet["page"]
    assert all(used <= small["quota_bytes"] for used in small["bytes"]), small


def test_the_fleet_serves_through_a_master_outage_and_recovers(
    fleet: dict[str, Any], reference: dict
) -> None:
    for prompt, result in zip(OUTAGE, fleet["outage"], strict=True):
        assert _same(reference, prompt, result)
    assert _same(reference, OUTAGE[1], fleet["outage_again"])
    for prompt, made, served in fleet["recovered"]:
        assert _same(reference, prompt, made) and _same(reference, prompt, served)
    prompt, _, served = fleet["recovered"][-1]
    assert served["cached"] == (len(prompt) - 1) // BLOCK * BLOCK  # the store serves again
    assert fleet["recovered_stats"]["worker"]["load_failed_pages"] == 0


# --- prefill and decode through the store ----------------------------------------------------


@pytest.fixture(scope="module")
def handoff(
    python: Path,
    model: Path,
    master: Any,
    reference: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """A producer (its stores slowed, so its output comes back before its pages land) and
    a consumer on the Mooncake store alone."""
    work = tmp_path_factory.mktemp("handoff")
    store = {**_mooncake(master), "handoff_timeout_s": 3.0}
    producer = _start(
        python,
        model,
        work,
        "producer",
        store,
        kv_role="kv_producer",
        hooks={"save_delay_s": 0.5},
    )
    consumer = _start(python, model, work, "consumer", store, kv_role="kv_consumer")
    record: dict[str, Any] = {}
    try:
        producer.wait_ready()
        consumer.wait_ready()
        clean, flipped, missing = HANDOFF
        # a clean handoff: the consumer asks at once, while the producer still stores
        made = producer.generate([clean], 1)[0]
        record["params"] = made["kv_transfer_params"]
        record["clean"] = _consume(consumer, clean, made)
        record["clean_stats"] = consumer.stats()
        # a corrupted page: the consumer reads it, the check fails, vLLM recomputes
        made = producer.generate([flipped], 1)[0]
        producer.damage(flipped, [4], "flip")
        record["flipped"] = _consume(consumer, flipped, made)
        record["flipped_stats"] = consumer.stats()
        # a missing page: the consumer waits its bound for it, loads what precedes it
        made = producer.generate([missing], 1)[0]
        producer.damage(missing, [6], "delete")
        record["missing"] = _consume(consumer, missing, made)
        record["missing_stats"] = consumer.stats()
        record["producer_stats"] = producer.stats()
    finally:
        for engine in (producer, consumer):
            if engine.alive:
                engine.quit()
    return record


def _consume(consumer: ServedEngine, prompt: list[int], made: dict[str, Any]) -> dict[str, Any]:
    """The consumer serves ``prompt`` with the producer's output's ``kv_transfer_params``,
    as a proxy between the two passes them on."""
    params = made["kv_transfer_params"]
    return consumer.generate([prompt], MAX_TOKENS, kv_transfer_params=params)[0]


def test_the_decode_engine_loads_the_prefill_engines_pages(
    handoff: dict[str, Any], reference: dict
) -> None:
    clean = HANDOFF[0]
    pages = (len(clean) - 1) // BLOCK
    assert handoff["params"] == {"kvtier_pages": len(clean) // BLOCK}
    assert _same(reference, clean, handoff["clean"])
    assert handoff["clean"]["cached"] == pages * BLOCK
    scheduler = handoff["clean_stats"]["scheduler"]
    assert scheduler["handoff_waits"] >= 1  # its pages were still landing when it asked
    assert scheduler["handoff_timeouts"] == 0


def test_a_corrupted_handed_off_page_is_recomputed(
    handoff: dict[str, Any], reference: dict
) -> None:
    assert _same(reference, HANDOFF[1], handoff["flipped"])
    worker = handoff["flipped_stats"]["worker"]
    assert worker["load_failed_pages"] >= 1


def test_a_missing_handed_off_page_is_waited_for_then_recomputed(
    handoff: dict[str, Any], reference: dict
) -> None:
    assert _same(reference, HANDOFF[2], handoff["missing"])
    assert handoff["missing"]["cached"] == 6 * BLOCK  # the pages before the missing one
    scheduler = handoff["missing_stats"]["scheduler"]
    assert scheduler["handoff_timeouts"] == 1
