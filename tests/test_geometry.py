"""KV geometry: sizes, validation and the stable fingerprint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvtier.core.errors import InvalidFieldError
from kvtier.core.geometry import AttentionKind, KVGeometry, dtype_from_name, dtype_name


def test_8b_class_page_is_8_mib() -> None:
    geometry = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bf16")
    assert geometry.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert geometry.bytes_per_page == 8 * 1024 * 1024


def test_mla_has_one_latent_per_token_per_layer() -> None:
    geometry = KVGeometry.mla(
        num_layers=61,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        dtype=torch.float8_e4m3fn,
        page_size=64,
    )
    assert geometry.attention is AttentionKind.MLA
    assert geometry.kv_count == 1
    assert geometry.head_dim == 576
    assert geometry.bytes_per_page == 61 * 576 * 1 * 64


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_dtype_names_round_trip(name: str) -> None:
    assert dtype_name(dtype_from_name(name)) == name


def test_unknown_dtype_suggests_the_closest() -> None:
    with pytest.raises(InvalidFieldError, match=r"did you mean 'bfloat16'\?.*supported:"):
        dtype_from_name("bfloat61")


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_non_positive_sizes_are_refused_naming_the_field(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 4}
    kwargs[field] = bad
    with pytest.raises(InvalidFieldError, match=f"^{field}: must be a positive integer"):
        KVGeometry.mha(**kwargs)  # type: ignore[arg-type]


def test_mla_with_several_heads_is_refused() -> None:
    with pytest.raises(InvalidFieldError, match="num_kv_heads must be 1"):
        KVGeometry(AttentionKind.MLA, 2, 4, 8, torch.bfloat16, 4)


def test_fingerprint_distinguishes_every_field() -> None:
    base = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=64)
    seen = {KVGeometry.mha(**base).fingerprint}  # type: ignore[arg-type]
    for field, other in [
        ("num_layers", 31),
        ("num_kv_heads", 4),
        ("head_dim", 64),
        ("dtype", "float16"),
        ("page_size", 32),
    ]:
        seen.add(KVGeometry.mha(**{**base, field: other}).fingerprint)  # type: ignore[arg-type]
    seen.add(
        KVGeometry.mla(
            num_layers=32, kv_lora_rank=64, qk_rope_head_dim=64, page_size=64
        ).fingerprint
    )
    assert len(seen) == 7


def test_fingerprint_is_stable_across_processes_and_hash_seeds() -> None:
    """Pages written by one process must be readable by another: no hash() in the mix."""
    code = (
        "from kvtier import KVGeometry; print(KVGeometry.mha(num_layers=32, "
        "num_kv_heads=8, head_dim=128).fingerprint)"
    )
    prints = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    # Golden value: changing it breaks every stored page, so it must be deliberate.
    assert prints == {"2f219d4e07d05dfe"}
