"""Page keys: chaining, namespaces, rank suffixes, input types and the key charset."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.errors import InvalidFieldError, InvalidKeyError, KvtierError
from kvtier.core.geometry import AttentionKind
from kvtier.core.keys import (
    KEY_CHARSET,
    MAX_KEY_LENGTH,
    Namespace,
    PageKeyer,
    external_key,
    token_bytes,
    validate_key,
)

NS = Namespace("llama-3-8b", "0123456789abcdef")


def reference_keys(ns: Namespace, tokens: list[int], page: int, suffix: str = "") -> list[str]:
    """The documented scheme, written out independently of the implementation."""
    canonical = json.dumps(
        ["kvtier-namespace-v1", ns.model, ns.geometry_fingerprint, ns.tenant],
        separators=(",", ":"),
    ).encode()
    hkey = hashlib.blake2b(canonical, digest_size=32).digest()
    prev = hashlib.blake2b(b"kvtier-chain-iv-v1", key=hkey, digest_size=32).digest()
    out = []
    for start in range(0, len(tokens) - page + 1, page):
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start : start + page])
        prev = hashlib.blake2b(prev + data, key=hkey, digest_size=32).digest()
        out.append(f"{hkey[:8].hex()}-{prev.hex()}{suffix}")
    return out


def test_keys_match_the_documented_scheme() -> None:
    tokens = [5, 0, -1, 2**31 - 1, 7, 8, 9, 10, 11]
    keyer = PageKeyer(NS, page_size=4)
    assert keyer.keys(tokens) == reference_keys(NS, tokens, 4)


def test_only_full_pages_get_keys() -> None:
    keyer = PageKeyer(NS, page_size=4)
    assert keyer.keys([1, 2, 3]) == []
    assert len(keyer.keys(list(range(11)))) == 2
    assert len(keyer.keys(list(range(12)))) == 3


def test_key_depends_on_every_earlier_page() -> None:
    keyer = PageKeyer(NS, page_size=4)
    base = keyer.keys(list(range(12)))
    changed_first = keyer.keys([99, *range(1, 12)])
    assert all(a != b for a, b in zip(base, changed_first, strict=True))
    changed_last = keyer.keys([*range(11), 99])
    assert changed_last[:2] == base[:2] and changed_last[2] != base[2]


def test_same_page_tokens_at_another_position_give_another_key() -> None:
    keyer = PageKeyer(NS, page_size=2)
    keys = keyer.keys([1, 2, 1, 2])
    assert keys[0] != keys[1]


def test_namespaces_and_tenants_give_disjoint_keys() -> None:
    tokens = list(range(64))
    spaces = [
        NS,
        Namespace("llama-3-8b", "0123456789abcdef", tenant="a"),
        Namespace("llama-3-8b", "0123456789abcdef", tenant="b"),
        Namespace("llama-3-8b", "0123456789abcdef", tenant=""),
        Namespace("llama-3-70b", "0123456789abcdef"),
        Namespace("llama-3-8b", "fedcba9876543210"),
    ]
    all_keys = [set(PageKeyer(ns, 16).keys(tokens)) for ns in spaces]
    assert len({ns.id for ns in spaces}) == len(spaces)
    for i in range(len(all_keys)):
        for j in range(i + 1, len(all_keys)):
            assert not all_keys[i] & all_keys[j]


def test_namespace_fields_cannot_be_confused_by_concatenation() -> None:
    assert Namespace("ab", "c").id != Namespace("a", "bc").id
    assert Namespace("a", "b", tenant=None).id != Namespace("a", "b", tenant="").id


def test_namespace_id_is_stable_and_safe() -> None:
    assert NS.id == Namespace("llama-3-8b", "0123456789abcdef").id
    assert len(NS.id) == 16
    validate_key(NS.id)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_namespace_rejects_empty_or_wrong_fields(bad: object) -> None:
    with pytest.raises(InvalidFieldError, match=r"namespace\.model"):
        Namespace(bad, "fp")  # type: ignore[arg-type]


def test_rank_suffix_for_mha_under_tp_only() -> None:
    tokens = list(range(8))
    mha0 = PageKeyer(NS, 4, AttentionKind.MHA, tp_rank=0, tp_size=2).keys(tokens)
    mha1 = PageKeyer(NS, 4, "mha", tp_rank=1, tp_size=2).keys(tokens)
    single = PageKeyer(NS, 4, AttentionKind.MHA).keys(tokens)
    mla0 = PageKeyer(NS, 4, AttentionKind.MLA, tp_rank=0, tp_size=4).keys(tokens)
    mla3 = PageKeyer(NS, 4, AttentionKind.MLA, tp_rank=3, tp_size=4).keys(tokens)
    assert all(k.endswith("_r0of2") for k in mha0)
    assert all(k.endswith("_r1of2") for k in mha1)
    assert set(mha0).isdisjoint(mha1)
    assert mla0 == mla3 == single
    assert [k.removesuffix("_r0of2") for k in mha0] == single


@pytest.mark.parametrize(
    "kwargs",
    [{"tp_rank": 2, "tp_size": 2}, {"tp_rank": -1}, {"tp_size": 0}, {"page_size": 0}],
)
def test_keyer_rejects_bad_parallelism(kwargs: dict[str, int]) -> None:
    args = {"page_size": 4, **kwargs}
    with pytest.raises(InvalidFieldError):
        PageKeyer(NS, **args)  # type: ignore[arg-type]


def test_all_token_containers_give_the_same_keys() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    keyer = PageKeyer(NS, page_size=4)
    expected = keyer.keys(tokens)
    variants = [
        tuple(tokens),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.int32),
        np.array(tokens, dtype=np.uint16),
        np.array(tokens, dtype=np.int64)[::-1][::-1],
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
        torch.tensor([[t, 0] for t in tokens])[:, 0],  # not contiguous
        torch.tensor(tokens).reshape(3, 4),
    ]
    for variant in variants:
        assert keyer.keys(variant) == expected, type(variant)


def test_token_bytes_are_little_endian_int32() -> None:
    assert token_bytes([1, -1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert token_bytes(torch.tensor([1, -1])) == token_bytes(np.array([1, -1]))


@pytest.mark.parametrize(
    "tokens",
    [
        [2**31],
        [-(2**31) - 1],
        np.array([2**40]),
        np.array([2**32], dtype=np.uint64),
        torch.tensor([2**33]),
        torch.tensor([1.0, 2.0]),
        np.array([1.5]),
        ["a"],
        [1.0],
    ],
)
def test_unusable_tokens_are_rejected(tokens: object) -> None:
    with pytest.raises(InvalidKeyError):
        PageKeyer(NS, 1).keys(tokens)  # type: ignore[arg-type]


def test_parent_continues_the_chain() -> None:
    keyer = PageKeyer(NS, 4, tp_rank=1, tp_size=2)
    whole = keyer.keys(list(range(20)))
    assert keyer.keys(list(range(8, 20)), parent=whole[1]) == whole[2:]


@pytest.mark.parametrize("parent", ["../x", "abc", "0123456789abcdef-zz", ""])
def test_foreign_parent_is_rejected(parent: str) -> None:
    with pytest.raises(InvalidKeyError):
        PageKeyer(NS, 4).keys([1, 2, 3, 4], parent=parent)


def test_parent_from_other_rank_is_rejected() -> None:
    other = PageKeyer(NS, 4, tp_rank=0, tp_size=2).keys([1, 2, 3, 4])[0]
    with pytest.raises(InvalidKeyError, match="not made by this keyer"):
        PageKeyer(NS, 4, tp_rank=1, tp_size=2).keys([1, 2, 3, 4], parent=other)


@pytest.mark.parametrize(
    "key",
    ["", ".", "..", "../x", "a/b", "x\0", "A", "-a", "_a", "a b", "a.b", "é", "a\n", "x" * 161],
)
def test_validate_key_rejects_unsafe_keys(key: str) -> None:
    with pytest.raises(InvalidKeyError) as info:
        validate_key(key)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvtierError)
    assert info.value.value == key
    assert "[a-z0-9_-]" in str(info.value)


@pytest.mark.parametrize("key", [b"abc", None, 5])
def test_validate_key_rejects_non_strings(key: object) -> None:
    with pytest.raises(InvalidKeyError, match="must be a str"):
        validate_key(key)  # type: ignore[arg-type]


def test_validate_key_accepts_safe_keys() -> None:
    for key in ["a", "0", "abc-def_1", "x" * MAX_KEY_LENGTH]:
        assert validate_key(key) == key


@given(st.text(max_size=200))
def test_validate_key_accepts_exactly_the_charset(key: str) -> None:
    safe = (
        0 < len(key) <= MAX_KEY_LENGTH and all(c in KEY_CHARSET for c in key) and key[0] not in "-_"
    )
    try:
        validate_key(key)
    except InvalidKeyError:
        assert not safe
    else:
        assert safe


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), st.integers(1, 8))
def test_generated_keys_are_always_valid(tokens: list[int], page: int) -> None:
    keyer = PageKeyer(NS, page, tp_rank=11, tp_size=16)
    keys = keyer.keys(tokens)
    assert len(keys) == len(tokens) // page
    for key in keys:
        assert validate_key(key) == key
    assert keys == reference_keys(NS, tokens, page, "_r11of16")


def test_external_keys_are_namespaced_and_validated() -> None:
    raw = hashlib.sha256(b"x").hexdigest()
    key = external_key(NS, raw)
    assert key == f"{NS.id}-x-{raw}"
    keyer = PageKeyer(NS, 4, tp_rank=1, tp_size=2)
    assert keyer.external(raw) == f"{NS.id}-x-{raw}_r1of2"
    assert external_key(Namespace("m", "f", tenant="t"), raw) != key
    for bad in ["../x", "a/b", "", "ABC"]:
        with pytest.raises(InvalidKeyError):
            external_key(NS, bad)
    with pytest.raises(InvalidKeyError, match="rank suffix"):
        external_key(NS, raw, "/r1")
    with pytest.raises(InvalidKeyError):
        external_key(NS, "a" * MAX_KEY_LENGTH)


def test_external_keys_never_equal_chained_keys() -> None:
    keyer = PageKeyer(NS, 4)
    chained = keyer.keys([1, 2, 3, 4])[0]
    digest = chained.split("-", 1)[1]
    assert keyer.external(digest) != chained


def test_tensor_path_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    keyer = PageKeyer(NS, page_size=4)
    expected = keyer.keys(tokens)

    def no_numpy(self: torch.Tensor) -> None:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert keyer.keys(torch.tensor(tokens, dtype=torch.int64)) == expected
    assert keyer.keys(torch.tensor(tokens, dtype=torch.int32)) == expected
    with pytest.raises(InvalidKeyError, match="int32"):
        keyer.keys(torch.tensor([2**40]))


def test_tenant_salt_stays_out_of_repr() -> None:
    ns = Namespace("m", "f", tenant="s3cret-salt")
    assert "s3cret" not in repr(ns) and "m" in repr(ns)


def test_sequences_without_numpy_give_the_same_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.core.keys as keys_module

    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    keyer = PageKeyer(NS, page_size=4)
    expected = keyer.keys(tokens)
    monkeypatch.setattr(keys_module, "_numpy", lambda: None)
    assert keyer.keys(tokens) == keyer.keys(tuple(tokens)) == expected
    assert keyer.keys(iter(tokens)) == expected
    for bad in ([2**31], [1.0], ["5"]):
        with pytest.raises(InvalidKeyError):
            keyer.keys(bad)


def test_other_iterables_and_empty_input() -> None:
    keyer = PageKeyer(NS, page_size=4)
    expected = keyer.keys([0, 1, 2, 3, 4, 5, 6, 7])
    assert keyer.keys(range(8)) == keyer.keys(iter(range(8))) == expected
    assert keyer.keys([]) == keyer.keys(np.array([], dtype=np.int64)) == []
    assert token_bytes([]) == b""
    for bad in (["5"], [[1, 2], [3]], [2**64], [True, 0.5]):
        with pytest.raises(InvalidKeyError):
            keyer.keys(bad)  # type: ignore[arg-type]


def test_a_batch_is_checked_in_one_pass_with_the_same_verdicts() -> None:
    from kvtier.core.keys import MAX_KEY_LENGTH, validate_keys

    good = ["a", "0-x_y", "z" * MAX_KEY_LENGTH]
    assert validate_keys(good) == good and validate_keys([]) == []
    for bad in ("", "-lead", "UPPER", "a\nb", "a/b", "x" * (MAX_KEY_LENGTH + 1), 7):
        with pytest.raises(InvalidKeyError) as one:
            validate_key(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError) as batch:
            validate_keys([*good, bad])  # type: ignore[list-item]
        assert str(batch.value) == str(one.value)  # the same culprit, the same words


@given(st.lists(st.text(alphabet="ab0_-\nZ/", max_size=6), max_size=5))
def test_a_batch_passes_exactly_when_every_key_does(keys: list[str]) -> None:
    from kvtier.core.keys import validate_keys

    def each_ok() -> bool:
        try:
            for key in keys:
                validate_key(key)
        except InvalidKeyError:
            return False
        return True

    expected = each_ok()
    try:
        validate_keys(keys)
        got = True
    except InvalidKeyError:
        got = False
    assert got is expected
