"""kvtier in real vLLM engines as people run them: vLLM's defaults, hybrid and MLA models.

Each engine is started once per module (``tests/vllm_engine/engine.py``, vLLM's CPU
build) and shared by the checks that need it; vLLM's prefix cache is on in every one, and
a phase that wants its prefix from kvtier empties vLLM's own first (``reset_prefix_cache``),
as memory pressure would:

- a *tight* engine (chunked prefill of 128 tokens, 32 KV blocks): a prompt longer than
  the batch with a partial hit, and preemption under the small KV space with slow stores;
- the *multiprocess* engine (vLLM's default): the next request arrives while the previous
  one's store is still in flight;
- hybrid models under vLLM's hybrid allocator (gpt-oss and Gemma 3 style: sliding-window
  and full-attention groups), an MLA model (DeepSeek-V2 style) on one rank and on two, and
  tensor parallelism 2;
- the state-space hybrids vLLM's CPU build runs (Granite 4.0-H style with its prefix cache
  off, Qwen3-Next style), which kvtier refuses at start-up.

Token comparisons are against a no-connector engine, or, for models and parallelism only
run here, against the same prompt computed in the same engine before kvtier held it (the
negative control in ``tests/test_vllm.py`` shows such a comparison catches wrong KV).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_vllm import BLOCK, TINY_MODEL, Engine, _phases, _vllm_python

RESET = {"reset_prefix_cache": True}
_rng = random.Random(31)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(1, 500) for _ in range(n)]


LONG = _tokens(700)  # 21 full pages, longer than one 128-token batch
CROWD = [_tokens(300) for _ in range(4)]
CROWD_TOKENS = 48
SHARED = _tokens(8 * BLOCK)
FLIGHT = {name: SHARED + _tokens(n) for name, n in (("a", 9), ("b", 13), ("c", 7))}
HYBRID = _tokens(8 * BLOCK) + _tokens(11)
TIGHT = {"max_num_batched_tokens": 128, "num_gpu_blocks": 32, "max_model_len": 800}


def _build(python: Path, target: Path, kind: str, layers: int = 2) -> Path:
    subprocess.run(
        [str(python), str(TINY_MODEL), str(target), "--kind", kind, "--layers", str(layers)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


@pytest.fixture(scope="module")
def python() -> Path:
    return _vllm_python()


@pytest.fixture(scope="module")
def llama(python: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model = _build(python, tmp_path_factory.mktemp("tiny-llama"), "llama")
    return Engine(python, model, tmp_path_factory.mktemp("vllm-production-jobs"))


def _kvtier(root: Path, phases: list[dict[str, Any]], **job: Any) -> dict[str, Any]:
    section = {"backend": "file", "extra_config": {"root": str(root)}}
    return {"connector": "kvtier", "kvtier": section, "phases": phases, **job}


@pytest.fixture(scope="module")
def baseline(llama: Engine) -> dict[str, dict[str, Any]]:
    """Every prompt of this module's Llama checks, with no connector."""
    phases = [
        {"name": "long", "prompts": [LONG]},
        {"name": "crowd", "prompts": CROWD, "max_tokens": CROWD_TOKENS},
        *({"name": name, "prompts": [prompt]} for name, prompt in FLIGHT.items()),
    ]
    return _phases(llama.run({"connector": None, "phases": phases}))


def _delta(phases: dict[str, dict[str, Any]], name: str, before: str, side: str) -> Any:
    now, then = phases[name][side], phases[before][side]
    return lambda key: now.get(key, 0) - then.get(key, 0)


# --- chunked prefill and preemption in a small KV space ------------------------------------


@pytest.fixture(scope="module")
def tight(llama: Engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tight") / "pages"
    phases = [
        {"name": "seed", "prompts": [[*LONG[: 8 * BLOCK], 3]]},  # kvtier holds 8 of 21 pages
        {"name": "long", "prompts": [LONG], **RESET},
        {"name": "long2", "prompts": [LONG], **RESET},
        {
            "name": "crowd",
            "prompts": CROWD,
            "max_tokens": CROWD_TOKENS,
            # stores lag well behind the steps, so the preemption meets some queued or in
            # flight (at 0.05 s they could all finish first, seen on a loaded machine)
            "hooks": {"save_delay_s": 0.3},
        },
    ]
    return _phases(llama.run(_kvtier(root, phases, hooks={}, log_stats=True, **TIGHT)))


def test_chunked_prefill_of_a_long_prompt_with_a_partial_hit(
    tight: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    pages = (len(LONG) - 1) // BLOCK
    assert tight["long"]["tokens"] == baseline["long"]["tokens"]
    assert tight["long"]["cached"] == [8 * BLOCK]  # the 8 stored pages, then 444 computed
    worker = _delta(tight, "long", "seed", "worker")
    assert (worker("load_hit_pages"), worker("load_failed_pages")) == (8, 0)
    assert worker("save_stored_pages") >= pages - 8  # the chunks' pages, stored as they fill
    # the whole prompt is kvtier's now
    assert tight["long2"]["cached"] == [pages * BLOCK]
    assert tight["long2"]["tokens"] == baseline["long"]["tokens"]


def test_preemption_under_a_small_kv_space(
    tight: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> None:
    assert tight["crowd"]["tokens"] == baseline["crowd"]["tokens"]
    scheduler = _delta(tight, "crowd", "long2", "scheduler")
    assert scheduler("requests_preempted") >= 1  # 4 x 348 tokens in 32 blocks of 32
    worker = _delta(tight, "crowd", "long2", "worker")
    # before vLLM reused a preempted request's blocks, its queued stores were dropped or
    # the one in flight waited for (bounded): never a store reading reused blocks
    assert worker("preempt_waits") + worker("save_dropped_pages") >= 1
    assert worker("preempt_wait_timeouts") == 0 and worker("save_tainted_pages") == 0


# --- the multiprocess engine (vLLM's default) -------------------------------------------------


def _logged(log: str, phase: str) -> str:
    start = log.index(f"\nphase {phase}:\n")
    end = log.find("\nphase ", start + 1)
    return log[start : end if end != -1 else None]


def test_the_multiprocess_engine_while_a_store_is_in_flight(
    llama: Engine, baseline: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Request b arrives while a's store (held 2 s by a hook) is still running: b is not
    held up, both are right, and once the store landed c's prefix comes from kvtier."""
    phases = [
        {"name": "a", "prompts": [FLIGHT["a"]]},
        {"name": "b", "prompts": [FLIGHT["b"]]},
        {"name": "c", "prompts": [FLIGHT["c"]], **RESET},
    ]
    job = _kvtier(tmp_path / "pages", phases, spawn=True, log_stats=True)
    job["hooks"] = {"save_delay_s": 2.0}
    result = llama.run(job)
    phases_out = _phases(result)
    for name in FLIGHT:
        assert phases_out[name]["tokens"] == baseline[name]["tokens"], name
    assert phases_out["b"]["seconds"] < 2.0  # b did not wait for a's store
    assert phases_out["b"]["cached"] == [len(SHARED)]  # vLLM's own cache, a's blocks
    assert phases_out["c"]["cached"] == [len(SHARED)]  # vLLM's emptied: kvtier's pages
    stats = _logged(result["stdout"], "c")
    assert f"kvtier_load_hit_pages={len(SHARED) // BLOCK}," in stats
    assert "kvtier_lookup_hit_pages=" in stats


# --- hybrid models (vLLM's hybrid allocator, SupportsHMA), MLA, tensor parallelism --------


def _same_prompt_run(engine: Engine, root: Path, prompt: list[int], **job: Any) -> Any:
    phases = [
        {"name": "computed", "prompts": [prompt]},
        {"name": "loaded", "prompts": [prompt], **RESET},
    ]
    phases += job.pop("more", [])
    return engine.run(_kvtier(root, phases, **job))


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma3"])
def test_hybrid_models_are_served_with_per_group_pages(
    kind: str, python: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = _build(python, tmp_path_factory.mktemp(kind), kind, layers=4)
    engine = Engine(python, model, tmp_path_factory.mktemp(f"{kind}-jobs"))
    pages = (len(HYBRID) - 1) // BLOCK
    # the last page of the first (sliding-window) group, inside the window: read, corrupt
    flip = {"tokens": HYBRID, "page": pages - 1, "group": 0}
    more = [{"name": "flipped", "prompts": [HYBRID], "flip": flip, **RESET}]
    phases = _phases(
        _same_prompt_run(engine, tmp_path_factory.mktemp(kind) / "p", HYBRID, more=more)
    )
    computed, loaded, flipped = phases["computed"], phases["loaded"], phases["flipped"]
    assert loaded["tokens"] == computed["tokens"]
    assert loaded["cached"] == [pages * BLOCK]
    worker = _delta(phases, "loaded", "computed", "worker")
    # every group's pages were stored; the sliding-window ones copied aside first
    assert computed["worker"]["save_staged_pages"] >= pages
    assert computed["worker"]["save_stored_pages"] > pages
    # loads fill only the blocks vLLM allocated: the full groups' pages and the window's
    assert 0 < worker("load_hit_pages") < 4 * pages and worker("load_failed_pages") == 0
    # a corrupt page: vLLM takes failures per request with several groups; it looks the
    # request up again, and only the pages before the bad one are reported cached
    assert flipped["tokens"] == computed["tokens"]
    assert flipped["cached"] == [(pages - 1) * BLOCK]
    after = _delta(phases, "flipped", "loaded", "worker")
    assert (after("load_failed_requests"), after("load_deleted_pages")) == (1, 1)


def test_an_mla_model_is_served(python: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    model = _build(python, tmp_path_factory.mktemp("deepseek"), "deepseek")
    engine = Engine(python, model, tmp_path_factory.mktemp("deepseek-jobs"))
    prompt = HYBRID
    more = [
        {"name": "flipped", "prompts": [prompt], "flip": {"tokens": prompt, "page": 5}, **RESET}
    ]
    result = _same_prompt_run(engine, tmp_path_factory.mktemp("mla") / "p", prompt, more=more)
    # vLLM's CPU build picks MLA's block size itself, whatever was asked (16, or 32 on a
    # CPU with AMX): a page is one block, so every count below is read from what it chose
    block = result["block_size"]
    pages = (len(prompt) - 1) // block
    assert pages > 5, f"the prompt must span more pages than the flipped one ({block=})"
    phases = _phases(result)
    assert phases["loaded"]["tokens"] == phases["computed"]["tokens"]
    assert phases["loaded"]["cached"] == [pages * block]
    worker = _delta(phases, "loaded", "computed", "worker")
    assert (worker("load_hit_pages"), worker("store_hits")) == (pages, pages)
    assert phases["flipped"]["tokens"] == phases["computed"]["tokens"]
    after = _delta(phases, "flipped", "loaded", "worker")
    assert (after("load_failed_pages"), after("load_deleted_pages")) == (1, 1)


def test_an_mla_model_under_tensor_parallelism_2_writes_once_and_every_rank_loads(
    python: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = _build(python, tmp_path_factory.mktemp("deepseek-tp2"), "deepseek")
    engine = Engine(python, model, tmp_path_factory.mktemp("deepseek-tp2-jobs"))
    root = tmp_path_factory.mktemp("mla-tp2") / "pages"
    result = _same_prompt_run(engine, root, HYBRID, tp=2, log_stats=True)
    block = result["block_size"]  # vLLM's CPU build chooses MLA's block size, as with one rank
    pages = (len(HYBRID) - 1) // block
    assert pages >= 2, f"the prompt must span several pages ({block=})"
    phases = _phases(result)
    assert phases["loaded"]["tokens"] == phases["computed"]["tokens"]
    assert phases["loaded"]["cached"] == [pages * block]
    # both ranks hold the same latent: rank 0 alone writes (the prompt's pages and the one
    # its 8 tokens filled), with no rank suffix; rank 1 skips every page it would store
    written = (len(HYBRID) + 8 - 1) // block
    assert len(list(root.rglob("*.kv"))) == written and not list(root.rglob("*_r*of2.kv"))
    computed = _logged(result["stdout"], "computed")
    assert re.search(rf"kvtier_save_skipped_not_writer={written}\b", computed), computed
    # every rank loads the shared pages into its own blocks
    assert phases["loaded"]["scheduler"]["lookup_hit_pages"] == pages
    loaded = _logged(result["stdout"], "loaded")
    assert re.search(rf"kvtier_load_hit_pages={2 * pages}\b", loaded), loaded


@pytest.mark.parametrize(
    ("kind", "job"),
    [
        # Mamba-2 layers: vLLM's CPU build runs them with its prefix cache off only (its
        # CPU prefill keeps no per-block state, which the prefix cache's "align" mode reads)
        ("granite4", {"prefix_caching": False}),
        ("qwen3-next", {}),  # gated delta net layers, vLLM's prefix cache on
    ],
)
def test_a_state_space_hybrid_that_vllm_runs_is_refused_at_start_up(
    kind: str, job: dict[str, Any], python: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM keeps a hybrid's recurrent state as a ``MambaSpec`` group beside attention;
    kvtier stores no such state, so it refuses the model before anything is stored."""
    model = _build(python, tmp_path_factory.mktemp(kind), kind, layers=4)
    engine = Engine(python, model, tmp_path_factory.mktemp(f"{kind}-jobs"))
    phase = {"name": "plain", "prompts": [HYBRID]}
    plain = _phases(engine.run({"connector": None, "phases": [phase], **job}))["plain"]
    assert len(plain["tokens"][0]) == 8  # vLLM's CPU build serves the model
    root = tmp_path_factory.mktemp(f"{kind}-pages") / "pages"
    refused = engine.run(_kvtier(root, [phase], **job))
    error = refused.get("startup_error")
    assert error is not None, "kvtier served a model whose Mamba state it does not store"
    assert (error["type"], error["module"]) == ("UnsupportedCombinationError", "kvtier.core.errors")
    assert error["message"].startswith(
        "vLLM's KV cache has 2 group(s) of FullAttentionSpec, MambaSpec; "
        "kvtier does not store a MambaSpec group"
    )
    assert "SlidingWindowSpec" in error["message"]  # what would work is listed
    assert not list(root.rglob("*.kv"))


def test_tensor_parallelism_2(llama: Engine, tmp_path: Path) -> None:
    prompt = HYBRID
    pages = (len(prompt) - 1) // BLOCK
    result = _same_prompt_run(llama, tmp_path / "pages", prompt, tp=2, log_stats=True)
    phases = _phases(result)
    assert phases["loaded"]["tokens"] == phases["computed"]["tokens"]
    assert phases["loaded"]["cached"] == [pages * BLOCK]
    # a page counts as stored once both ranks stored their heads; each rank loads its own
    assert phases["loaded"]["scheduler"]["lookup_hit_pages"] == pages
    stats = _logged(result["stdout"], "loaded")
    assert re.search(rf"kvtier_load_hit_pages={2 * pages}\b", stats), stats
    assert len(list((tmp_path / "pages").rglob("*_r1of2.kv"))) == pages  # rank 1's heads


# --- a chain of tiers the router can see: KV events, hit sources, metrics, a reset ----------


def _page_bytes(model: Path) -> int:
    """What one of the tiny Llama's pages takes in a tier (envelope and payload)."""
    from kvtier.core.envelope import ENVELOPE_BYTES

    config = json.loads((model / "config.json").read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * BLOCK * 2
    return kv + ENVELOPE_BYTES


@pytest.fixture(scope="module")
def tiered(llama: Engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine on a memory tier of 10.5 pages above a file tier, publishing vLLM's KV
    events: SHARED's 8 pages are stored (and cascade), HYBRID's push 6 of them out of the
    memory tier, then SHARED is loaded from both tiers (and promoted), the connector is
    reset, and SHARED is stored and loaded again under the new epoch."""
    root = tmp_path_factory.mktemp("tiered") / "pages"
    tiers = [
        {
            "backend": "memory",
            "extra_config": {"capacity_bytes": _page_bytes(llama.model) * 21 // 2},
        },
        {"backend": "file", "extra_config": {"root": str(root)}},
    ]
    warm = _tokens(5)  # one step first: the scheduler learns what the last phase did
    phases = [
        {"name": "seed", "prompts": [FLIGHT["a"]]},
        {"name": "push", "prompts": [HYBRID], "warmup": warm},
        {"name": "hit", "prompts": [FLIGHT["b"]], "warmup": warm, **RESET},
        {"name": "promoted", "prompts": [FLIGHT["c"]], "warmup": warm, **RESET},
        {"name": "reset", "prompts": [FLIGHT["c"]], "reset_connector": True},
        {"name": "after-reset", "prompts": [FLIGHT["c"]], "warmup": warm, **RESET},
        {"name": "drain", "prompts": [warm]},
    ]
    job = {
        "connector": "kvtier",
        "kvtier": {"tiers": tiers},
        "phases": phases,
        "kv_events": True,
        "log_stats": True,
    }
    result = llama.run(job)
    return {"phases": _phases(result), "prometheus": result.get("prometheus", {})}


def _chunks(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BLOCK]) for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]


def test_the_tiers_are_served_and_a_reset_starts_a_new_epoch(
    tiered: dict[str, Any], baseline: dict[str, dict[str, Any]]
) -> None:
    phases = tiered["phases"]
    for phase, prompt in (("seed", "a"), ("hit", "b"), ("promoted", "c"), ("reset", "c")):
        assert phases[phase]["tokens"] == baseline[prompt]["tokens"], phase
    assert phases["after-reset"]["tokens"] == baseline["c"]["tokens"]
    pages = len(SHARED) // BLOCK
    assert phases["hit"]["cached"] == [pages * BLOCK]  # both tiers' pages
    hit = _delta(phases, "hit", "push", "worker")
    assert (hit("load_hit_pages"), hit("load_failed_pages")) == (pages, 0)
    # the memory tier held 2 of SHARED's pages, the file tier the 6 it had lost: those
    # were promoted back up
    assert phases["promoted"]["cached"] == [pages * BLOCK]
    # the reset: nothing stored before it is served again; pages stored after it are
    reset = _delta(phases, "reset", "promoted", "scheduler")
    assert (reset("resets"), reset("lookup_hit_pages")) == (1, 0)
    assert phases["reset"]["cached"] == [0]
    assert phases["after-reset"]["cached"] == [pages * BLOCK]


def test_kv_events_carry_each_tiers_pages_under_vllms_own_block_hashes(
    tiered: dict[str, Any],
) -> None:
    events = [event for phase in tiered["phases"].values() for event in phase["kv_events"]]
    # vLLM's own blocks: hash -> tokens (the hashes a KV-aware router knows)
    own: dict[str, tuple[int, ...]] = {}
    for event in events:
        if event["type"] == "BlockStored" and not str(event["medium"]).startswith("KVTIER:"):
            chunks = _chunks(event["token_ids"])
            own.update(zip(event["block_hashes"], chunks, strict=True))
    shared = {h for h, tokens in own.items() if tokens in set(_chunks(SHARED))}
    assert len(shared) == len(SHARED) // BLOCK
    stored: dict[str, set[str]] = {}
    removed: dict[str, set[str]] = {}
    for event in events:
        medium = str(event["medium"])
        if not medium.startswith("KVTIER:"):
            continue
        assert set(event["block_hashes"]) <= set(own), "a hash vLLM never published"
        if event["type"] == "BlockStored":
            stored.setdefault(medium, set()).update(event["block_hashes"])
            # the tokens kvtier announces are vLLM's for the same blocks
            assert _chunks(event["token_ids"]) == [own[h] for h in event["block_hashes"]]
            assert event["block_size"] == BLOCK
        else:
            removed.setdefault(medium, set()).update(event["block_hashes"])
    assert set(stored) == {"KVTIER:0:memory", "KVTIER:1:file"}
    assert shared <= stored["KVTIER:0:memory"] and shared <= stored["KVTIER:1:file"]
    # HYBRID's pages pushed SHARED's out of the memory tier; the reset took the rest
    assert len(shared & removed["KVTIER:0:memory"]) == len(shared)
    assert shared <= removed["KVTIER:1:file"]


def test_vllm_metrics_show_kvtiers_counters_and_the_tier_of_each_hit(
    tiered: dict[str, Any],
) -> None:
    metrics = tiered["prometheus"]
    worker = tiered["phases"]["drain"]["worker"]
    assert metrics["vllm:kvtier_load_hit_pages_total"] == worker["load_hit_pages"] > 0
    assert metrics["vllm:kvtier_store_bytes_written_total"] > 0
    by_source = "vllm:prompt_tokens_cached_by_source_total{source=%s}"
    # "hit" read 6 pages from the file tier (disk) and 2 from the memory tier (host)
    assert metrics[by_source % "disk"] == 6 * BLOCK
    assert metrics[by_source % "host"] >= 2 * BLOCK
