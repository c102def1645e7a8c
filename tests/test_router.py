"""The reference router's index and choices, from KV events as vLLM and SGLang publish them.

The engines' real publishers feed it in ``tests/test_vllm_fleet.py`` and
``benchmarks/fleet.py``; here each rule is driven by hand-made events.
"""

from __future__ import annotations

import random

import pytest

from kvtier.core.errors import InvalidFieldError
from kvtier.integrations.router import (
    Cleared,
    PrefixRouter,
    Removed,
    Stored,
    block_ids,
    decode_batch,
    normalized_events,
    shared_medium,
)
from kvtier.testing.optional import require

BS = 4
_rng = random.Random(7)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(1, 1000) for _ in range(n)]


PREFIX = _tokens(6 * BS)
OTHER = _tokens(6 * BS)


def _stored(tokens: list[int], medium: str | None = "GPU", *, seed: str = "a") -> Stored:
    """``tokens``' whole blocks stored, hashed as an engine with hash seed ``seed`` would."""
    blocks = len(tokens) // BS
    hashes = [f"{seed}{hash(tuple(tokens[: (i + 1) * BS]))}" for i in range(blocks)]
    return Stored(hashes, None, tokens[: blocks * BS], BS, medium)


def _hashes(event: Stored) -> list[str]:
    return [str(h) for h in event.block_hashes]


def test_block_names_are_equal_for_equal_prefixes_only() -> None:
    one, two = block_ids(PREFIX, BS), block_ids([*PREFIX[:-1], PREFIX[-1] + 1], BS)
    assert len(one) == 6 and one[:5] == two[:5] and one[5] != two[5]
    changed = [PREFIX[0] + 1, *PREFIX[1:]]
    assert not set(block_ids(changed, BS)) & set(one)  # every later block is another prefix


def test_a_request_goes_to_the_engine_holding_its_longest_prefix() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    router.apply("a", _stored(PREFIX[: 3 * BS]))
    router.apply("b", _stored(PREFIX))
    route = router.route([*PREFIX, 1, 2])
    assert route.engine == "b"
    assert route.matched == {"a": (3, 3), "b": (6, 6)}


def test_engines_hashing_blocks_differently_agree_on_a_block() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    router.apply("a", _stored(PREFIX, seed="a"))
    router.apply("b", _stored(PREFIX[: 2 * BS], seed="b"))
    assert router.route(PREFIX).matched == {"a": (6, 6), "b": (2, 2)}


def test_a_page_in_a_shared_tier_counts_for_every_engine_and_load_breaks_the_tie() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    router.apply("a", _stored(PREFIX, "KVTIER:1:mooncake"))
    router.started("a")
    route = router.route(PREFIX)
    assert route.matched == {"a": (6, 0), "b": (6, 0)}
    assert route.engine == "b"  # a is busier


def test_a_page_in_an_engines_own_tier_counts_for_that_engine_alone() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    router.apply("a", _stored(PREFIX, "KVTIER:1:mooncake"))
    router.apply("b", _stored(PREFIX[: 4 * BS], "KVTIER:0:file"))
    route = router.route(PREFIX)
    assert route.matched == {"a": (6, 0), "b": (6, 4)}
    assert route.engine == "b"  # as long a prefix, more of it its own


def test_a_medium_an_engine_calls_remote_is_shared() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    event = _stored(PREFIX, "OTHER-STORE")
    router.apply(
        "a", Stored(event.block_hashes, None, event.token_ids, BS, "OTHER-STORE", locality="REMOTE")
    )
    assert router.route(PREFIX).matched == {"a": (6, 0), "b": (6, 0)}


def test_an_event_without_tokens_is_placed_by_the_engines_earlier_event_of_its_block() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    gpu = _stored(PREFIX)
    router.apply("a", gpu)
    router.apply("a", Removed(gpu.block_hashes, "GPU"))
    assert router.route(PREFIX).matched["a"] == (0, 0)
    router.apply("a", Stored(gpu.block_hashes, None, [], BS, "KVTIER:0:file"))
    assert router.route(PREFIX).matched["a"] == (6, 6)
    router.apply("b", Stored(["never-described"], None, [], BS, "KVTIER:0:file"))
    assert router.index.counters["unplaced_blocks"] == 1


def test_a_block_whose_parent_is_unknown_is_left_out_not_guessed() -> None:
    router = PrefixRouter(["a"], block_size=BS)
    router.apply("a", Stored(["x"], "unknown-parent", PREFIX[BS : 2 * BS], BS, "GPU"))
    assert router.index.counters["unplaced_blocks"] == 1
    assert router.route(PREFIX).matched["a"] == (0, 0)


def test_a_chain_continued_from_its_parent_block() -> None:
    router = PrefixRouter(["a"], block_size=BS)
    first = _stored(PREFIX[: 2 * BS])
    router.apply("a", first)
    rest = Stored(["c", "d"], first.block_hashes[-1], PREFIX[2 * BS : 4 * BS], BS, "GPU")
    router.apply("a", rest)
    assert router.route(PREFIX).matched["a"] == (4, 4)


def test_removed_and_cleared_blocks_stop_counting_in_their_medium_only() -> None:
    router = PrefixRouter(["a"], block_size=BS)
    gpu = _stored(PREFIX)
    router.apply("a", gpu)
    router.apply("a", Stored(gpu.block_hashes[:3], None, [], BS, "KVTIER:0:file"))
    router.apply("a", Cleared())
    assert router.route(PREFIX).matched["a"] == (3, 3)  # the file tier still holds 3
    router.apply("a", Removed(gpu.block_hashes[1:2], "KVTIER:0:file"))
    assert router.route(PREFIX).matched["a"] == (1, 1)


def test_a_shared_page_removed_by_one_engine_is_gone_for_all() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    event = _stored(PREFIX, "KVTIER:1:mooncake")
    router.apply("a", event)
    router.apply("a", Removed(event.block_hashes[2:3], "KVTIER:1:mooncake"))
    assert router.route(PREFIX).matched == {"a": (2, 0), "b": (2, 0)}


def test_blocks_keyed_by_more_than_tokens_are_left_out_and_route_by_load() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    keyed = _stored(PREFIX)
    router.apply("a", Stored(keyed.block_hashes, None, keyed.token_ids, BS, "GPU", keyed=True))
    assert router.index.counters["keyed_events"] == 1
    router.started("a")
    route = router.route(PREFIX, keyed=True)
    assert route.engine == "b" and route.matched == {"a": (0, 0), "b": (0, 0)}


def test_an_engine_much_busier_than_the_least_busy_is_passed_over() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS, balance_slack=2)
    router.apply("a", _stored(PREFIX))
    assert [router.route(PREFIX).engine for _ in range(3)] == ["a", "a", "a"]
    assert router.route(PREFIX).engine == "b"  # a is 3 ahead, beyond the slack of 2
    router.finished("a")
    assert router.route(PREFIX).engine == "a"


def test_weighing_work_spreads_a_hot_prefix_once_its_engine_is_busy() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS, balance_slack=100, work_weight=1.0)
    router.apply("a", _stored(PREFIX))  # 24 tokens
    hot = [*PREFIX, 1, 2, 3]  # a computes 3 of its tokens, b all 27
    assert router.route(hot, request_id="r1").engine == "a"  # 3 against 27
    assert router.route(_tokens(30), request_id="r2").engine == "b"  # 30 + 3 against 30
    assert router.route(hot, request_id="r3").engine == "a"  # 3 + 3 against 27 + 30
    assert router.route(_tokens(100), request_id="r4").engine == "a"  # 100 + 6 against 130
    assert router.route(hot, request_id="r5").engine == "b"  # 3 + 106 against 27 + 30
    router.finished("a", "r4")
    assert router.route(hot, request_id="r6").engine == "a"  # 3 + 6 against 27 + 57
    with pytest.raises(InvalidFieldError, match="work_weight"):
        PrefixRouter(["a"], block_size=BS, work_weight=-1.0)


def test_requests_matching_nothing_alternate_between_idle_engines() -> None:
    router = PrefixRouter(["a", "b"], block_size=BS)
    chosen = []
    for _ in range(4):
        engine = router.route(OTHER).engine
        chosen.append(engine)
        router.finished(engine)
    assert chosen == ["a", "b", "a", "b"]


def test_which_media_are_shared_comes_from_the_backends_features() -> None:
    assert shared_medium("KVTIER:1:mooncake")
    assert shared_medium("EXTERNAL")  # SGLang's name for a shared tier
    assert not shared_medium("KVTIER:0:file")
    assert not shared_medium("KVTIER:0:segment")
    assert not shared_medium("GPU") and not shared_medium(None)
    assert not shared_medium("KVTIER:0:no-such-backend")


def test_engine_events_are_read_by_their_type_and_field_names() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [b"h"],
        "parent_block_hash": None,
        "token_ids": PREFIX[:BS],
        "block_size": BS,
        "medium": "KVTIER:0:file",
        "extra_keys": [None],
    }
    salted = {**stored, "cache_salt": "tenant-a"}  # SGLang's field
    adapted = {**stored, "extra_keys": [("adapter",)]}  # vLLM's
    events = normalized_events(
        [
            stored,
            salted,
            adapted,
            {"type": "BlockRemoved", "block_hashes": [b"h"]},  # no medium: the device's
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNewer", "block_hashes": [b"h"]},
        ]
    )
    assert events[0] == Stored([b"h"], None, PREFIX[:BS], BS, "KVTIER:0:file", False)
    assert [e.keyed for e in events[1:3] if isinstance(e, Stored)] == [True, True]
    assert events[3] == Removed([b"h"], None) and isinstance(events[4], Cleared)
    assert len(events) == 5


def test_sglangs_published_batches_decode_without_the_engine() -> None:
    """A batch encoded by SGLang's own event classes, as its publisher sends it."""
    try:
        import msgspec
        from sglang.srt.disaggregation.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )
    except ImportError as exc:
        require("sglang", f"SGLang's KV event classes do not import here: {exc}")
        raise
    fields = {"parent_block_hash": None, "lora_id": None, "medium": "EXTERNAL"}
    batch = KVEventBatch(
        ts=1.0,
        events=[
            BlockStored(block_hashes=[11, 12], token_ids=PREFIX[: 2 * BS], block_size=BS, **fields),
            BlockRemoved(block_hashes=[12], medium="EXTERNAL"),
            AllBlocksCleared(),
        ],
    )
    events = decode_batch(msgspec.msgpack.encode(batch))
    assert events == [
        Stored([11, 12], None, PREFIX[: 2 * BS], BS, "EXTERNAL", False),
        Removed([12], "EXTERNAL"),
        Cleared(),
    ]
    router = PrefixRouter(["a", "b"], block_size=BS)
    for event in events[:1]:
        router.apply("a", event)
    assert router.route(PREFIX).matched == {"a": (2, 0), "b": (2, 0)}  # shared: EXTERNAL


def test_a_batch_that_is_not_one_is_refused() -> None:
    import msgspec

    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))


def test_bad_router_settings_are_refused_with_what_works() -> None:
    with pytest.raises(InvalidFieldError, match="block_size"):
        PrefixRouter(["a"], block_size=0)
    with pytest.raises(InvalidFieldError, match="engines"):
        PrefixRouter([], block_size=BS)
    router = PrefixRouter(["a"], block_size=BS)
    with pytest.raises(InvalidFieldError, match="'z' is not one of"):
        router.apply("z", Cleared())
